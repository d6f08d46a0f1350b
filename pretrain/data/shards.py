"""Webdataset shards: deterministic tar writing, strict streaming tar reading, shard patterns, ``manifest.json``.

A shard is a plain (ustar) tar whose members are grouped into samples by key, webdataset style:
``000000042.tokens.u16`` and ``000000042.json`` form the sample with key ``000000042``. Writing fixes every header
field (mtime 0, uid/gid 0, mode 0444), so the same samples give byte-identical shards; a shard appears under its
final name only once it is complete.

Reading takes a whole shard into memory and checks every header checksum and the end-of-archive block before
handing out a sample, so a corrupt or truncated shard is an error naming the file (``ShardError``) and never a
silently shortened shard, as ``tarfile``'s stream mode can give. The manifest records each shard's sha256, and
readers that know it (``recorded_checksums``) also catch damage inside the data.

Shard patterns use webdataset's brace expansion (``DIR/shard-{000000..000099}.tar``; ``::`` joins patterns) and
globs; a directory stands for the shards its ``manifest.json`` lists. A brace range may run past the last shard
(files missing after the last existing one are ignored), but a gap is an error. Streamed URLs are opened by
webdataset's ``gopen``: ``http(s)://HOST/shard-{000..999}.tar`` downloads (through curl; every expanded name must
exist, a 404 is an error naming the URL), and ``pipe:CMD`` runs a shell command, refused unless ``allow_pipe`` is
set. A streamed shard is read whole and checked as strictly as a local one.
"""
import glob
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from braceexpand import braceexpand

from pretrain.atomic import atomic_path

MANIFEST = "manifest.json"
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_FILE_TYPES, _NAME_TYPES, _SKIPPED_TYPES = b"0\0", b"Lx", b"5g"  # regular files; long names; dirs, global pax
STREAMED = ("pipe:", "http://", "https://")
# curl's exit statuses a download meets (gopen fetches http(s) through curl -f)
_CURL_FAILURES = {6: "unknown host", 7: "cannot connect to the server", 18: "the download ended early",
                  22: "the server answered with an HTTP error (404: no such shard)", 28: "the download timed out",
                  56: "the connection broke off"}


class ShardError(ValueError):
    """A shard that cannot be read: missing, empty, corrupt, truncated, or of the wrong tokenizer."""


# ---------------------------------------------------------------- patterns and manifests

def load_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ShardError(f"{path} does not exist (is {directory!r} a shard directory?)") from None
    except json.JSONDecodeError as err:
        raise ShardError(f"{path} is not valid JSON ({err.msg})") from None


def write_manifest(directory: str, manifest: dict) -> None:
    with atomic_path(os.path.join(directory, MANIFEST)) as tmp, open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


def _existing_prefix(names: list[str], pattern: str) -> list[str]:
    """The expanded names up to the last existing file; an earlier missing or empty one is an error."""
    listing: dict[str, set[str]] = {}
    last = -1
    for i, name in enumerate(names):
        directory, _, base = name.rpartition("/")
        if directory not in listing:
            listing[directory] = set(os.listdir(directory or ".")) if os.path.isdir(directory or ".") else set()
        if base in listing[directory]:
            last = i
    if last < 0:
        raise ShardError(f"shard pattern {pattern!r} matches no file")
    for name in names[:last + 1]:
        if not os.path.isfile(name):
            raise ShardError(f"shard {name} is missing (pattern {pattern!r})")
        if os.path.getsize(name) == 0:
            raise ShardError(f"shard {name} is empty")
    return names[:last + 1]


_SIMPLE_RANGE = re.compile(r"([^{}]*)\{(\d+)\.\.(\d+)\}([^{}]*)")


def _brace_expand(pattern: str) -> list[str]:
    """braceexpand, with a fast path for the common ``prefix{000000..999999}suffix`` (a million names in 0.3 s)."""
    simple = _SIMPLE_RANGE.fullmatch(pattern)
    if simple is None:
        return list(braceexpand(pattern))
    prefix, first, last, suffix = simple.groups()
    padded = any(bound.startswith("0") and bound != "0" for bound in (first, last))
    width = max(len(first), len(last)) if padded else 0
    step = 1 if int(last) >= int(first) else -1
    return [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(first), int(last) + step, step)]


