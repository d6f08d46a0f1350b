"""Files that appear whole or not at all: written beside their place, then moved onto it in one rename."""
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``PATH.tmp`` (``path`` with its suffix replaced) to write to; when the block ends without an error it
    replaces ``path`` in one rename, otherwise it is removed. A crash mid-write never leaves ``path`` half written,
    and a reader sees the old file or the new one. The file gets the mode a new file gets (0644 under umask 022),
    whatever mode the writer created the temporary with."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # as any new file: a writer's private mode (safetensors' 0600) is not kept
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
