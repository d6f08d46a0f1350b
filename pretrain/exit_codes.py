"""How a training run ends, as its exit status: the same under plain python, ``deepspeed`` and ``launch/torchrun.py``
(plain ``torchrun`` exits 1 on any rank's non-zero status and lists the ranks' codes). A scheduler requeues on
``PREEMPTED``; the others say what to change before a relaunch (docs/CONTRACTS.md, "Exit codes")."""
FINISHED = 0
FAILED = 1          # anything else: the rank's one line says what
CONFIG_ERROR = 2    # a key's value or a combination refused (``config error: KEY: ...``), wherever it was found
CORRUPT_SHARD = 65  # sysexits EX_DATAERR: a training shard is corrupt; the last completed step was saved first
PREEMPTED = 75      # sysexits EX_TEMPFAIL: stopped early on request, saved; relaunching the same command resumes
