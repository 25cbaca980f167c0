"""Two unprivileged users and their groups, for the roles tests (DESIGN §8): who they are and
how a command runs as one of them (``setpriv``)."""

from __future__ import annotations

import subprocess

PRODUCER, CONSUMER = "spoolprod", "spoolcons"
PRODUCERS, CONSUMERS = "spoolproducers", "spoolconsumers"
#: users and groups made for these tests: (name, primary group, supplementary groups)
USERS = [(PRODUCER, PRODUCERS, ""), (CONSUMER, CONSUMER, CONSUMERS)]
GROUPS = [PRODUCERS, CONSUMERS, CONSUMER]
LOCK = "/tmp/spoolfs-test-roles-users.lock"

AS_PRODUCER = ["setpriv", f"--reuid={PRODUCER}", f"--regid={PRODUCERS}", "--init-groups"]
AS_CONSUMER = ["setpriv", f"--reuid={CONSUMER}", f"--regid={CONSUMER}", "--init-groups"]
#: the consumer without its supplementary groups
AS_CONSUMER_ALONE = ["setpriv", f"--reuid={CONSUMER}", f"--regid={CONSUMER}", "--clear-groups"]
DENIED = "Permission denied"


def exists(db: str, name: str) -> bool:
    return subprocess.run(["getent", db, name], capture_output=True).returncode == 0
