"""The lifecycle timer (DESIGN §4): every daemon of a store runs one.

Each tick it re-reads the queue policies, extends the leases of claimed messages held open
here, expires the leases that ran out (working/ -> error/), sends due retries back to ready/
and purges finished messages past their retention. It finds its work through the store's
indexes (``due_leases``, ``due_retries``, ``finished_before``), never by scanning messages, and
every move is a compare-and-set on what it saw, so with several daemons on one store each
message moves once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from spoolfs.core import lifecycle as L
from spoolfs.core.errors import SpoolError, StoreFailure
from spoolfs.core.policy import show_duration
from spoolfs.core.rules import Action, State
from spoolfs.core.transitions import Context
from spoolfs.service.moves import DAEMON, apply
from spoolfs.service.spool import Spool, free_name
from spoolfs.store.base import Entry, WriteTx

log = logging.getLogger(__name__)

TICK = 0.5  # seconds between rounds: expiries land within this of their time
BATCH = 500  # messages moved per transaction; more wait for the next round
PURGE_EVERY = 5.0  # seconds between retention sweeps, unless the last one found a full batch


class Lifecycle:
    def __init__(self, spool: Spool, clock: Callable[[], int] | None = None) -> None:
        self.spool = spool
        self.clock = clock or spool.clock
        self._last_purge = 0
        self._purge_behind = False  # the last sweep read a full batch: sweep again next tick
        self.expired = self.retried = self.purged = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.step()
            except SpoolError as e:  # the store is failing: try again next round
                log.warning("lifecycle round failed: %s", e)
            except Exception:  # never take the mount down with the timer
                log.exception("lifecycle round failed")
            await trio.sleep(TICK)

    async def step(self) -> None:
        self.spool.policies.refresh()
        await self.spool.renew_held()
        await self.expire_leases()
        await self.send_retries()
        now = self.clock()
        if self._purge_behind or now - self._last_purge >= PURGE_EVERY * L.NS:
            self._last_purge = now
            await self.purge()

    async def _each(self, what: str, items: list[Entry],
                    fn: Callable[[Entry, WriteTx], tuple[int, bytes] | None]) -> list[int]:
        """Apply ``fn`` to each item in a request of its own, all submitted together: group
        commit makes them one transaction, and a message that fails (logged) holds up no other.
        Returns the ids that moved (committed); their old and new names are dropped from the
        kernel's cache."""
        gone: list[tuple[int, bytes]] = []
        done: list[int] = []

        async def one(seen: Entry) -> None:
            try:
                moved = await self.spool.tx(lambda tx: fn(seen, tx))
            except SpoolError as e:
                log.warning("%s of message %d %r failed: %s", what, seen.id, seen.name, e)
                return
            except Exception:  # a bug for this message only: the others still move
                log.exception("%s of message %d %r failed", what, seen.id, seen.name)
                return
            if moved is not None:
                gone.append(moved)
                done.append(seen.id)

        async with trio.open_nursery() as n:
            for seen in items:
                n.start_soon(one, seen)
        for entry_id in done:  # where it is now: a kernel may hold that name as absent
            now = self.spool.r.get(entry_id)
            if now is not None and now.parent is not None:
                gone.append((now.parent, now.name))
        self._forget(gone)
        return done

    async def expire_leases(self) -> int:
        now = self.clock()
        due = self.spool.r.due_leases(now, BATCH)

        def expire(seen: Entry, tx: WriteTx) -> tuple[int, bytes] | None:
            cur = tx.get(seen.id)
            if (cur is None or cur.state is not State.WORKING or cur.lease_ns != seen.lease_ns
                    or cur.parent is None or cur.queue is None):
                return None  # finished, released, renewed or expired by another daemon
            policy = self.spool.policies.of(cur.queue)
            if self.spool.holds(cur.id):  # held open here: the holder keeps it
                apply(tx, cur, Action.RENEW, State.WORKING,
                      Context(now, lease_end=L.lease_end(policy, now)), DAEMON, history=False)
                return None
            after = L.after_failure(policy, cur.attempts, now, expired=True)
            target = self._state_dir(tx, cur, State.ERROR)
            why = (f"lease expired after attempt {cur.attempts} of {policy.max_attempts}; "
                   + ("abandoned" if after.abandoned else "will retry"))
            if not apply(tx, cur, Action.EXPIRE, State.ERROR, Context(now, after=after), DAEMON,
                         into=(target, free_name(tx, target, cur.name)), why=why):
                return None  # another daemon moved it first (its compare-and-set won)
            log.info("message %d %r: %s", cur.id, cur.name, why)
            return cur.parent, cur.name

        n = len(await self._each("lease expiry", due, expire))
        self.expired += n
        return n

    async def send_retries(self) -> int:
        now = self.clock()
        due = self.spool.r.due_retries(now, BATCH)

        def retry(seen: Entry, tx: WriteTx) -> tuple[int, bytes] | None:
            cur = tx.get(seen.id)
            if (cur is None or cur.state is not State.ERROR or cur.retry_ns != seen.retry_ns
                    or cur.parent is None or cur.queue is None):
                return None
            target = self._state_dir(tx, cur, State.READY)
            policy = self.spool.policies.of(cur.queue)
            if not apply(tx, cur, Action.RETRY, State.READY, Context(now), DAEMON,
                         into=(target, free_name(tx, target, cur.name)),
                         why=f"attempt {cur.attempts + 1} of {policy.max_attempts}"):
                return None  # another daemon moved it first
            return cur.parent, cur.name

        n = len(await self._each("retry", due, retry))
        self.retried += n
        return n

    async def purge(self) -> int:
        now = self.clock()
        total = 0
        self._purge_behind = False
        for queue, policy in self.spool.policies.queues():
            for state, retention in ((State.SUCCESS, policy.success_retention),
                                     (State.ERROR, policy.error_retention)):
                cutoff = L.retention_cutoff(retention, now)
                if cutoff is not None:
                    total += await self._purge(queue, state, cutoff)
            if policy.idle_views is not None:
                await self.remove_idle_views(queue, now - policy.idle_views)
        self.purged += total
        return total

    async def remove_idle_views(self, queue: int, cutoff: int) -> int:
        """Remove the queue's empty consumer views with no claim in or out since ``cutoff``
        (policy ``idle_views``): those of consumers that are gone."""
        working = self.spool.r.lookup(queue, State.WORKING.value.encode())
        if working is None:
            return 0
        removed = 0
        for view in self.spool.r.subdirectories(working.id):
            if view.kind != "consumer" or view.mtime_ns > cutoff:
                continue
            if self.spool.r.page(view.id, 0, 1):
                continue  # claims in it: a consumer holds them, or their leases will end
            where = self.spool.path_of(view.id)
            if await self.spool.remove_idle_view(view):
                removed += 1
                idle = show_duration(max(self.clock() - view.mtime_ns, 0))
                log.info("consumer view %s removed: empty, no claim in or out for %s", where,
                         idle)
        return removed

    async def _purge(self, queue: int, state: State, cutoff: int) -> int:
        old = self.spool.r.finished_before(queue, state, cutoff, BATCH)
        cleanup: dict[int, list[tuple[str, object]]] = {}
        shared: dict[int, int] = {}  # purged message -> its content, others sharing it

        def purge(seen: Entry, tx: WriteTx) -> tuple[int, bytes] | None:
            cur = tx.get(seen.id)
            if (cur is None or cur.state is not state or cur.finished_ns != seen.finished_ns
                    or cur.retry_ns is not None or cur.parent is None):
                return None
            cleanup[cur.id] = []
            if cur.blob is not None and (cur.refs or 1) > 1:
                shared[cur.id] = cur.blob
            self.spool.delete_message(tx, cur, cleanup[cur.id])
            tx.drop_history(cur.id)
            return cur.parent, cur.name

        purged = await self._each("purge", old, purge)
        for blob_id in dict.fromkeys(shared[i] for i in purged if i in shared):
            self.spool.link_counts_changed(blob_id)
        for entry_id in purged:  # files go only once the deletion committed
            await self.spool.removed(cleanup[entry_id])
        n = len(purged)
        if n:
            log.info("purged %d message(s) from %s/ past their retention", n, state.value)
        # A full batch read, some of it purged (the rest maybe by another daemon on the store):
        # more may be due, from a queue that finishes faster than a batch a sweep.
        if n and len(old) == BATCH:
            self._purge_behind = True
        return n

    @staticmethod
    def _state_dir(tx: WriteTx, e: Entry, state: State) -> int:
        assert e.queue is not None
        d = tx.lookup(e.queue, state.value.encode())
        if d is None:
            raise StoreFailure(f"queue {e.queue} has no {state.value}/ directory")
        return d.id

    def _forget(self, gone: list[tuple[int, bytes]]) -> None:
        for parent, name in gone:
            self.spool.on_gone(parent, name)
