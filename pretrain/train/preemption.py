"""SIGTERM/SIGINT ask the loop to stop after the current step and save (a cluster's preemption notice)."""
import contextlib
import signal

SIGNALS = {signal.SIGTERM, signal.SIGINT}


class StopRequest:
    """Set by SIGTERM or SIGINT; the loop polls ``requested``. A second SIGINT (Ctrl-C twice) exits at once;
    repeated SIGTERMs are ignored, since launchers forward the scheduler's SIGTERM to ranks that already got it."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    @staticmethod
    @contextlib.contextmanager
    def held_from_child_processes():
        """Processes forked inside (the data loader's workers) inherit a signal mask that holds SIGTERM/SIGINT.

        A preemption signal sent to the whole process group would otherwise kill the workers (PyTorch's worker
        handler dies on SIGTERM) and crash the trainer before it saves; held, it reaches only the trainer, which
        then shuts its workers down in order.
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
