"""SIGTERM/SIGINT ask the loop to stop after the current step and save (a cluster's preemption notice)."""
import contextlib
import os
import signal

SIGNALS = {signal.SIGTERM, signal.SIGINT}


class StopRequest:
    """Set by SIGTERM or SIGINT while the loop runs (``with StopRequest() as stop``); the loop polls ``requested``.

    A second SIGINT (Ctrl-C twice) exits at once; repeated SIGTERMs are ignored, since launchers forward the
    scheduler's SIGTERM to ranks that already got it (after a stop request, until the process exits). Leaving the
    ``with`` block without one restores the previous handlers, so a run ending on an error can still be terminated
    while it shuts down.
    """

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if not self.requested:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name


_starting_children = False


def _leave_parent_signals() -> None:
    """In a child forked inside ``held_from_child_processes``: a process group of its own, default handlers, and
    nothing held. A preemption signal sent to the trainer's group no longer reaches it, while a signal sent to the
    child itself (its loader terminating it, a launcher's kill at exit) works as usual."""
    if not _starting_children:
        return
    os.setpgid(0, 0)
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)  # discards a signal that arrived between the fork and setpgid
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


os.register_at_fork(after_in_child=_leave_parent_signals)


@contextlib.contextmanager
def held_from_child_processes():
    """Processes forked inside (the data loader's workers) leave the trainer's process group.

    A preemption signal sent to the whole process group would otherwise kill the workers (PyTorch's worker handler
    dies on SIGTERM) and crash the trainer before it saves; in a group of their own they are stopped by the trainer,
    in order. The signals stay blocked only across the fork. (Blocked for good, a worker could not be terminated,
    and a trainer ending on an error waited on it forever at exit.)
    """
    global _starting_children
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _starting_children = True
    try:
        yield
    finally:
        _starting_children = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
