"""The tokenizer pinned to its run: ``tokenizer_pin.json`` records the sha256 and vocabulary size of the file a run
started with, and whatever reads the run later (a resume, the tools, an export, ``train.init_from``) refuses a file
at ``data.tokenizer`` that differs. A run names its tokenizer by path, and a path can be written over (a retrained
tokenizer of another size scored a run's perplexity as 2,575 instead of 1,724, without a word); the hashes say
which file is which. An exported directory carries the record beside its copy of the tokenizer. (Not
``tokenizer.json``: transformers reads a file of that name in a model directory as its own tokenizer.)
"""
import json
from pathlib import Path

from pretrain.atomic import atomic_path
from pretrain.config import ConfigError
from pretrain.data import Tokenizer

RECORD = "tokenizer_pin.json"


def _describe(tokenizer_path: str) -> dict:
    try:
        tokenizer = Tokenizer(str(tokenizer_path))
    except (OSError, ValueError) as err:  # missing, or not a sentencepiece model
        raise ConfigError("data.tokenizer", str(err)) from None
    return {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}


def record_tokenizer(directory: Path, tokenizer_path: str) -> None:
    """Write ``DIRECTORY/tokenizer_pin.json`` for the tokenizer file at ``tokenizer_path``."""
    with atomic_path(Path(directory) / RECORD) as tmp:
        tmp.write_text(json.dumps({**_describe(tokenizer_path), "path": str(tokenizer_path)}, indent=2) + "\n")


def check_tokenizer(directory: Path, tokenizer_path: str) -> None:
    """Refuse (``ConfigError`` on ``data.tokenizer``, naming both hashes) a tokenizer file other than the one
    ``DIRECTORY/tokenizer_pin.json`` records; a directory without a record (older runs) is not checked."""
    record = Path(directory) / RECORD
    if not record.is_file():
        return
    pinned, found = json.loads(record.read_text()), _describe(tokenizer_path)
    if found["sha256"] != pinned["sha256"]:
        raise ConfigError("data.tokenizer", f"{tokenizer_path} (sha256 {found['sha256']}, {found['vocab_size']} "
                                            f"pieces) is not the tokenizer {directory} was trained with (sha256 "
                                            f"{pinned['sha256']}, {pinned['vocab_size']} pieces, recorded in "
                                            f"{record}): put that file back at {tokenizer_path}")


def pin_tokenizer(run_dir: Path, tokenizer_path: str | None, *, resuming: bool, is_main: bool) -> None:
    """At a run's start: a resumed run must find its tokenizer (checked on every rank, so each stops); a new one
    records it (rank 0). Tasks without a tokenizer pin nothing."""
    if not tokenizer_path:
        return
    if resuming:
        check_tokenizer(run_dir, tokenizer_path)
    if is_main and not (resuming and (Path(run_dir) / RECORD).is_file()):
        record_tokenizer(run_dir, tokenizer_path)
