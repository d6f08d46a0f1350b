"""SIGTERM/SIGINT ask the loop to stop after the current step and save (a cluster's preemption notice)."""
import signal


class StopRequest:
    """Set by SIGTERM or SIGINT; the loop polls ``requested``. A second SIGINT (Ctrl-C twice) exits at once;
    repeated SIGTERMs are ignored, since launchers forward the scheduler's SIGTERM to ranks that already got it."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
