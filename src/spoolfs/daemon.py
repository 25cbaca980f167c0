"""Wiring: open the store, recover, mount, run the loop and background tasks, unmount cleanly."""

from __future__ import annotations

import functools
import logging
import os
import resource
import signal
import socket
import stat
import sys
import threading
from collections.abc import Awaitable, Callable

import pyfuse3
import trio

from spoolfs import metrics_http, mounttable
from spoolfs.core.errors import SpoolError, StoreFailure, UserError
from spoolfs.fuse import session
from spoolfs.fuse.ops import Operations
from spoolfs.notify import notify
from spoolfs.runtime import make_runtime_dir, pidfile
from spoolfs.service import gc
from spoolfs.service.follower import ChangeFeed, Follower
from spoolfs.service.lifecycle import Lifecycle
from spoolfs.service.recovery import Recovered, orphan_blob_files, orphan_staging_files, recover
from spoolfs.service.roles import STRICT_ROLES, Gate
from spoolfs.service.spool import Spool, Who
from spoolfs.store.base import Store
from spoolfs.store.private import tighten
from spoolfs.store.registry import open_store
from spoolfs.store.site import Place, is_url, place_of, shown

log = logging.getLogger("spoolfs")


def _queue_root(spool: Spool, name: str) -> int:
    """The entry a ``--queue`` mount is rooted at, created on first use."""
    raw = name.encode()
    e = spool.r.lookup(1, raw)
    if e is None:
        try:
            e = trio.run(spool.mkdir, 1, raw, 0o755, Who(os.getuid(), os.getgid(), os.getpid()))
        except SpoolError as err:
            raise UserError(f"cannot create queue {name!r}: {err.hint}") from err
    if e.kind != "queue":
        raise UserError(f"{name} is not a queue")
    return e.id


#: ``-o nfs_export``: the mount is exported by an NFS server, whose requests follow NFS's
#: rules: publish at a client's COMMIT or rename, leases kept by use only (docs/design.md,
#: "Serving NFS clients")
NFS_EXPORT = "nfs_export"
#: ``-o shared_mmap``: uploads are written through the kernel's page cache, so that a program
#: may map one shared and write through the mapping; without it they are written straight to
#: the daemon (faster, and a shared writable mapping of an upload fails with ENODEV)
SHARED_MMAP = "shared_mmap"
#: ``-o`` options that are the daemon's own, not passed on to FUSE
OWN_OPTIONS = frozenset({STRICT_ROLES, NFS_EXPORT, SHARED_MMAP})
#: How long an unmount waits for recovery's walks of the files before stopping them.
SWEEP_WAIT_S = 10.0


def fuse_options(store_dir: str, options: list[str]) -> set[str]:
    """The mount options: the caller's, plus the kernel's permission checks whenever users
    other than the mounting one can enter (``allow_other``/``allow_root``). Without those, FUSE
    lets no one else in, and the checks would only cost a GETATTR on every changed directory
    of every path walk. ``strict_roles`` (service/roles.py), ``nfs_export`` and
    ``shared_mmap`` are the daemon's own, not passed on; ``strict_roles`` turns the kernel's
    checks on too."""
    opts = {o for o in options if o and o not in OWN_OPTIONS} | {f"fsname={store_dir}",
                                                               "subtype=spoolfs"}
    if opts & {"allow_other", "allow_root"} or {"default_permissions", STRICT_ROLES} & set(options):
        opts.add("default_permissions")
    return opts


def open_place(store_url: str, blobs: str | None) -> tuple[Store, Place]:
    """The store and where its parts are; one line (``UserError``) when it cannot be used."""
    name = shown(store_url)
    try:
        if not is_url(store_url) and os.path.isdir(store_url):
            tighten(store_url)
        store = open_store(store_url)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot open store {name}: {e}") from e
    try:
        place = place_of(store_url, store, blobs)
        place.blobs.check()
        return store, place
    except UserError:
        store.close()
        raise
    except Exception as e:
        store.close()
        raise UserError(f"cannot open store {name}: {e}") from e


