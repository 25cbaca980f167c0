#!/usr/bin/env bash
# consumer.sh: claim, process and finish the messages of a spoolfs queue, with coreutils only.
#
# The loop of the classic directory pattern, which spoolfs makes safe:
#   mkdir QUEUE/working/NAME               this consumer's own view (made once)
#   mv QUEUE/ready/F QUEUE/working/NAME/   claim: exactly one consumer wins; the others get
#                                          ENOENT and move on to the next file
#   COMMAND... QUEUE/working/NAME/F        process (default: sha256sum)
#   mv ... QUEUE/success/                  finish, when COMMAND exits 0
#   mv ... QUEUE/error/                    finish, when it fails; the reason is recorded first
#                                          in user.spool.error if setfattr is installed
#
# Messages already in working/NAME/ when it starts (claimed by an earlier run that died) are
# processed first: give each consumer a stable -c NAME to pick up where it stopped.
# SIGTERM or SIGINT: the message in hand is finished, then it exits.
#
# Usage:
#   consumer.sh [-s SPOOL] [-q QUEUE] [-c NAME] [-i SECONDS] [-H SECONDS] [--drain]
#               [--] [COMMAND [ARG...]]
#
#   COMMAND ARG... FILE runs once per message, with FILE the path in working/NAME/.
#   -s SPOOL      the mount point                  (env SPOOL,    default /mnt/spool)
#   -q QUEUE      the queue; '' when SPOOL is a    (env QUEUE,    default jobs)
#                 `spoolfs --queue` mount
#   -c NAME       consumer name: 1-64 of [A-Za-z0-9._-]
#                                                  (env CONSUMER, default <host>.<pid>)
#   -i SECONDS    how often to look again while ready/ is empty (default 1)
#   -H SECONDS    touch the file every SECONDS while COMMAND runs: the lease heartbeat
#                 (default 0: off)
#   --drain       exit once ready/ is empty instead of waiting for more
#
# Logs one line per message on stderr. Exits 0 when drained or stopped, non-zero when the
# spool refuses something a consumer should never see refused.
set -euo pipefail
shopt -s nullglob
export LC_ALL=C   # mv's messages are matched below

SPOOL=${SPOOL:-/mnt/spool}
QUEUE=${QUEUE-jobs}
NAME=${CONSUMER:-$(uname -n).$$}
interval=1
heartbeat=0
drain=0

usage() {  # the comment block above, without its leading "# "
  local line
  { read -r; while IFS= read -r line && [[ $line == '#'* ]]; do
      line=${line#\#}; printf '%s\n' "${line# }"; done; } < "$0" >&2
  exit "${1:-2}"
}
die() { printf 'consumer.sh: %s\n' "$*" >&2; exit 1; }
log() { printf 'consumer %s: %s\n' "$NAME" "$*" >&2; }

while (($#)); do
  case $1 in
    -s) SPOOL=${2?-s needs a path}; shift 2 ;;
    -q) QUEUE=${2?-q needs a queue name}; shift 2 ;;
    -c) NAME=${2?-c needs a consumer name}; shift 2 ;;
    -i) interval=${2?-i needs seconds}; shift 2 ;;
    -H | --heartbeat) heartbeat=${2?-H needs seconds}; shift 2 ;;
    --drain) drain=1; shift ;;
    -h | --help) usage 0 ;;
    --) shift; break ;;
    -*) printf 'consumer.sh: unknown option %s\n' "$1" >&2; usage ;;
    *) break ;;
  esac
done
cmd=("$@")
((${#cmd[@]})) || cmd=(sha256sum --)

dir=$SPOOL${QUEUE:+/$QUEUE}
view=$dir/working/$NAME
[[ -d $dir ]] || mkdir -- "$dir"   # mkdir at the root of a spool creates a queue
[[ -d $dir/ready ]] || die "$dir is not a queue (no ready/ in it)"
mkdir -p -- "$view"                # mkdir in working/ registers a consumer view

stop=0
trap 'stop=1' TERM INT

beat() {  # touch FILE every $heartbeat seconds until killed: each touch extends the lease
  local s=
  trap 'kill "$s" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "$heartbeat" & s=$!
    wait "$s"
    touch -c -- "$1" || exit 0
  done
}

claim() {  # claim ready/NAME into the view; false when another consumer got it first
  local err
  err=$(mv -- "$dir/ready/$1" "$view/" 2>&1) && return 0
  case $err in
    *'No such file or directory'*) return 1 ;;   # lost the race: normal
    *) die "claim refused: $err" ;;
  esac
}

finish() {  # finish NAME into STATE (success or error)
  local err
  err=$(mv -- "$view/$1" "$dir/$2/" 2>&1) && { log "$1 -> $2"; return 0; }
  case $err in
    # Gone from the view: it was taken back (an expired lease); whoever holds it now decides.
    *'No such file or directory'*) log "$1: no longer ours, not finished" ;;
    *) die "finish refused: $err" ;;
  esac
}

process() {  # run the command on the claimed message NAME, then finish it
  local path=$view/$1 rc=0 hb=
  if [[ $heartbeat != 0 ]]; then
    beat "$path" </dev/null >/dev/null 2>&1 &
    hb=$!
  fi
  "${cmd[@]}" "$path" </dev/null || rc=$?
  if [[ -n $hb ]]; then kill "$hb" 2>/dev/null || true; wait "$hb" || true; fi
  if ((rc == 0)); then
    finish "$1" success
  else
    if command -v setfattr >/dev/null; then
      setfattr -n user.spool.error -v "${cmd[0]} exited $rc" -- "$path" || true
    fi
    finish "$1" error
  fi
}

idle() {  # wait $interval seconds, or less if told to stop
  sleep "$interval" >/dev/null 2>&1 &
  wait $! || kill $! 2>/dev/null || true
}

for left in "$view"/*; do   # claimed by an earlier run that did not finish them
  ((stop)) && break
  process "${left##*/}"
done

while ((!stop)); do
  files=("$dir"/ready/*)    # the glob skips dot-names: uploads still in progress
  n=${#files[@]}
  if ((n == 0)); then
    ((drain)) && break
    idle
    continue
  fi
  # Start at a random place so that consumers do not all race for the same file.
  k=$((RANDOM % n))
  for src in "${files[@]:k}" "${files[@]:0:k}"; do
    ((stop)) && break
    name=${src##*/}
    if claim "$name"; then
      process "$name"
    fi
  done
done

rmdir -- "$view" 2>/dev/null || true   # only when empty: unfinished messages stay in the view
