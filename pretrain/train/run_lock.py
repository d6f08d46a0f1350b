"""One run per directory: ``RUN_DIR/run.lock``, held by the run's global rank 0 for the life of its process.

The lock is an ``flock`` on the file, so the kernel (or, on NFS, the server, through the client's lock lease)
releases it whenever the holder ends, a SIGKILL or a crash included: a dead holder never blocks a relaunch, and no
pid has to be guessed alive. The file's text names the holder (host, pid, start time), for the message that refuses
a second launch; a lock file that still names a holder but is free was left by a process that ended without
releasing it (killed), which the next holder reports. Only rank 0 takes it (the ranks of one run may sit on several
hosts); the other ranks learn the outcome from rank 0, so every rank of a refused launch stops with the same line.
"""
import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

LOCK = "run.lock"
_held: list[int] = []  # this process's lock descriptors: a forked child (a loader worker) must not keep them


class RunDirLockedError(RuntimeError):
    """Another process holds the run directory."""


def _holder(text: str) -> str:
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on host {who['host']} (since {who['since']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def acquire(run_dir: Path) -> tuple[int | None, str]:
    """Take ``RUN_DIR/run.lock``: return its descriptor (``release`` it, or exit) and a note to print: the holder
    the file named that ended without releasing it, if any. Raise ``RunDirLockedError`` naming a live holder. On a
    filesystem without file locks nothing is held (``None``) and the note says so."""
    path = Path(run_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            return None, (f"{path} cannot be locked ({err.strerror}): that filesystem has no file locks, so a second "
                          "launch on this run.dir would not be refused")
        time.sleep(0.2)  # a holder that has just taken the lock writes its name next
        raise RunDirLockedError(f"run.dir {run_dir} is in use by {_holder(path.read_text())} ({path}): one run per "
                                "directory; wait for that run to end or stop it, or use another run.dir") from None
    left = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    _held.append(fd)
    atexit.register(release, fd)
    return fd, (f"took {path} over from {_holder(left)}, which ended without releasing it" if left else "")


def release(fd: int | None) -> None:
    """Blank the holder's name and release the lock (an exit releases it too, without blanking the name)."""
    if fd not in _held:
        return
    os.ftruncate(fd, 0)
    os.close(fd)
    _held.remove(fd)


def hold(run_dir: Path, is_main: bool) -> str:
    """Rank 0 takes the run directory's lock until its process ends; every rank learns the outcome (one broadcast,
    the ranks may be on other hosts) and a refused launch raises ``RunDirLockedError`` on each. Returns rank 0's
    note to print (empty elsewhere)."""
    said, note = [""], ""
    if is_main:
        try:
            _, note = acquire(run_dir)
        except RunDirLockedError as err:
            said = [str(err)]
    several = dist.is_initialized() and dist.get_world_size() > 1
    if several:
        dist.broadcast_object_list(said, src=0)
    if said[0]:
        if several and not is_main:  # wait for rank 0 to say why and end (a launcher stops the rest as one ends)
            with contextlib.suppress(RuntimeError):
                dist.barrier()  # rank 0 never joins: this fails when it is gone
        raise RunDirLockedError(said[0])
    return note


def _close_in_child() -> None:
    """A forked child shares the parent's lock; closing its copy leaves the lock to the parent alone, so a child
    outliving its parent for a moment cannot hold the directory."""
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)
