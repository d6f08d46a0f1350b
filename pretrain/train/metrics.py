"""Training metrics: tensorboard scalars, one JSON line per logged step (``metrics.jsonl``), a progress line.

Only rank 0 writes; the values it writes are already reduced over ranks by the loop.
"""
import json
import resource
from pathlib import Path

import torch

from ..atomic import atomic_path

# Dense bf16 tensor-core peak FLOP/s by device-name fragment (vendor specs).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The accelerator's peak FLOP/s when we know it; None on CPU and unknown GPUs (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated by this process; on CPU its peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsWriter:
    """``resume_step``: the step a run resumes from; what an earlier launch logged after it (up to its stop) is
    dropped, from metrics.jsonl and, with tensorboard's ``purge_step``, from the event files, so each step is
    written once however often the run resumes."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None = None):
        self.enabled = enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            with atomic_path(path) as tmp:
                tmp.write_text("".join(kept))
        purge = None if resume_step is None else resume_step + 1
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)
        self.jsonl = open(path, "a")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write ``values`` (keys like ``train/loss``) at ``step``."""
        if not self.enabled:
            return
        for key, value in values.items():
            self.tensorboard.add_scalar(key, value, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        self.tensorboard.flush()

    def text(self, tag: str, text: str) -> None:
        if self.enabled:
            self.tensorboard.add_text(tag, text)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.tensorboard.close()
            self.jsonl.close()
