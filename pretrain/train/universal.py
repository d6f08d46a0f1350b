"""A checkpoint's universal copy (``TAG/universal/``), made so that no rank waits for it inside a collective.

A resume on another number of ranks needs the partitioned optimizer states whole: DeepSpeed's ``ds_to_universal``
writes one file per parameter and state. The conversion takes minutes per billion parameters, and a rank waiting
for it in a collective fails when the process group's timeout (10 minutes by default) runs out. So rank 0 converts
into a temporary folder and renames it to ``TAG/universal`` when done, while the other ranks watch the filesystem
(``run.dir`` is shared by every node already) with no deadline; a failure is written beside the tag, under a name
that only this attempt's ranks know, so an old failure never stops a new attempt. ``tools/reshard.py`` makes the
same copy ahead of the launch; a resume then finds it and converts nothing.
"""
import argparse
import contextlib
import io
import os
import shutil
import time
import uuid
from pathlib import Path

import torch.distributed as dist

UNIVERSAL = "universal"
POLL_S = 1.0


class ConversionError(OSError):
    """The conversion failed: the message names the checkpoint and DeepSpeed's error."""


def universal_dir(tag_dir: Path) -> Path:
    return Path(tag_dir) / UNIVERSAL


def convert(tag_dir: Path, *, workers: int = 1) -> float:
    """Write ``TAG/universal`` with DeepSpeed's ``ds_to_universal`` (its report kept off the output), whole or not at
    all: into a temporary folder renamed at the end. Return the seconds it took."""
    from deepspeed.checkpoint import ds_to_universal

    tag_dir = Path(tag_dir)
    for leftover in tag_dir.glob(f"{UNIVERSAL}.tmp-*"):  # an interrupted conversion's
        shutil.rmtree(leftover, ignore_errors=True)
    partial = tag_dir / f"{UNIVERSAL}.tmp-{uuid.uuid4().hex[:8]}"
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(partial), num_extract_workers=workers,
                              num_merge_workers=max(1, workers // 2), keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    start, report = time.perf_counter(), io.StringIO()
    try:
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
            ds_to_universal.main(args)
        os.replace(partial, universal_dir(tag_dir))
    except Exception as err:  # DeepSpeed's own asserts and errors: one line naming the checkpoint
        raise ConversionError(f"cannot reshard checkpoint {tag_dir}: DeepSpeed's ds_to_universal failed "
                              f"({type(err).__name__}: {err})") from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return time.perf_counter() - start


def prepare_on_every_rank(tag_dir: Path) -> float | None:
    """Make ``TAG/universal`` ready on every rank of the process group: rank 0 converts (unless a copy made ahead is
    there), the others wait on the filesystem, outside any collective. Return the conversion's seconds (None when
    the copy was there already); raise ``ConversionError`` on every rank when it failed."""
    tag_dir, rank = Path(tag_dir), dist.get_rank()
    attempt = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(attempt, src=0)  # quick: every rank is here
    failed = tag_dir / f"{UNIVERSAL}.failed-{attempt[0]}"
    if rank == 0:
        seconds = None
        for old in tag_dir.glob(f"{UNIVERSAL}.failed-*"):  # earlier attempts', read by their ranks long ago
            old.unlink(missing_ok=True)
        if not universal_dir(tag_dir).is_dir():
            try:
                seconds = convert(tag_dir)
            except ConversionError as err:
                failed.write_text(str(err))
                raise
    else:
        while not universal_dir(tag_dir).is_dir() and not failed.exists():
            time.sleep(POLL_S)
        if failed.exists():
            raise ConversionError(failed.read_text())
        seconds = None
    dist.barrier()  # every rank has the copy
    return seconds


def remove(tag_dir: Path) -> None:
    """Drop the universal copy once every rank has loaded it (rank 0; the tag's own files hold the same)."""
    shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)
