"""Text shards: one pre-tokenized document per webdataset sample.

Sample format (key = the document's index in the whole set, 10 digits):
- ``KEY.tokens.u16`` or ``KEY.tokens.u32``: the token ids, **``eos`` appended**, as raw little-endian unsigned
  integers (``u16`` when the vocabulary has at most 65536 ids, else ``u32``); the extension names the dtype.
- ``KEY.json``: ``{"num_bytes": N, "tokenizer_sha256": "..."}``: the UTF-8 byte length of the document's text (for
  bits per byte) and the tokenizer's identity, so that streamed shards (``pipe:``, ``http(s)://``) can be checked too.

``DIR/manifest.json`` holds ``shards`` (count), ``documents``, ``tokens`` (eos included), ``bytes``,
``tokenizer_sha256``, ``vocab_size``, ``eos_id``, ``token_dtype``, the input files and the document rule, and
``files``: per shard its ``name``, ``samples``, ``tokens``, ``bytes`` and ``sha256``.

Documents are cut into shards in input order, so the same inputs and tokenizer give byte-identical shards,
whatever the number of tokenizing processes.
"""
import json
import logging
import multiprocessing
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from pretrain.data.shards import (
    MANIFEST,
    ShardError,
    ShardWriter,
    expand_shards,
    fresh_output_dir,
    is_streamed,
    iter_samples,
    load_manifest,
    read_whole,
    recorded_checksums,
    write_manifest,
)
from pretrain.data.text_files import expand_inputs, read_text_documents
from pretrain.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)
TOKEN_DTYPES = {"tokens.u16": np.dtype("<u2"), "tokens.u32": np.dtype("<u4")}


class Document(NamedTuple):
    tokens: np.ndarray  # 1-D token ids, eos included
    num_bytes: int      # UTF-8 bytes of the text
    key: str            # "shard-path#sample-key", for error messages


def token_extension(vocab_size: int) -> str:
    return "tokens.u16" if vocab_size <= 1 << 16 else "tokens.u32"


def _tokens(sample: dict, url: str) -> np.ndarray:
    for ext, dtype in TOKEN_DTYPES.items():
        if ext in sample:
            data = sample[ext]
            if len(data) % dtype.itemsize:
                raise ShardError(f"shard {url}: sample {sample['__key__']}: {ext} has {len(data)} bytes, "
                                 "not a whole number of ids")
            return np.frombuffer(data, dtype=dtype)
    raise ShardError(f"shard {url}: sample {sample['__key__']} has no tokens.u16/tokens.u32 member "
                     "(not a text shard?)")


def iter_shard_documents(url: str, sha256: str | None = None, tokenizer_sha256: str | None = None
                         ) -> Iterator[Document]:
    """A shard's documents; checks the tokenizer its first sample records if ``tokenizer_sha256`` is given."""
    for i, sample in enumerate(iter_samples(url, sha256)):
        if i == 0 and tokenizer_sha256 is not None:
            _check_sample_tokenizer(sample, url, tokenizer_sha256)
        try:
            num_bytes = int(json.loads(sample["json"])["num_bytes"])
        except (KeyError, ValueError, TypeError):
            raise ShardError(f"shard {url}: sample {sample['__key__']} lacks a json member with num_bytes") from None
        yield Document(_tokens(sample, url), num_bytes, f"{url}#{sample['__key__']}")


def iter_shard_tokens(url: str, sha256: str | None = None, tokenizer_sha256: str | None = None
                      ) -> Iterator[np.ndarray]:
    """Just the token arrays, for training (which needs no byte counts); checks the tokenizer if given."""
    for i, sample in enumerate(iter_samples(url, sha256)):
        if i == 0 and tokenizer_sha256 is not None:
            _check_sample_tokenizer(sample, url, tokenizer_sha256)
        yield _tokens(sample, url)


def shard_counts(urls: list[str]) -> list[tuple[int, int]]:
    """(tokens, documents) of each shard, as its directory's ``manifest.json`` records them (``files``: ``tokens``,
    ``samples``), fetched beside streamed shards too. A shard with no count on record is read once to count it (a
    pass over it before training starts), with a warning saying how many."""
    listed: dict[str, dict] = {}
    counts: list[tuple[int, int] | None] = []
    for url in urls:
        directory, _, name = url.rpartition("/")
        if directory not in listed:
            listed[directory] = _recorded_counts(directory)
        counts.append(listed[directory].get(name))
    missing = [i for i, count in enumerate(counts) if count is None]
    if missing:
        log.warning("%d of %d shards have no token count in a manifest.json beside them (first: %s): reading each "
                    "once to count it", len(missing), len(urls), urls[missing[0]])
        for i in missing:
            lengths = [len(tokens) for tokens in iter_shard_tokens(urls[i])]
            counts[i] = (sum(lengths), len(lengths))
    return counts


def _recorded_counts(directory: str) -> dict[str, tuple[int, int]]:
    """name -> (tokens, documents) of the shards a directory's manifest lists with both; {} without one."""
    path = f"{directory or '.'}/{MANIFEST}"
    try:
        manifest = json.loads(read_whole(path)) if is_streamed(path) else load_manifest(directory or ".")
        return {f["name"]: (int(f["tokens"]), int(f["samples"])) for f in manifest["files"]
                if "tokens" in f and "samples" in f}
    except (ShardError, ValueError, KeyError, TypeError):
        return {}