def serve(store_dir: str, mountpoint: str, queue: str | None, options: list[str],
          on_ready: Callable[[list[str]], None] = lambda notes: None, *,
          metrics_listen: str | None = None, blobs: str | None = None) -> None:
    """Mount and serve until unmounted or signalled. ``on_ready`` runs once the mount is live,
    with the warnings its operator should see at once (also logged).
    ``store_dir`` is a store directory or a store URL; ``blobs`` where a URL store's content
    lives (recorded by its first mount)."""
    os.umask(0o077)  # what the daemon creates (store files, pid file) is its owner's alone
    raise_open_files_limit()
    store, place = open_place(store_dir, blobs)
    spool = Spool(store, place)
    try:
        try:
            recovered = recover(spool)
        except StoreFailure as e:  # the disk full, say: one line, as for the open above
            raise UserError(f"cannot recover store {place.name}: {e.hint}") from e
        spool.guard.make_reserve()
        root_id = _queue_root(spool, queue) if queue else 1
        ops = Operations(spool, root_id, Gate(spool.r) if STRICT_ROLES in options else None,
                         nfs_export=NFS_EXPORT in options,
                         direct_writes=SHARED_MMAP not in options)
        # as the mount table names it (resolved now: once mounted, a stat of the mount point
        # waits for the event loop)
        point = os.path.realpath(mountpoint)
        # the kernel sets a mount's read-ahead when it gets the reply to INIT: after that
        ops.after_init = functools.partial(_tune_read_ahead, point)
        record = mounttable.device_record(point, place.local)
        opts = fuse_options(place.name, options)
        # Resolved before mounting: once mounted, any stat of the mount point waits for the
        # event loop, which has not started yet.
        make_runtime_dir()
        pf = pidfile(mountpoint)
        listeners = metrics_http.bind(metrics_listen) if metrics_listen else []
        try:
            pyfuse3.init(ops, mountpoint, opts)
        except RuntimeError as e:
            for sock in listeners:
                sock.close()
            raise UserError(f"cannot mount {mountpoint}: {e}") from e
        # (the mount is in the kernel's table once init returns)
        notes = _exported(ops, point, record) if NFS_EXPORT in options else []
        try:
            with open(pf, "w") as f:
                f.write(f"{os.getpid()}\n")
            log.info("mounted %s on %s (pid %d)", place.name, mountpoint, os.getpid())
            try:
                trio.run(_main, spool, recovered, functools.partial(on_ready, notes), listeners,
                         root_id if root_id != 1 else None, instruments=session.install())
            finally:
                pyfuse3.close(unmount=True)
        finally:
            try:
                os.unlink(pf)
            except FileNotFoundError:
                pass
    finally:
        spool.staging_pool.close()  # the staging files made ahead and not used
        place.blobs.close()  # removals of content still queued for a remote store
        store.close()
        log.info("%s unmounted, store closed", mountpoint)


