"""Training metrics: tensorboard scalars, one JSON line per logged step (``metrics.jsonl``), a progress line.

Only rank 0 writes; the values it writes are already reduced over ranks by the loop.
"""
import json
import sys
from pathlib import Path

import torch

from ..atomic import atomic_path
from ..resident import peak_resident_bytes

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
    return peak_resident_bytes()


class MetricsFileError(OSError):
    """``metrics.jsonl`` holds a line that is not a logged step before its last one: corruption, not a torn write
    (an OSError, so the launcher reports it in one line)."""


def read_rows(path: Path) -> tuple[list[tuple[str, int]], str | None]:
    """``(rows, torn)``: each row of ``metrics.jsonl`` as ``(line with its newline, step)``, and the last line when
    it is not a logged step (a write cut short by a kill or a full disk; None when it is one). Such a line anywhere
    else is corruption: ``MetricsFileError`` naming the file and the line number."""
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    rows, torn = [], None
    for i, (number, line) in enumerate(numbered):
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int):
                raise TypeError(f"its step is {step!r}")
        except (ValueError, KeyError, TypeError) as err:
            if i == len(numbered) - 1:
                torn = line
                break
            raise MetricsFileError(f"{path}, line {number}: not a logged step ({type(err).__name__}: {err}), and "
                                   f"not the last line (a torn write ends the file): the file is corrupt; repair "
                                   f"or remove that line, then relaunch") from None
        rows.append((line + "\n", step))
    return rows, torn


class MetricsWriter:
    """``resume_step``: the step a run resumes from (0: a launch without a checkpoint, which starts over); what an
    earlier launch logged after it (up to its stop) is dropped, from metrics.jsonl and, with tensorboard's
    ``purge_step``, from the event files, so each step is written once however often the run is relaunched. A last
    line of metrics.jsonl cut short (a kill or a full disk during its write) is dropped with a one-line warning; a
    bad line before it is refused (``read_rows``)."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        path = Path(run_dir) / "metrics.jsonl"
        if path.exists():
            rows, torn = read_rows(path)
            if torn is not None:
                print(f"warning: dropped the last line of {path}, cut short by an interrupted write (a kill, a full "
                      f"disk): {torn[:80]!r}", file=sys.stderr, flush=True)
            kept = "".join(line for line, step in rows if step <= resume_step)
            if kept.encode() != path.read_bytes():  # rows dropped, or a last row without its newline
                with atomic_path(path) as tmp:
                    tmp.write_text(kept)
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)
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
