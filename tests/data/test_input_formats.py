"""make_shards' input formats beyond .txt/.jsonl: the Pile's .jsonl.zst and FineWeb-style .parquet (a text column).

They need the optional extra `formats`; these tests skip without it, and the missing-extra error is tested by
hiding the module.
"""
import json
import sys

import pytest

from pretrain.data import make_text_shards, read_documents

zstandard = pytest.importorskip("zstandard")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture
def documents(corpus):
    _, texts = corpus
    return texts[:120]


def write_pile(path, texts):
    """The Pile's layout: zstd-compressed JSON lines with `text` and a `meta` object."""
    lines = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "Pile-CC"}}) + "\n" for t in texts)
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(lines.encode("utf-8")))


def write_fineweb(path, texts):
    """FineWeb's layout: a text column among others, several row groups."""
    table = pa.table({"text": texts, "id": [f"<urn:{i}>" for i in range(len(texts))],
                      "token_count": [len(t) for t in texts]})
    pq.write_table(table, path, row_group_size=25)


def shard_tokens(directory):
    return [d.tokens.tolist() for d in read_documents(str(directory))]


def test_jsonl_zst_and_parquet_give_the_shards_plain_jsonl_gives(documents, tokenizer, tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents), encoding="utf-8")
    write_pile(tmp_path / "pile.jsonl.zst", documents[:70])
    write_fineweb(tmp_path / "fineweb.parquet", [*documents[70:], ""])  # an empty row is skipped, as in .jsonl
    reference = make_text_shards([str(plain)], tokenizer.path, str(tmp_path / "reference"), docs_per_shard=40)
    mixed = make_text_shards([str(tmp_path / "pile.jsonl.zst"), str(tmp_path / "fineweb.parquet")],
                             tokenizer.path, str(tmp_path / "mixed"), docs_per_shard=40, workers=2)
    assert mixed["documents"] == len(documents) and mixed["files"] == reference["files"]  # same sha256 per shard
    assert shard_tokens(tmp_path / "mixed")[69] == tokenizer.encode(documents[69]) + [tokenizer.eos_id]


def test_a_parquet_file_without_a_text_column_is_refused_naming_it(tokenizer, tmp_path):
    pq.write_table(pa.table({"content": ["a b c"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other\.parquet: expected a string column 'text' \(columns: content\)"):
        make_text_shards([str(tmp_path / "other.parquet")], tokenizer.path, str(tmp_path / "out"))


@pytest.mark.parametrize(("module", "name"), [("zstandard", "pile.jsonl.zst"), ("pyarrow.parquet", "x.parquet")])
def test_a_missing_extra_is_named_before_anything_is_written(documents, tokenizer, tmp_path, monkeypatch,
                                                            module, name):
    (write_pile if name.endswith(".zst") else write_fineweb)(tmp_path / name, documents[:5])
    monkeypatch.setitem(sys.modules, module, None)  # what a venv without the extra imports
    with pytest.raises(ImportError, match=rf"{name}' needs the {module.split('.')[0]} package: "
                                          r"pip install -e \.\[formats\]"):
        make_text_shards([str(tmp_path / name)], tokenizer.path, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
