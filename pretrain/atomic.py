"""Files that appear whole or not at all: written beside their place, then moved onto it in one rename."""
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``PATH.tmp`` (``path`` with its suffix replaced) to write to; when the block ends without an error it
    replaces ``path`` in one rename, otherwise it is removed. A crash mid-write never leaves ``path`` half written,
    and a reader sees the old file or the new one."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
