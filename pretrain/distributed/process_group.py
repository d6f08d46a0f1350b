"""One process group for every launcher: ``deepspeed``, ``torchrun`` and plain ``python`` (a world of one)."""
import contextlib
import datetime
import io
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from pretrain.parallel import SequenceShard

from .build_locks import check_build_locks

if not torch.cuda.is_available():  # else DeepSpeed warns on every rank, at its import, that it found no GPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    sequence: SequenceShard | None = None  # this rank's slice of every row, under sequence parallelism
    processes: tuple[tuple[str, int], ...] = ()  # (host, pid) of every rank, to name one that dies

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this rank belongs to: the ranks sharing a sequence read the same rows."""
        return self.rank if self.sequence is None else self.rank // self.sequence.size

    @property
    def data_size(self) -> int:
        return self.world_size if self.sequence is None else self.world_size // self.sequence.size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU collectives, a torch JIT extension


def use_extensions_dir() -> str:
    """Where torch builds (and finds) JIT extensions, set before DeepSpeed builds one: ``TORCH_EXTENSIONS_DIR`` when
    the user set it; else, in a writable virtual environment, ``torch_extensions`` under it. Environments sharing
    torch's default (``~/.cache/torch_extensions``) rebuilt the op for each other, 85 s a time, when their torch
    builds differed."""
    in_venv = sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK)
    if in_venv:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


@contextlib.contextmanager
def environment_ninja():
    """Put this environment's ``ninja`` (the ``ninja`` package's, which DeepSpeed requires) first on ``PATH`` for a
    JIT build, whatever the shell's ``PATH``: torch runs ``ninja`` from ``PATH``, and a venv activated or not found
    its own ninja (1.13) or the system's (1.11), whose build logs differ, so each rebuilt the op the other had built
    (85-110 s, every time the way python was started changed). Restored afterwards; unchanged without the package."""
    try:
        from ninja import BIN_DIR
    except ImportError:
        BIN_DIR = None
    path = os.environ.get("PATH", "")
    if BIN_DIR and os.path.isfile(os.path.join(BIN_DIR, "ninja")):
        os.environ["PATH"] = os.pathsep.join([BIN_DIR, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def comm_op_build(extensions: str) -> str | None:
    """What loading the comm op under ``extensions`` will cost: ``"builds"`` (never built there), ``"rebuilds"``
    (ninja finds the build out of date: a changed source, compiler flag or ninja), None (it just loads). Asked of
    the ninja the build will run (``ninja -n``, a dry run: milliseconds, nothing written)."""
    build = os.path.join(extensions, COMM_OP)
    if not os.path.exists(os.path.join(build, f"{COMM_OP}.so")):
        return "builds"
    with environment_ninja():
        ninja = shutil.which("ninja")
        if ninja is None or not os.path.exists(os.path.join(build, "build.ninja")):
            return "builds"
        dry = subprocess.run([ninja, "-n", "-C", build], capture_output=True, text=True)
    return None if dry.returncode == 0 and "no work to do" in dry.stdout else "rebuilds"


def comm_op_note(extensions: str) -> str | None:
    """The line said before a (re)build, which would otherwise look like a hang; None when the op just loads."""
    build = comm_op_build(extensions)
    if build is None:
        return None
    why = " (its build is out of date)" if build == "rebuilds" else ""
    return f"DeepSpeed {build} its CPU comm op under {extensions}{why}: about a minute, once per environment"


def build_comm_op() -> None:
    """Build DeepSpeed's CPU comm op now, where ``use_extensions_dir`` puts it (``make setup`` calls this, so no
    test or run pays the minute, or dies in the middle of it under a timeout). Nothing to build on CUDA."""
    if torch.cuda.is_available():
        return
    extensions = use_extensions_dir()
    check_build_locks()
    note = comm_op_note(extensions)
    if note is None:
        return
    print(note, flush=True)
    from deepspeed.accelerator import get_accelerator

    with contextlib.redirect_stdout(io.StringIO()), environment_ninja():
        get_accelerator().create_op_builder("ShareMemCommBuilder").load()


def init_process_group(timeout_s: float | None = None) -> World:
    """Join the launcher's process group: nccl on CUDA, gloo on CPU; ``timeout_s`` bounds any collective's wait
    (None: DeepSpeed's default).

    Launchers export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; a plain ``python`` run has none, so it becomes a world
    of one on a free local port (DeepSpeed needs a process group even then).
    """
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank, world_size = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    said = f"joining {world_size} rank{'s' if world_size > 1 else ''}"
    extensions = use_extensions_dir()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        check_build_locks()  # DeepSpeed loads (or first builds) its CPU comm op in init_distributed
        note = comm_op_note(extensions)
        if note:
            said += f"; {note}"
    if os.environ["RANK"] == "0":
        print(said, file=sys.stderr, flush=True)
    # DeepSpeed prints "... built successfully" on every rank
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    with contextlib.redirect_stdout(io.StringIO()), environment_ninja():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **timeout)
    # DeepSpeed's collectives call torch's all_gather_into_tensor and reduce_scatter_tensor, deprecated in favour of
    # all_gather_single and reduce_scatter_single, which they now call: the same ops, and FutureWarnings the user
    # cannot act on, from every rank of every ZeRO run (reduce_scatter's once a step: 20 lines in 10 ZeRO-3 steps)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning)
    _unlink_shm_allreduce_buffer()
    processes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(processes, (socket.gethostname(), os.getpid()))
    return World(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
                 local_rank=local_rank, device=device, processes=tuple(processes))


def lost_a_rank(err: BaseException) -> bool:
    """Whether a collective failed because another rank is gone. NCCL raises a DistError; gloo a bare RuntimeError
    about the connection its peer closed (or reset)."""
    return isinstance(err, torch.distributed.DistError) or (isinstance(err, RuntimeError) and "by peer" in str(err))


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a killed rank stays a zombie until its launcher reaps it


def gone_ranks(world: World, wait_s: float) -> list[int]:
    """The ranks on this host whose process has ended, waiting a little for a dying one to finish exiting (its
    sockets close before it is gone). Ranks on other hosts cannot be checked from here."""
    host, deadline = socket.gethostname(), time.monotonic() + wait_s
    while True:
        gone = [rank for rank, (where, pid) in enumerate(world.processes) if where == host and not _alive(pid)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def close_process_group() -> None:
    """Leave the process group, if joined. Left alive at exit, gloo's threads race the interpreter's teardown and
    can abort a finished process ("terminate called without an active exception", exit -6)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _unlink_shm_allreduce_buffer() -> None:
    """Remove the name of this rank's DeepSpeed shared-memory all-reduce buffer once every rank has mapped it.

    On CPU, when the launcher says all ranks are local (LOCAL_SIZE, as `deepspeed` sets it), DeepSpeed maps a 69 MB
    buffer per rank in /dev/shm named after MASTER_ADDR/MASTER_PORT and never unlinks it: every run would leak RAM,
    and a later run on the same port (29500, the launcher's default) would map a stale buffer. Unlinking after a
    barrier keeps the mappings alive for this run and lets the memory go with its processes.
    """
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), torch.distributed.get_rank())
    path = os.path.join("/dev/shm", name)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    if os.path.exists(path):
        os.unlink(path)