def is_streamed(url: str) -> bool:
    """A shard read as a stream (a download, a command's output), not a file: not checked to exist up front, and
    without a manifest at hand."""
    return url.startswith(STREAMED)


def expand_shards(pattern: str, *, allow_pipe: bool = False) -> list[str]:
    """The shard URLs a pattern names, checked to exist (local paths) and in pattern order."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ShardError(f"shard pattern {pattern!r} is empty")
    urls = []
    for url in (u for part in pattern.split("::") for u in _brace_expand(part)):
        if url.startswith("pipe:"):
            if not allow_pipe:
                raise ShardError(f"shard URL {url!r} runs a shell command; set allow_pipe to allow pipe: URLs")
        elif "://" in url and not is_streamed(url) and not url.startswith("file://"):
            raise ShardError(f"shard URL {url!r}: only local paths, http(s):// and pipe: URLs are supported")
        urls.append(url.removeprefix("file://").removeprefix("file:"))
    if len(urls) == 1 and os.path.isdir(urls[0]):
        urls = [os.path.join(urls[0], f["name"]) for f in load_manifest(urls[0])["files"]]
    elif glob.has_magic(pattern):
        urls = [m for u in urls for m in (sorted(glob.glob(u)) or [u])]
    local = [u for u in urls if not is_streamed(u)]
    if not local:
        return urls
    if len(local) == len(urls):
        return _existing_prefix(urls, pattern)
    kept = set(_existing_prefix(local, pattern))
    return [u for u in urls if is_streamed(u) or u in kept]


def recorded_checksums(urls: list[str]) -> dict[str, str]:
    """sha256 of each local shard as its directory's manifest records it (streamed and unlisted shards have none)."""
    listed: dict[str, dict] = {}
    checksums = {}
    for url in urls:
        if is_streamed(url):
            continue
        directory, name = os.path.split(url)
        if directory not in listed:
            try:
                listed[directory] = {f["name"]: f.get("sha256") for f in load_manifest(directory or ".")["files"]}
            except (ShardError, KeyError, TypeError):
                listed[directory] = {}
        if listed[directory].get(name):
            checksums[url] = listed[directory][name]
    return checksums


