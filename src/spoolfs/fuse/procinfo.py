"""What the kernel says about a process that made a request: is it ending, and how.

pyfuse3 gives ``flush`` and ``release`` no request context, so a handle remembers the pid of
the process that opened it. While the kernel closes the files of a process that is exiting
(killed by a signal, or after ``exit``), that process is still in ``/proc/PID/stat`` with
``PF_EXITING`` in its flags and its wait status in ``exit_code``: whether it finished is known
at the moment its last descriptor closes. Reading /proc never calls back into this file system.
"""

from __future__ import annotations

import os
import signal

#: ``PF_EXITING`` (include/linux/sched.h): the task is in do_exit()
PF_EXITING = 0x4
#: field numbers of proc_pid_stat(5), counted from 1
_FLAGS = 9
_EXIT_CODE = 52


#: bytes asked of /proc at a time: a process's ``stat`` and ``status`` fit in one read
_CHUNK = 16384


def _read(path: str) -> bytes:
    """The whole of a /proc file the kernel shows in one piece (a process's ``stat`` and
    ``status``), by descriptor: no buffered file object, whose set-up (two fstat, an ioctl,
    two lseek) costs more than the read itself. Such a file is made whole at the first read,
    so a read shorter than asked for was the last (not so for files of many records, such as
    ``maps``: a read stops before a record that does not fit)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, _CHUNK)]
        while len(chunks[-1]) == _CHUNK:
            chunks.append(os.read(fd, _CHUNK))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _tgid(status: bytes) -> int:
    """The thread group (process) in a ``status`` file; ValueError when it has none."""
    start = status.index(b"\nTgid:") + 6
    return int(status[start:status.index(b"\n", start)])


def process_of(tid: int) -> int:
    """The process (thread group) of thread ``tid``, as FUSE names a caller by its thread: a
    thread may be gone long before its process's files are closed, its process not. ``tid``
    itself when /proc cannot tell."""
    try:
        return _tgid(_read(f"/proc/{tid}/status"))
    except (OSError, ValueError):
        return tid


#: process names of NFS servers (``-o nfs_export``): nfs-ganesha, and the kernel's nfsd threads
NFS_SERVERS = (b"ganesha.nfsd", b"nfsd")
#: ``PF_KTHREAD``: a kernel thread (the kernel's nfsd threads are)
PF_KTHREAD = 0x00200000


def nfs_server(tid: int) -> bool:
    """Whether thread ``tid`` serves NFS clients: its process is nfs-ganesha's
    ``ganesha.nfsd``, or it is one of the kernel's ``nfsd`` threads. One read of /proc."""
    try:
        raw = _read(f"/proc/{tid}/status")
        tgid = _tgid(raw)
        if tgid != tid:
            raw = _read(f"/proc/{tgid}/status")
    except (OSError, ValueError):
        return False
    name = raw[raw.index(b":") + 1:raw.index(b"\n")].strip() if raw.startswith(b"Name:") \
        else b""
    if name not in NFS_SERVERS:
        return False
    if name != b"nfsd":
        return True
    flags = _fields(tgid)
    return flags is not None and bool(int(flags[_FLAGS - 3]) & PF_KTHREAD)


#: what a descriptor's link in /proc/PID/fd/ reads when it cannot be a file of a mount
_NOT_A_FILE = ("/dev/null", "/dev/pts/", "/dev/tty")


def holds(pid: int, ino: int) -> bool:
    """Whether process ``pid`` has a descriptor open on inode ``ino`` (of any file system: the
    caller knows which inode is its). Each descriptor's link is read first (a readlink never
    calls into a file system): pipes, sockets, event fds and terminals are passed over, and
    only the others' ``fdinfo`` is read for its inode number."""
    base = f"/proc/{pid}/fd/"
    try:
        fds = os.listdir(base)
    except OSError:
        return False
    want = b"\nino:\t%d\n" % ino
    for fd in fds:
        try:
            link = os.readlink(base + fd)
        except OSError:
            continue  # closed meanwhile
        if not link.startswith("/") or link.startswith(_NOT_A_FILE):
            continue
        try:
            info = os.open(f"/proc/{pid}/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if want in os.read(info, 4096):
                return True
        except OSError:
            continue  # the descriptor closed between the open and the read (ENOENT)
        finally:
            os.close(info)
    return False


def _fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` numbered from 3 on (state, ppid, ...), or None when the
    process is gone. The command name (field 2) may hold spaces and parentheses: the fields
    start after the last ``)``."""
    try:
        raw = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    _, sep, rest = raw.rpartition(b")")
    if not sep:
        return None
    return rest.decode("ascii", "replace").split()


def _status(fields: list[str] | None) -> int | None:
    if fields is None or len(fields) < _EXIT_CODE - 2:
        return None
    try:
        flags = int(fields[_FLAGS - 3])
        code = int(fields[_EXIT_CODE - 3])
    except ValueError:
        return None
    return code if flags & PF_EXITING else None


def exit_status(pid: int) -> int | None:
    """The wait status (as ``waitpid`` reports it) of process ``pid`` while it is exiting;
    None while it runs, or when it is gone or unreadable (another user's process, seen by a
    daemon that is not root: /proc shows 0 then, which reads as a clean exit)."""
    return _status(_fields(pid)) if pid > 0 else None


def _exiting_child(pid: int) -> tuple[int, int] | None:
    """A child of ``pid`` that is exiting unsuccessfully and has not finished exiting (a
    zombie closed its files long ago): (its pid, its wait status)."""
    want = str(pid)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _fields(int(name))
        if fields is None or fields[1] != want or fields[0] in ("Z", "X"):  # ppid, state
            continue
        status = _status(fields)
        if status:
            return int(name), status
    return None


def opener_unfinished(opener: int) -> str | None:
    """The opener is closing its last descriptor on a file: why it did not finish (it is
    exiting killed or with a non-zero status), or None. One read of /proc/PID/stat."""
    status = exit_status(opener)
    return describe(status) if status else None


def child_unfinished(opener: int) -> str | None:
    """The opener still holds the file, so a process that inherited a copy is closing it:
    why that one did not finish, or None. A shell opens ``> ready/f`` itself (dash does,
    then vforks the command), so the command is the opener's child; a child exiting
    unsuccessfully at this moment is taken for the one closing. Scans /proc (this kernel has
    no /proc/PID/task/TID/children): run it off the event loop."""
    child = _exiting_child(opener)
    if child is None:
        return None
    return f"(pid {child[0]}, holding a copy of the descriptor) {describe(child[1])}"


def describe(status: int) -> str:
    """``was killed by SIGKILL`` or ``exited with status 3``."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"was killed by {name}"
    return f"exited with status {os.WEXITSTATUS(status)}"
