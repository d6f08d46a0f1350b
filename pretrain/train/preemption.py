"""SIGTERM/SIGINT ask the loop to stop after the current step and save (a cluster's preemption notice), and so
does the end of the launcher that started this rank.

Every launcher is covered: plain python gets the signal itself; torchrun forwards it to each rank's session; the
``deepspeed`` command's per-node launcher (``deepspeed.launcher.launch``) forwards it to each rank and its children,
but the ``deepspeed`` command itself dies of a SIGTERM without forwarding anything, so each rank watches its
launcher's parent (and its launcher) and stops when either is gone. A run stopped this way saved, and exits with
``pretrain.exit_codes.PREEMPTED`` (not 0), so a scheduler can tell it from a finished run and requeue it.
"""
import atexit
import contextlib
import multiprocessing
import multiprocessing.util  # its exit handler (terminate, then join, loader workers) must run after ours
import os
import signal
import threading
from pathlib import Path

SIGNALS = {signal.SIGTERM, signal.SIGINT}
# a rank's parent process, by an argument of its command line: its name, and whether its own parent is watched (the
# deepspeed command forwards no signal to its launcher; torchrun's parent, a shell, may end without meaning a stop)
LAUNCHERS = {b"deepspeed.launcher.launch": ("the deepspeed launcher", True),
             b"torch.distributed.run": ("torchrun", False), b"torchrun": ("torchrun", False)}


class StopRequest:
    """Set by SIGTERM or SIGINT while the loop runs (``with StopRequest() as stop``), or by the end of this rank's
    launcher; the loop polls ``requested`` and says ``reason``.

    A second SIGINT (Ctrl-C twice) exits at once; repeated SIGTERMs are ignored, since launchers forward the
    scheduler's SIGTERM to ranks that already got it (after a stop request, until the process exits). Leaving the
    ``with`` block without one restores the previous handlers, so a run ending on an error can still be terminated
    while it shuts down.
    """

    def __init__(self):
        self.requested = False
        self.reason = ""
        self._previous: dict[int, object] = {}
        self._done = threading.Event()

    def __enter__(self) -> "StopRequest":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        if _LAUNCHER:
            threading.Thread(target=self._watch, args=_LAUNCHER, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if not self.requested:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)

    def request(self, reason: str) -> None:
        if not self.requested:
            self.requested, self.reason = True, reason

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.request(signal.Signals(signum).name)

    def _watch(self, name: str, pid: int, parent: int | None) -> None:
        """Request a stop once the launcher ``pid`` has ended, or its ``parent`` when one is watched (a process
        whose parent ends is handed to another, so a changed parent pid is an ended parent)."""
        while not self._done.wait(0.5):
            if os.getppid() != pid:
                return self.request(f"the end of {name} (pid {pid})")
            if parent is not None and _parent_of(pid) != parent:
                return self.request(f"the end of the command that started {name} (pid {parent})")


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _launcher() -> tuple[str, int, int | None] | None:
    """(name, pid, parent pid to watch or None) of the launcher that started this process, read from /proc; None
    for plain python (whose parent, a shell, may end without meaning a stop) or where /proc is not."""
    pid = os.getppid()
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    found = next((found for arg in argv[:4] for key, found in LAUNCHERS.items()
                  if arg == key or arg.endswith(b"/" + key)), None)
    if found is None:
        return None
    name, watch_parent = found
    return name, pid, _parent_of(pid) if watch_parent else None


_LAUNCHER = _launcher()  # at import, as early as the rank can look: its launcher's parent may end at any time


_starting_children = False


def _leave_parent_signals() -> None:
    """In a child forked inside ``held_from_child_processes``: a process group of its own, SIGTERM and SIGINT
    ignored (until a loader worker sets PyTorch's handlers, then ignores them again: ``pretrain.data.stream``),
    nothing blocked. Only its trainer ends it, by closing the loader, and on its way out by
    ``_kill_leftover_children``."""
    if not _starting_children:
        return
    os.setpgid(0, 0)
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


os.register_at_fork(after_in_child=_leave_parent_signals)


def _kill_leftover_children() -> None:
    """At exit, kill the loader workers still alive (a loader left unclosed by an uncaught error): they ignore the
    SIGTERM multiprocessing's own exit handler sends, which then waited on them forever. (Left alone, a worker whose
    trainer is killed outright ends by itself within seconds: PyTorch's workers watch their parent.)"""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


atexit.register(_kill_leftover_children)  # after multiprocessing.util's, so it runs before it


@contextlib.contextmanager
def held_from_child_processes():
    """Processes forked inside (the data loader's workers) leave the trainer's process group.

    A preemption signal to the whole process group would otherwise kill the workers (PyTorch's worker handler dies
    on SIGTERM) and crash the trainer before it saves; in a group of their own they are stopped by the trainer, in
    order. (The deepspeed launcher signals each rank's children by pid: loader workers ignore SIGTERM for that.)
    The signals stay blocked only across the fork.
    """
    global _starting_children
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _starting_children = True
    try:
        yield
    finally:
        _starting_children = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