def raise_open_files_limit() -> None:
    """Each open upload holds descriptors here: its staging file and, in ``partial/``, this
    daemon's share of its writers' lock (service/writers.py). The soft limit on open files
    (often 1,024) is raised to the hard one, as servers do, so that it does not cap the
    writers a mount serves at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("open files stay limited to %d: %s", soft, e)
    else:
        log.info("open files: at most %d (the soft limit was %d)", hard, soft)


def _tune_read_ahead(mountpoint: str) -> None:
    why = mounttable.set_read_ahead(mountpoint)
    if why is not None:
        log.info("%s", why)


def _exported(ops: Operations, mountpoint: str, device_record: str) -> list[str]:
    """An exported mount's device number, read once: when it is not the one its NFS server
    last served it under (kept in ``device_record``), the handles that server's clients hold
    are stale (the warning, logged and returned), and the server's first request here keeps
    the new number."""
    try:
        served, now = mounttable.recorded_device(device_record), mounttable.device(mountpoint)
    except OSError as e:
        log.warning("nfs_export: the device number NFS clients last saw is unknown: %s", e)
        return []
    if now is None or served == now:
        return []
    ops.on_nfs_server = functools.partial(_served_over_nfs, device_record, now)
    if served is None:
        return []
    note = (f"nfs_export: the device number of {mountpoint} is {now}, NFS clients last saw "
            f"{served}: the file handles they hold are stale, and they must mount again "
            "(another mount took the number, or one below it was unmounted, since the last "
            "mount)")
    log.warning("%s", note)
    return [note]


def _served_over_nfs(device_record: str, number: str) -> None:
    """The NFS server's first request on this mount: its clients' handles carry the mount's
    device number ``number`` from now on (kept in ``device_record``)."""
    try:
        mounttable.record_device(device_record, number)
    except OSError as e:
        log.warning("nfs_export: the device number NFS clients see was not recorded: %s", e)


async def _main(spool: Spool, recovered: Recovered, on_ready: Callable[[], None],
                listeners: list[socket.socket] | None = None,
                only_queue: int | None = None) -> None:
    lifecycle = Lifecycle(spool)
    metrics = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        await nursery.start(spool.committer.run)
        timers = trio.CancelScope()
        signals = trio.CancelScope()
        nursery.start_soon(_signals, signals)
        gc_stop = threading.Event()  # a collection under way ends at its next page
        tasks: list[Callable[[], Awaitable[None]]] = [
            lifecycle.run, functools.partial(gc.periodic, spool.place, stop=gc_stop),
            spool.guard.keep_reserve]
        if not spool.store.blocking:  # (a database server's commits run off the loop)
            tasks.append(spool.staging_pool.run)
        if isinstance(spool.store, ChangeFeed):  # other hosts' changes, seen here
            follower = Follower(spool.store, lambda p, n: spool.on_gone(p, n),
                                spool.changed_elsewhere, trio.CapacityLimiter(1),
                                spool.left_names)
            tasks.append(follower.run)
        nursery.start_soon(_run_in, timers, *tasks)
        swept, stop_sweep = trio.Event(), threading.Event()
        nursery.start_soon(_sweep_files, spool, recovered, swept, stop_sweep)
        if listeners:  # serving before the mount is reported ready
            await nursery.start(_metrics, metrics, listeners, spool, only_queue)
        on_ready()
        try:
            await pyfuse3.main()
        finally:
            notify("STOPPING=1", "STATUS=unmounting")  # systemd Type=notify
            signals.cancel()
            gc_stop.set()
            timers.cancel()
            metrics.cancel()
            with trio.CancelScope(shield=True):  # the store is left as recovery promised
                await end_sweep(swept, stop_sweep)
            spool.committer.close()  # the committer answers what it accepted, then returns
    log.info("fuse session ended: %d commits for %d requests; lifecycle: %d lease(s) expired, "
             "%d retried, %d purged; %d staging file(s) made ahead, %d used",
             spool.committer.batches, spool.committer.requests, lifecycle.expired,
             lifecycle.retried, lifecycle.purged, spool.staging_pool.made,
             spool.staging_pool.taken)


async def _metrics(scope: trio.CancelScope, listeners: list[socket.socket], spool: Spool,
                   only_queue: int | None,
                   *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        await metrics_http.serve(listeners, lambda: spool.snapshot(only_queue=only_queue),
                                 task_status=task_status)


async def _sweep_files(spool: Spool, recovered: Recovered, done: trio.Event,
                       stop: threading.Event) -> None:
    """Recovery's last part, while the mount serves (service/recovery.py); see ``end_sweep``."""
    try:
        try:
            await orphan_staging_files(spool, recovered, stop)
        except Exception:  # never take the mount down with it: gc finds the same files later
            log.exception("recovery: staging files left by a crash not looked for")
        if not stop.is_set():
            try:
                await orphan_blob_files(spool, stop)
            except Exception:
                log.exception("recovery: blob files left by a crash not looked for")
    finally:
        done.set()


async def end_sweep(done: trio.Event, stop: threading.Event, wait_s: float = SWEEP_WAIT_S
                    ) -> None:
    """At unmount: wait for recovery's walks of the staging and blob files, so that a store
    unmounted cleanly has no file a crash left behind. A walk still going after ``wait_s`` (a
    million contents in files, read from disk, take about 20 s) is stopped at its next page
    instead: an unmount stays prompt, and the next mount walks again."""
    with trio.move_on_after(wait_s):
        await done.wait()
    if not done.is_set():
        stop.set()
        await done.wait()


async def _run_in(scope: trio.CancelScope, *fns: Callable[[], Awaitable[None]]) -> None:
    """Run the background tasks until ``scope`` is cancelled (at unmount)."""
    with scope:
        async with trio.open_nursery() as n:
            for fn in fns:
                n.start_soon(fn)


async def _signals(scope: trio.CancelScope) -> None:
    with scope, trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("received %s: unmounting", signal.Signals(sig).name)
            pyfuse3.terminate()
            return


def check_mountpoint(mountpoint: str) -> str:
    mp = os.path.abspath(mountpoint)
    dead = mounttable.dead_mount(mp)
    if dead is not None:  # left by a daemon that died: mounting again is the way back
        try:
            mounttable.detach(dead)
        except OSError as e:
            raise UserError(str(e)) from None
        print(f"spoolfs: {mp}: the daemon of the mount there was gone; detached",
              file=sys.stderr)
    try:
        st = os.stat(mp)
    except FileNotFoundError:
        raise UserError(f"mountpoint {mp} does not exist") from None
    except OSError as e:
        raise UserError(f"mountpoint {mp}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"mountpoint {mp} is not a directory")
    if os.path.ismount(mp):
        raise UserError(f"mountpoint {mp} is already mounted")
    if os.listdir(mp):
        raise UserError(f"mountpoint {mp} is not empty")
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse is missing: load the fuse module (modprobe fuse)")
    return mp
