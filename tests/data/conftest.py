"""Fixtures of the data tests: a generated corpus, a tokenizer trained on it, and shards of known token ids."""
import json
import random

import numpy as np
import pytest

from pretrain.data import train_tokenizer
from pretrain.data.shards import ShardWriter, write_manifest

WORDS = ["the", "a", "river", "stone", "light", "über", "naïve", "日本", "語", "😀", "x=1;", "\t", "42", "▁mark"]


def random_text(rng: random.Random, words: int) -> str:
    """Words, punctuation and line breaks, with non-ASCII, emoji, tabs and sentencepiece's own ▁ mixed in."""
    out = []
    for _ in range(words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice([" ", " ", " ", ", ", ".\n", "  "]))
    return "".join(out).strip()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A .txt (blank-line separated paragraphs) and a .jsonl of distinct documents; (paths, documents)."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("corpus")
    docs = [f"document {i}: " + random_text(rng, rng.randint(1, 120)) for i in range(300)]
    (root / "a.txt").write_text("\n\n".join(d.replace("\n", " ") for d in docs[:150]) + "\n", encoding="utf-8")
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        for d in docs[150:]:
            f.write(json.dumps({"text": d}) + "\n")
    expected = [d.replace("\n", " ") for d in docs[:150]] + docs[150:]
    return [str(root / "a.txt"), str(root / "b.jsonl")], expected


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory):
    paths, _ = corpus
    return train_tokenizer(paths, 400, str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture
def numbered_shards(tmp_path):
    """Shards of 90 documents whose tokens are their 1-based positions in the corpus (all distinct), lengths
    1..59, 7 documents a shard; returns (directory, documents)."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, size=90)
    docs = [np.arange(end - n, end) + 1 for n, end in zip(lengths, np.cumsum(lengths))]
    directory = tmp_path / "numbered"
    directory.mkdir()
    writer = ShardWriter(str(directory), samples_per_shard=7)
    for i, tokens in enumerate(docs):
        members = {"tokens.u32": tokens.astype("<u4").tobytes(), "json": b'{"num_bytes":%d}' % len(tokens)}
        writer.add(f"{i:010d}", members, tokens=len(tokens), bytes=len(tokens))
    files = writer.close()
    write_manifest(str(directory), {"tokenizer_sha256": "0" * 64, "files": files, "shards": len(files)})
    return str(directory), docs
