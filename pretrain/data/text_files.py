"""Raw text inputs → documents: `.txt`, `.jsonl` (field `text`), either compressed as `.gz` or `.zst` (the Pile's
`.jsonl.zst`), and `.parquet` with a string column `text` (FineWeb's); strictly UTF-8. `.zst` needs zstandard and
`.parquet` pyarrow, the optional extra `formats` (`pip install -e .[formats]`); a missing one is named up front.

Document boundaries:
- `.jsonl`: one record is one document (records with empty `text` are skipped).
- `.parquet`: one row is one document (rows with empty `text` are skipped).
- `.txt`: chosen by `txt_docs`:
  - ``"paragraphs"`` (default): maximal runs of non-blank lines; blank (whitespace-only) lines separate documents.
  - ``"wikitext"``: a WikiText article heading starts a new document: a line ``" = Title = "`` with exactly one
    ``=`` on each side, between blank lines (WikiText's tables hold such lines too, never between blank lines).
    Section headings ``" = = Section = = "`` and blank lines stay inside the article. WikiText-2 gives 600, 60
    and 60 articles in train, valid and test, the counts its authors give.
  - ``"file"``: the whole file is one document.
A document's text is its lines verbatim, with leading and trailing blank lines and the final newline removed.
Lines are split at ``\\n`` only, so ``\\r``, form feeds and the like stay in the text.
"""
import glob
import gzip
import importlib
import io
import json
import os
from collections.abc import Iterable, Iterator

from tqdm import tqdm

TXT_DOC_RULES = ("paragraphs", "wikitext", "file")
COMPRESSIONS = {".gz": None, ".zst": "zstandard"}  # suffix → the optional module that reads it
FORMATS_EXTRA = "pip install -e .[formats]"


def expand_inputs(patterns: Iterable[str]) -> list[str]:
    """Files named by paths or globs, in argument order (each glob sorted); a pattern matching nothing is an error."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"input pattern {pattern!r} matches no file")
        for path in matches:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"input file {path!r} does not exist")
            _needed_module(path)
            paths.append(path)
    if not paths:
        raise ValueError("no input files given")
    return paths


def input_kind(path: str) -> str:
    """``"txt"``, ``"jsonl"`` or ``"parquet"``, from the name (a ``.gz`` or ``.zst`` suffix is looked through)."""
    if path.endswith(".parquet"):
        return "parquet"
    suffix = os.path.splitext(path)[1]
    name = path.removesuffix(suffix) if suffix in COMPRESSIONS else path
    for kind in ("txt", "jsonl"):
        if name.endswith("." + kind):
            return kind
    raise ValueError(f"input file {path!r}: unsupported type; expected .txt or .jsonl (either may be .gz or .zst), "
                     "or .parquet")


def _needed_module(path: str):
    """The optional module reading ``path`` needs (None: none), imported; missing, an error naming the extra."""
    name = "pyarrow.parquet" if input_kind(path) == "parquet" else COMPRESSIONS.get(os.path.splitext(path)[1])
    if name is None:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"input file {path!r} needs the {name.split('.')[0]} package: {FORMATS_EXTRA}") from None


def _decompressed(raw: io.BufferedReader, path: str):
    if path.endswith(".gz"):
        return gzip.open(raw)
    if path.endswith(".zst"):
        return io.BufferedReader(_needed_module(path).ZstdDecompressor().stream_reader(raw))
    return raw


def _lines(path: str, progress: tqdm | None) -> Iterator[str]:
    """Lines of a file (``\\n`` kept), decoded strictly; invalid UTF-8 is an error naming file, line and byte."""
    with open(path, "rb") as raw:
        stream = _decompressed(raw, path)
        done = 0
        for number, line in enumerate(stream, start=1):
            try:
                yield line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}: line {number}: invalid UTF-8 at byte {err.start} of the line "
                                 f"({err.reason})") from None
            if progress is not None and number % 4096 == 0:
                position = raw.tell()
                progress.update(position - done)
                done = position
        if progress is not None:
            progress.update(os.path.getsize(path) - done)


def _is_blank(line: str) -> bool:
    return not line.strip()


def _is_article_heading(previous: str, line: str, following: str) -> bool:
    """`` = Title = `` between blank lines: WikiText's article heading (tables hold `` = x = `` lines too)."""
    title = line.strip()
    return (len(title) > 4 and title.startswith("= ") and title.endswith(" =")
            and not title.startswith("= =") and not title.endswith("= =")
            and _is_blank(previous) and _is_blank(following))


