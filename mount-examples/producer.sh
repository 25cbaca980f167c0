#!/usr/bin/env bash
# producer.sh: publish files into a spoolfs queue the classic way, with coreutils only.
#
# Each file is written into QUEUE/partial/ (an upload in progress, invisible to consumers),
# then `mv`ed into QUEUE/ready/: that rename is the publish. It is atomic (consumers see the
# whole file or nothing) and on disk before `mv` returns.
#
# Usage:
#   producer.sh [-s SPOOL] [-q QUEUE] [-n COUNT] [-b BYTES] [-p PREFIX] [FILE...]
#
#   With FILE arguments, each file is copied in and published under its own name.
#   Without, COUNT generated files (a name line, then BYTES random bytes) are published as
#   PREFIX-000001, PREFIX-000002, ...
#
#   -s SPOOL    the mount point                      (env SPOOL,  default /mnt/spool)
#   -q QUEUE    the queue, created if missing; ''    (env QUEUE,  default jobs)
#               when SPOOL is a `spoolfs --queue` mount
#   -n COUNT    files to generate                    (env COUNT,  default 10)
#   -b BYTES    random bytes per generated file      (env BYTES,  default 1024)
#   -p PREFIX   name prefix of generated files       (env PREFIX, default <time>-<pid>)
#
# Prints the name of every published message on stdout. Exits non-zero at the first failure
# (for instance EEXIST: a message of the same name is already waiting in ready/).
set -euo pipefail
export LC_ALL=C

SPOOL=${SPOOL:-/mnt/spool}
QUEUE=${QUEUE-jobs}
COUNT=${COUNT:-10}
BYTES=${BYTES:-1024}
PREFIX=${PREFIX:-$(date +%Y%m%dT%H%M%S)-$$}

usage() {  # the comment block above, without its leading "# "
  local line
  { read -r; while IFS= read -r line && [[ $line == '#'* ]]; do
      line=${line#\#}; printf '%s\n' "${line# }"; done; } < "$0" >&2
  exit "${1:-2}"
}

while getopts ':s:q:n:b:p:h' opt; do
  case $opt in
    s) SPOOL=$OPTARG ;;
    q) QUEUE=$OPTARG ;;
    n) COUNT=$OPTARG ;;
    b) BYTES=$OPTARG ;;
    p) PREFIX=$OPTARG ;;
    h) usage 0 ;;
    :) printf 'producer.sh: -%s needs an argument\n' "$OPTARG" >&2; usage ;;
    *) printf 'producer.sh: unknown option -%s\n' "$OPTARG" >&2; usage ;;
  esac
done
shift $((OPTIND - 1))

dir=$SPOOL${QUEUE:+/$QUEUE}
[[ -d $dir ]] || mkdir -- "$dir"   # mkdir at the root of a spool creates a queue

publish() {  # publish NAME: partial/NAME -> ready/NAME
  mv -- "$dir/partial/$1" "$dir/ready/$1"
  printf '%s\n' "$1"
}

if (($# > 0)); then
  for src in "$@"; do
    name=${src##*/}
    cp -- "$src" "$dir/partial/$name"
    publish "$name"
  done
else
  for ((i = 1; i <= COUNT; i++)); do
    printf -v name '%s-%06d' "$PREFIX" "$i"
    { printf '%s\n' "$name"; head -c "$BYTES" /dev/urandom; } > "$dir/partial/$name"
    publish "$name"
  done
fi