def _check_sample_tokenizer(sample: dict, url: str, tokenizer_sha256: str) -> None:
    """A shard must record ``tokenizer_sha256`` in its first sample (a streamed shard has no manifest at hand)."""
    try:
        recorded = json.loads(sample["json"]).get("tokenizer_sha256")
    except (KeyError, ValueError, AttributeError):
        recorded = None
    if recorded != tokenizer_sha256:
        raise ShardError(f"shard {url} was written with tokenizer sha256 {recorded}, "
                         f"but this run's tokenizer is {tokenizer_sha256}")


def check_tokenizer(urls: list[str], tokenizer_sha256: str) -> None:
    """Refuse local shards whose manifest records another tokenizer (or none), before any reading starts.

    Streamed shards (``pipe:``, ``http(s)://``) have no manifest at hand; ``iter_shard_tokens`` checks each as it
    is read.
    """
    checked: set[str] = set()
    for url in urls:
        directory = os.path.dirname(url) or "."
        if is_streamed(url) or directory in checked:
            continue
        checked.add(directory)
        try:
            recorded = load_manifest(directory).get("tokenizer_sha256")
        except ShardError as err:
            raise ShardError(f"cannot check the tokenizer of shard {url}: {err}") from None
        if recorded != tokenizer_sha256:
            raise ShardError(f"shard {url} was written with tokenizer sha256 {recorded} "
                             f"({os.path.join(directory, MANIFEST)}), but this run's tokenizer is {tokenizer_sha256}")


def read_documents(pattern: str, *, allow_pipe: bool = False, tokenizer_sha256: str | None = None
                   ) -> Iterator[Document]:
    """Every document of the shards, in shard order, unshuffled (for evaluation); with ``tokenizer_sha256``, shards
    written with another tokenizer are refused before any is read (``check_tokenizer``), as training refuses them."""
    yield from read_shard_documents(expand_shards(pattern, allow_pipe=allow_pipe), tokenizer_sha256)


def read_shard_documents(urls: list[str], tokenizer_sha256: str | None = None) -> Iterator[Document]:
    """``read_documents`` of URLs already expanded (a trainer validating often expands its pattern once), each
    shard checked against the sha256 its manifest records, and against ``tokenizer_sha256`` when given (local shards
    by their manifest before the first is read, streamed ones by their first sample)."""
    if tokenizer_sha256 is not None:
        check_tokenizer(urls, tokenizer_sha256)
    checksums = recorded_checksums(urls)
    for url in urls:
        yield from iter_shard_documents(url, checksums.get(url), tokenizer_sha256)


# ---------------------------------------------------------------- writing

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tokenizer_path)


def _encode_chunk(texts: list[str]) -> list[tuple[bytes, int, int]]:
    """(token bytes with eos, token count, UTF-8 byte count) per text."""
    tok = _worker_tokenizer
    dtype = TOKEN_DTYPES[token_extension(tok.vocab_size)]
    out = []
    for text, ids in zip(texts, tok.encode_batch(texts)):
        ids.append(tok.eos_id)
        out.append((np.asarray(ids, dtype=dtype).tobytes(), len(ids), len(text.encode("utf-8"))))
    return out


def _chunks(documents: Iterator[str], max_docs: int = 256, max_chars: int = 1 << 20) -> Iterator[list[str]]:
    """Work units for the tokenizing processes: small enough to share out long documents evenly."""
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) == max_docs or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def make_text_shards(inputs: list[str], tokenizer_path: str, out_dir: str, *, docs_per_shard: int = 10_000,
                     txt_docs: str = "paragraphs", workers: int = 1, progress: bool = False) -> dict:
    """Tokenize the documents of ``inputs`` (paths or globs) into shards in ``out_dir``; returns the manifest."""
    paths = expand_inputs(inputs)
    tokenizer = Tokenizer(tokenizer_path)
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard={docs_per_shard}: must be at least 1")
    extension = token_extension(tokenizer.vocab_size)
    json_format = b'{"num_bytes":%d,"tokenizer_sha256":"' + tokenizer.sha256.encode() + b'"}'
    writer = ShardWriter(out_dir, samples_per_shard=docs_per_shard)
    chunks = _chunks(read_text_documents(paths, txt_docs=txt_docs, progress=progress))
    pool = multiprocessing.Pool(workers, _init_worker, (tokenizer_path,)) if workers > 1 else None
    _init_worker(tokenizer_path)
    encoded = pool.imap(_encode_chunk, chunks) if pool else map(_encode_chunk, chunks)
    count = 0
    try:
        with fresh_output_dir(out_dir), tqdm(unit="doc", desc="sharding", disable=not progress) as bar:
            for chunk in encoded:
                for data, num_tokens, num_bytes in chunk:
                    writer.add(f"{count:010d}", {extension: data, "json": json_format % num_bytes},
                               tokens=num_tokens, bytes=num_bytes)
                    count += 1
                bar.update(len(chunk))
            files = writer.close()
            if not files:
                raise ValueError(f"inputs {inputs} hold no documents")
    finally:
        if pool:
            pool.terminate()
    manifest = {
        "format": "pretrain-text-shards-v1",
        "shards": len(files), "documents": count,
        "tokens": sum(f["tokens"] for f in files), "bytes": sum(f["bytes"] for f in files),
        "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
        "token_dtype": extension.split(".")[1], "inputs": [os.path.basename(p) for p in paths],
        "txt_docs": txt_docs, "files": files,
    }
    write_manifest(out_dir, manifest)
    return manifest
