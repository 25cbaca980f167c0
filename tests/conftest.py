"""Shared fixtures: real spoolfs mounts for tests/integration and tests/fault.

A test that needs FUSE is marked ``@pytest.mark.fuse``. Such tests never skip: when FUSE is not
usable and any of them is selected, the whole session stops with a non-zero exit (DESIGN §11).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from helpers.mounts import Mount, MountFactory, fuse_problems
from helpers.pgserver import PgServer
from helpers.procs import Procs, become_subreaper
from helpers.queues import Queue
from helpers.s3server import S3Server


def pytest_configure(config: pytest.Config) -> None:
    # The suite runs in two processes (pyproject's addopts). Where FUSE cannot run, it runs in
    # this one, whose collection below stops the session with the reason (a worker process
    # that stops is only a crash to the others).
    if not hasattr(config, "workerinput") and fuse_problems():
        config.option.dist = "no"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("fuse") for item in items):
        return
    problems = fuse_problems()
    if problems:
        pytest.exit("FUSE tests are selected but cannot run: " + "; ".join(problems)
                    + " (they never skip: fix the machine or deselect them with -m 'not fuse')",
                    returncode=3)
    # The daemon forks away from its parent; adopting it lets tests see exactly when it exits.
    become_subreaper()


TRACEBACK = "Traceback (most recent call last)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Remember where each daemon log stood, and fail a passing test whose daemon logged an
    internal error meanwhile: that is a request answered with EIO, which a test accepting "any
    refusal" would otherwise let through."""
    offsets = {m: m.log_size() for m in Mount.live}
    item._spoolfs_log_offsets = offsets  # type: ignore[attr-defined]
    result = yield
    for m in {*offsets, *getattr(item, "_spoolfs_mounts", [])}:
        lines = m.log_text(since=offsets.get(m, 0)).splitlines()
        hits = [i for i, line in enumerate(lines) if TRACEBACK in line]
        if hits:
            excerpt = "\n".join(lines[max(hits[0] - 2, 0):hits[0] + 40])
            raise AssertionError(f"the daemon of {m} logged {len(hits)} internal error(s) "
                                 f"during this test; the first:\n{excerpt}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed:
        offsets: dict[Mount, int] = getattr(item, "_spoolfs_log_offsets", {})
        mounts: list[Mount] = list(getattr(item, "_spoolfs_mounts", []))
        mounts += [m for m in Mount.live if m not in mounts]
        for m in mounts:
            since = offsets.get(m, 0) if call.when == "call" else 0
            report.sections.append((f"spoolfs log {m.log} ({call.when})",
                                    m.log_tail(since=since) or "(empty)"))
    return report


def _require_fuse_marker(node: pytest.Item | pytest.Collector) -> None:
    # `-m 'not fuse'` must deselect every test that mounts
    if node.get_closest_marker("fuse") is None:
        raise pytest.UsageError(f"{node.nodeid} mounts but is not marked @pytest.mark.fuse")


def _factory(base: Path, registry: list[Mount]) -> MountFactory:
    counter = itertools.count()

    def make(store: Path | None = None, path: Path | None = None, *, queue: str | None = None,
             extra: Sequence[str] = (), start: bool = True) -> Mount:
        n = next(counter)
        m = Mount(store if store is not None else base / "store",
                  path if path is not None else base / f"mnt{n}",
                  base / f"spoolfs-{n}.log", queue=queue, extra=extra)
        registry.append(m)
        return m.start() if start else m

    return make


def _close_all(mounts: list[Mount]) -> None:
    errors = []
    for m in reversed(mounts):
        try:
            m.close()
        except Exception as e:  # keep unmounting the others
            errors.append(f"{m}: {e}")
    if errors:
        raise AssertionError("teardown could not unmount: " + "; ".join(errors))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A new, empty store directory, made as ``spoolfs format`` makes one."""
    from spoolfs.cli.format import make_store

    path = tmp_path / "store"
    make_store(str(path))
    return path


@pytest.fixture
def mounter(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MountFactory]:
    """``mounter(store=None, path=None, queue=None, extra=(), start=True) -> Mount``.

    Every mount made through it is unmounted at teardown, and its log is attached to the report
    when the test fails.
    """
    _require_fuse_marker(request.node)
    mounts: list[Mount] = []
    request.node._spoolfs_mounts = mounts
    yield _factory(tmp_path, mounts)
    _close_all(mounts)


@pytest.fixture
def mount(mounter: MountFactory, store: Path, tmp_path: Path) -> Mount:
    """The whole spool of ``store`` mounted at ``tmp_path/mnt``."""
    return mounter(store, tmp_path / "mnt")


@pytest.fixture
def queue(mount: Mount, tmp_path: Path) -> Queue:
    """Queue ``q`` made with ``mkdir`` on ``mount``."""
    return Queue.create(mount.path, "q", tmp_path / "scratch")


@pytest.fixture(scope="module")
def module_mount(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One whole-spool mount shared by a module (each test takes its own queues)."""
    _require_fuse_marker(request.node)
    base = tmp_path_factory.mktemp("spool")
    mounts: list[Mount] = []
    try:
        yield _factory(base, mounts)()
    finally:
        _close_all(mounts)


_queue_numbers = itertools.count(1)


@pytest.fixture
def fresh_queue(module_mount: Mount, tmp_path: Path) -> Callable[[], Queue]:
    """``fresh_queue()`` makes a new, uniquely named queue on the module's shared mount."""
    def make() -> Queue:
        return Queue.create(module_mount.path, f"t{next(_queue_numbers)}", tmp_path / "scratch")
    return make


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is private to root): for mount
    points that processes of other users must reach."""
    d = Path(tempfile.mkdtemp(prefix="spoolfs-open-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs() -> Iterator[Procs]:
    """Background shells of a test (``procs.sh(script, *args, cwd=...)``), killed at teardown."""
    ps = Procs()
    yield ps
    ps.close()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One PostgreSQL server for the session, started on first use (about 1.5 s)."""
    server = PgServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """The URL of a fresh, empty database on the session's server."""
    return pg_server.new_database()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3 server for the session (SeaweedFS), started on first use."""
    server = S3Server().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://BUCKET/PREFIX`` of a fresh bucket, with the AWS settings of the environment (and
    so of every spoolfs process a test starts) pointing at the server."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{s3_server.new_bucket()}/spool"