def _with_neighbours(lines: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """(previous, line, following) of every line; the file's edges count as blank lines."""
    previous, line = "\n", None
    for following in lines:
        if line is not None:
            yield previous, line, following
            previous = line
        line = following
    if line is not None:
        yield previous, line, "\n"


def _join(lines: list[str]) -> str:
    while lines and _is_blank(lines[-1]):
        lines.pop()
    start = 0
    while start < len(lines) and _is_blank(lines[start]):
        start += 1
    text = "".join(lines[start:])
    return text[:-1] if text.endswith("\n") else text


def _txt_documents(lines: Iterable[str], rule: str) -> Iterator[str]:
    if rule == "file":
        text = _join(list(lines))
        if text:
            yield text
        return
    current: list[str] = []
    for previous, line, following in _with_neighbours(lines):
        starts_document = (_is_blank(line) if rule == "paragraphs"
                           else _is_article_heading(previous, line, following))
        if starts_document and current:
            text = _join(current)
            if text:
                yield text
            current = []
        if rule == "wikitext" or not _is_blank(line):
            current.append(line)
    text = _join(current)
    if text:
        yield text


def _jsonl_documents(lines: Iterable[str], path: str) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if _is_blank(line):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}: line {number}: expected an object with a string field 'text'")
        try:
            record["text"].encode("utf-8")
        except UnicodeEncodeError as err:  # JSON escapes can spell lone surrogates
            raise ValueError(f"{path}: line {number}: 'text' is not valid Unicode ({err.reason} at "
                             f"character {err.start})") from None
        if record["text"]:
            yield record["text"]


def _parquet_documents(path: str, progress: tqdm) -> Iterator[str]:
    """The ``text`` column, row by row, read a batch of rows at a time (FineWeb's files hold ~1M rows)."""
    parquet = _needed_module(path)
    try:
        table = parquet.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid for a file that is not parquet
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    schema = table.schema_arrow
    if "text" not in schema.names or str(schema.field("text").type) not in ("string", "large_string", "string_view"):
        raise ValueError(f"{path}: expected a string column 'text' (columns: {', '.join(schema.names)})")
    rows, total, size = 0, max(table.metadata.num_rows, 1), os.path.getsize(path)
    for batch in table.iter_batches(batch_size=4096, columns=["text"]):
        for text in batch.column(0).to_pylist():
            rows += 1
            if text is None:
                raise ValueError(f"{path}: row {rows}: 'text' is null")
            if text:
                yield text
        progress.update(size * rows // total - size * (rows - batch.num_rows) // total)


def read_text_documents(paths: Iterable[str], *, txt_docs: str = "paragraphs",
                        progress: bool = False) -> Iterator[str]:
    """Documents of the given files in order; ``progress`` shows a bar over the files' (on-disk) bytes."""
    if txt_docs not in TXT_DOC_RULES:
        raise ValueError(f"txt_docs={txt_docs!r}: expected one of {', '.join(TXT_DOC_RULES)}")
    paths = list(paths)
    bar = tqdm(total=sum(os.path.getsize(p) for p in paths), unit="B", unit_scale=True,
               desc="reading", disable=not progress)
    with bar:
        for path in paths:
            kind = input_kind(path)
            if kind == "parquet":
                yield from _parquet_documents(path, bar)
            elif kind == "jsonl":
                yield from _jsonl_documents(_lines(path, bar), path)
            else:
                yield from _txt_documents(_lines(path, bar), txt_docs)
