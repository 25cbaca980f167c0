"""The seed-004 consumer: list ``ready/``, test each name with ``-e``, claim it by ``mv`` into a
view of one's own, test it is there, "import" it, move it to ``success/``. Run as real ``bash``
processes, many at once over several mounts, as the seed's users ran theirs over NFS.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from helpers.waiting import patience

# Paths are absolute on every step (never a cwd inside the mount), so a consumer whose mount
# died and came back carries on. While its mount is down nothing is listed: it waits, and it
# ends only when the producer is done, ``ready/`` lists empty and its own view is empty.
# Log lines: "claim NAME" once the claim is verified, "finish NAME" once in success/.
CONSUMER = r"""
shopt -s nullglob
q=$1 c=$2 log=$3 done=$4 limit=$5
mine="$q/working/$c"
while (( SECONDS < limit )); do
  if [ ! -d "$q/ready" ] || [ ! -d "$mine" ]; then sleep 0.2; continue; fi
  # what this consumer holds (an import interrupted by a daemon restart) is finished first
  for f in "$mine"/*; do
    mv -- "$f" "$q/success/" 2>/dev/null && printf 'finish %s\n' "${f##*/}" >> "$log"
  done
  files=("$q"/ready/*)
  if (( ${#files[@]} == 0 )); then
    held=("$mine"/*)
    if [ -e "$done" ] && [ -d "$q/ready" ] && (( ${#held[@]} == 0 )); then exit 0; fi
    sleep 0.1
    continue
  fi
  for f in "${files[@]}"; do
    n=${f##*/}
    [ -e "$q/ready/$n" ] || continue
    mv -- "$q/ready/$n" "$mine/" 2>/dev/null || continue
    [ -e "$mine/$n" ] || continue
    printf 'claim %s\n' "$n" >> "$log"
    mv -- "$mine/$n" "$q/success/" 2>/dev/null && printf 'finish %s\n' "$n" >> "$log"
  done
done
exit 3
"""


@dataclass
class Consumer:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def lines(self) -> list[tuple[str, str]]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_bytes().decode(errors="surrogateescape").splitlines():
            verb, _, name = line.partition(" ")
            out.append((verb, name))
        return out


def start_consumers(queue_dirs: Sequence[Path], count: int, logdir: Path, done: Path,
                    limit: float) -> list[Consumer]:
    """``count`` consumers ``c00``, ``c01``, ...; consumer i works through ``queue_dirs[i % n]``.
    Each makes its own view first (``mkdir working/cNN``)."""
    logdir.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        name = f"c{i:02d}"
        q = queue_dirs[i % len(queue_dirs)]
        (q / "working" / name).mkdir()
        log = logdir / f"{name}.log"
        p = subprocess.Popen(["bash", "-c", CONSUMER, "consumer", str(q), name, str(log),
                              str(done), str(int(patience(limit)))],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        out.append(Consumer(name, p, log))
    return out


def wait_consumers(consumers: Sequence[Consumer], timeout: float) -> list[str]:
    """Wait for every consumer; the problems (non-zero exits, time-outs) as lines."""
    problems = []
    for c in consumers:
        try:
            _, err = c.proc.communicate(timeout=patience(timeout))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.communicate()
            problems.append(f"consumer {c.name} did not finish")
            continue
        if c.proc.returncode != 0:
            problems.append(f"consumer {c.name} exited {c.proc.returncode}: "
                            f"{err.decode(errors='replace')[-500:]}")
    return problems
