"""Stale build locks of torch's JIT extensions, found before DeepSpeed waits on one forever.

DeepSpeed builds (or, once built, just loads) its CPU comm op with ``torch.utils.cpp_extension.load``, which takes
``<root>/<op>/lock`` (root: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/<python_device>``) for the
duration, by creating the file and keeping it open. A process killed while holding it leaves the file behind, and
every later run waits for it to vanish, forever. A lock that no live process holds open is stale.
"""
import os
import time
from glob import glob


class StaleLockError(OSError):
    """A build lock left by a killed process: the run would wait on it forever."""


def _held_open(path: str) -> bool:
    """Whether any process (of those this user may inspect: the cache is per user) has ``path`` open."""
    target = os.path.realpath(path)
    for fd_dir in glob("/proc/[0-9]*/fd"):
        try:
            if any(os.readlink(os.path.join(fd_dir, fd)) == target for fd in os.listdir(fd_dir)):
                return True
        except OSError:  # the process ended, or is not ours
            continue
    return False


def stale_build_locks(root: str, recheck_after_s: float = 1.0) -> list[str]:
    """Build locks under ``root`` (torch's extensions directory, or a folder in it) that no process holds open.
    Linux only (``/proc``); elsewhere none are reported. A lock seen unheld is looked at again after
    ``recheck_after_s``: a finishing build closes its lock just before it removes it."""
    locks = glob(os.path.join(root, "*", "lock")) + glob(os.path.join(root, "*", "*", "lock"))
    if not locks or not os.path.isdir("/proc/self/fd"):
        return []
    unheld = [lock for lock in locks if not _held_open(lock)]
    if unheld:
        time.sleep(recheck_after_s)
    return [lock for lock in unheld if os.path.exists(lock) and not _held_open(lock)]


def check_build_locks() -> None:
    """Refuse to start on a stale lock, naming what to remove, instead of hanging in DeepSpeed's op build."""
    from torch.utils.cpp_extension import get_default_build_root

    stale = stale_build_locks(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if stale:
        build = os.path.dirname(stale[0])
        raise StaleLockError(f"{stale[0]} is a stale lock: a build of {os.path.basename(build)} was killed midway "
                             f"and no process holds it; remove {build} (the op is rebuilt on the next run, in about a"
                             " minute) and relaunch")
