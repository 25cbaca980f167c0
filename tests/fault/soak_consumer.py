"""One soak consumer: claims from ready/ into its view, checks, finishes into success/. With
probability ``--die`` per claim it kills itself with SIGKILL while holding the message, like a
consumer that crashes mid-work: only the lease brings that message back.

Usage: soak_consumer.py QUEUE_DIR CONSUMER SEED DIE_PROBABILITY
Each line it prints is ``claimed NAME``, ``done NAME``, ``bad NAME`` (content mismatch) or
``lost NAME``: the lease ran out before the finish (a slow machine), the message went back to
``ready/`` and the finish got ENOENT. A real consumer counts that and goes on; the message is
someone else's now.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
import time


def main() -> int:
    qdir, consumer, seed, die = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rng = random.Random(seed)
    ready, view, success = (os.path.join(qdir, "ready"), os.path.join(qdir, "working", consumer),
                            os.path.join(qdir, "success"))
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < 5.0:  # the harness stops us earlier
        names = [n for n in os.listdir(ready) if not n.startswith(".")]
        if not names:
            time.sleep(0.05)
            continue
        idle_since = time.monotonic()
        rng.shuffle(names)
        for name in names[:20]:
            try:
                os.rename(os.path.join(ready, name), os.path.join(view, name))
            except FileNotFoundError:
                continue  # another consumer won
            print("claimed", name, flush=True)
            if rng.random() < die:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                with open(os.path.join(view, name), "rb") as f:
                    data = f.read()
                body, _, digest = data.rpartition(b"\n")
                ok = hashlib.sha256(body).hexdigest().encode() == digest
                os.rename(os.path.join(view, name), os.path.join(success, name))
            except FileNotFoundError:
                print("lost", name, flush=True)
                continue
            print("done" if ok else "bad", name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