def verify_shards(urls: list[str], *, report: Callable[[str], None] | None = None, every: float = 10.0) -> str:
    """Hash every local shard against the sha256 its manifest records, so a corrupt shard is found before a run
    meets it at step 1500; ``report`` gets a progress line every ``every`` seconds. Streamed shards (``pipe:``,
    ``http(s)://``) are checked as they are read instead. Returns a summary; ``ShardError`` names each bad shard."""
    checksums = recorded_checksums(urls)
    local = [u for u in urls if not is_streamed(u)]
    bad, done_bytes, last = [], 0, time.monotonic()
    for i, url in enumerate(local):
        if url not in checksums:
            bad.append(f"{url} (its manifest records no sha256)")
        else:
            with open(url, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != checksums[url]:
                    bad.append(f"{url} (sha256 differs from its manifest's)")
            done_bytes += os.path.getsize(url)
        if report is not None and time.monotonic() - last >= every:
            report(f"verified {i + 1}/{len(local)} shards ({done_bytes / 1e9:.2f} GB)")
            last = time.monotonic()
    if bad:
        raise ShardError(f"{len(bad)} of {len(local)} shards fail verification: {'; '.join(bad)}; rewrite them "
                         "with make_shards.py, or leave them out of the pattern")
    streamed = len(urls) - len(local)
    return f"{len(local)} shards match their manifest's sha256" + (
        f" ({streamed} streamed shards are checked as they are read)" if streamed else "")


# ---------------------------------------------------------------- reading

def read_whole(url: str) -> bytes:
    """The bytes of a shard; streamed ones through webdataset's ``gopen`` (imported only for them: it imports
    torch). A failed command or download is a ``ShardError`` naming the URL and the cause."""
    try:
        if not is_streamed(url):
            with open(url, "rb", buffering=1 << 20) as f:
                return f.read()
        from webdataset.gopen import gopen

        stream = gopen(url, "rb", bufsize=1 << 20)
    except OSError as err:
        raise ShardError(f"cannot open shard {url}: {err}") from None
    try:
        with stream:
            return stream.read()
    except OSError as err:
        status = getattr(stream, "status", None)
        if status is None:
            raise ShardError(f"cannot read shard {url}: {err}") from None
        if url.startswith("pipe:"):
            raise ShardError(f"{url} exited with status {status}") from None
        cause = _CURL_FAILURES.get(status, "the download failed")
        raise ShardError(f"cannot fetch shard {url}: {cause} (curl exit status {status})") from None


def _octal(field: bytes, url: str, offset: int) -> int:
    try:
        return int(field.strip(b"\0 ") or b"0", 8)
    except ValueError:
        raise ShardError(f"shard {url}: corrupt tar header at byte {offset}") from None


def _check_headers(buf: bytes, offsets: list[int], url: str) -> None:
    """Every header's checksum, vectorized (summing 512 bytes in Python would cost more than the rest)."""
    data, digits = np.frombuffer(buf, np.uint8), 8 ** np.arange(5, -1, -1)
    for first in range(0, len(offsets), 4096):
        chunk = np.asarray(offsets[first:first + 4096])
        blocks = data[chunk[:, None] + np.arange(_BLOCK)]
        computed = blocks.sum(1, dtype=np.int64) - blocks[:, 148:156].sum(1, dtype=np.int64) + 8 * ord(" ")
        stored = (blocks[:, 148:154].astype(np.int64) - ord("0")) @ digits  # the usual six digits, NUL, space
        for i in np.flatnonzero(stored != computed):  # another spelling of the field, or real corruption
            offset = int(chunk[i])
            if _octal(buf[offset + 148:offset + 156], url, offset) != computed[i]:
                raise ShardError(f"shard {url}: corrupt tar header at byte {offset} (checksum mismatch)")


def _long_name(kind: int, data: bytes) -> bytes | None:
    """The next member's name from a GNU ``L`` record or a pax ``x`` record (``LEN path=NAME\\n`` lines)."""
    if kind == ord("L"):
        return data.split(b"\0", 1)[0]
    for record in data.split(b"\n"):
        _, _, field = record.partition(b" ")
        if field.startswith(b"path="):
            return field[len(b"path="):]
    return None


def iter_members(url: str, sha256: str | None = None) -> Iterator[tuple[str, bytes]]:
    """(name, data) of each regular file in the tar (or .tar.gz) at ``url``, the whole of it read and checked first
    (against ``sha256`` of the file, when given)."""
    raw = read_whole(url)
    try:
        buf = gzip.decompress(raw) if url.endswith(".gz") else raw
    except (OSError, EOFError, zlib.error) as err:
        raise ShardError(f"cannot read shard {url}: {err}") from None
    if not buf:
        raise ShardError(f"shard {url} is empty")
    members, headers, offset, long_name = [], [], 0, None
    while True:
        if offset + _BLOCK > len(buf):
            _check_headers(buf, headers, url)
            raise ShardError(f"shard {url} is truncated at byte {len(buf)} (no end-of-archive block)")
        if buf[offset] == 0 and buf[offset:offset + _BLOCK] == _ZERO_BLOCK:
            break
        headers.append(offset)
        size = _octal(buf[offset + 124:offset + 136], url, offset)
        start, end = offset + _BLOCK, offset + _BLOCK + size + (-size) % _BLOCK
        kind = buf[offset + 156]
        if end > len(buf) or kind not in _FILE_TYPES + _NAME_TYPES + _SKIPPED_TYPES:
            _check_headers(buf, headers, url)  # a corrupt header explains it better than what follows from it
            if end > len(buf):
                raise ShardError(f"shard {url} is truncated inside the member at byte {offset}")
            raise ShardError(f"shard {url}: unsupported tar member type {chr(kind)!r} at byte {offset}")
        if kind in _NAME_TYPES:
            long_name = _long_name(kind, buf[start:start + size]) or long_name
        elif kind in _FILE_TYPES:
            name = long_name
            if name is None:
                name_end = buf.find(b"\0", offset, offset + 100)
                name = buf[offset:name_end if name_end >= 0 else offset + 100]
                if buf[offset + 257:offset + 262] == b"ustar" and buf[offset + 345] != 0:
                    name = buf[offset + 345:offset + 500].split(b"\0", 1)[0] + b"/" + name
            members.append((name.decode("utf-8", errors="replace"), start, size))
            long_name = None
        else:
            long_name = None
        offset = end
    _check_headers(buf, headers, url)
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise ShardError(f"shard {url} is corrupt: its sha256 differs from the one its manifest records")
    for name, start, size in members:
        yield name, buf[start:start + size]


def iter_samples(url: str, sha256: str | None = None) -> Iterator[dict]:
    """Webdataset samples: ``{"__key__": key, ext: bytes, ...}`` from consecutive members sharing a key."""
    sample: dict = {}
    for name, data in iter_members(url, sha256):
        folder, slash, base = name.rpartition("/")
        stem, dot, ext = base.partition(".")
        if not dot:
            raise ShardError(f"shard {url}: member {name!r} has no extension (expected KEY.EXT)")
        key = folder + slash + stem
        if sample and sample["__key__"] != key:
            yield sample
            sample = {}
        sample["__key__"] = key
        sample[ext] = data
    if sample:
        yield sample


# ---------------------------------------------------------------- writing

class ShardWriter:
    """Writes ``DIR/shard-000000.tar``, ... with deterministic headers; each appears only when complete."""

    def __init__(self, directory: str, *, samples_per_shard: int):
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard={samples_per_shard}: must be at least 1")
        self.directory, self.samples_per_shard = directory, samples_per_shard
        self.files: list[dict] = []  # name and sample count of each finished shard, plus what add() tallies
        self._tar: tarfile.TarFile | None = None
        self._tally: dict = {}

    def add(self, key: str, members: dict[str, bytes], **tally: int) -> None:
        """One sample; ``tally`` (e.g. tokens=, bytes=) is summed per shard into ``files``."""
        if self._tar is None:
            self._open_next()
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(data), 0o444, 0
            self._tar.addfile(info, io.BytesIO(data))
        self._tally["samples"] += 1
        for name, value in tally.items():
            self._tally[name] = self._tally.get(name, 0) + value
        if self._tally["samples"] == self.samples_per_shard:
            self._close_current()

    def close(self) -> list[dict]:
        if self._tar is not None:
            self._close_current()
        return self.files

    def _path(self) -> str:
        return os.path.join(self.directory, f"shard-{len(self.files):06d}.tar")

    def _open_next(self) -> None:
        self._tar = tarfile.open(self._path() + ".tmp", "w", format=tarfile.USTAR_FORMAT)
        self._tally = {"samples": 0}

    def _close_current(self) -> None:
        self._tar.close()
        with open(self._path() + ".tmp", "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        os.replace(self._path() + ".tmp", self._path())
        self.files.append({"name": os.path.basename(self._path()), **self._tally, "sha256": digest})
        self._tar = None


@contextmanager
def fresh_output_dir(directory: str):
    """Create ``directory`` to write a shard set into; refuse one that already holds files, so nothing written
    before is lost, and on failure remove what was written, so no half set is left behind."""
    if os.path.isdir(directory) and os.listdir(directory):
        raise FileExistsError(f"output directory {directory!r} is not empty; choose a new --out")
    os.makedirs(directory, exist_ok=True)
    try:
        yield
    except BaseException:
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        raise
