"""Text shards: manifest, byte-identical reruns, and every bad input a clear error naming the file."""
import io
import json
import logging
import os
import sys
import tarfile
from itertools import islice

import numpy as np
import pytest

from pretrain.data import ShardError, TokenLoader, make_text_shards, read_documents
from pretrain.data.shards import iter_members


@pytest.fixture
def shards(corpus, tokenizer, tmp_path):
    paths, _ = corpus
    manifest = make_text_shards(paths, tokenizer.path, str(tmp_path / "shards"), docs_per_shard=64)
    return tmp_path / "shards", manifest


def test_manifest_and_documents_agree_with_the_text(corpus, tokenizer, shards):
    _, texts = corpus
    directory, manifest = shards
    assert manifest == json.loads((directory / "manifest.json").read_text())
    docs = list(read_documents(str(directory)))
    assert manifest["shards"] == 5 and len(manifest["files"]) == 5
    assert manifest["documents"] == len(docs) == len(texts)
    assert manifest["tokens"] == sum(len(d.tokens) for d in docs)
    assert manifest["bytes"] == sum(d.num_bytes for d in docs) == sum(len(t.encode()) for t in texts)
    assert manifest["tokenizer_sha256"] == tokenizer.sha256 and manifest["token_dtype"] == "u16"
    for doc, text in zip(docs, texts, strict=True):
        assert doc.tokens.dtype == np.uint16 and doc.tokens[-1] == tokenizer.eos_id
        assert tokenizer.decode(doc.tokens[:-1]) == text and doc.num_bytes == len(text.encode())
    assert [d.key for d in read_documents(str(directory / "shard-{000001..000002}.tar"))] == \
        [d.key for d in docs[64:192]]


def test_reruns_are_byte_identical_whatever_the_worker_count(corpus, tokenizer, shards, tmp_path):
    paths, _ = corpus
    first, _ = shards
    make_text_shards(paths, tokenizer.path, str(tmp_path / "again"), docs_per_shard=64, workers=2)
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(tmp_path / "again"))
    for name in names:
        assert (first / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_output_directory_with_files_is_refused_and_kept(corpus, tokenizer, shards):
    paths, _ = corpus
    directory, _ = shards
    before = {n: (directory / n).read_bytes() for n in os.listdir(directory)}
    with pytest.raises(FileExistsError, match="not empty"):
        make_text_shards(paths, tokenizer.path, str(directory))
    assert before == {n: (directory / n).read_bytes() for n in os.listdir(directory)}


def test_invalid_utf8_input_names_the_file_and_leaves_no_shards(tokenizer, tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("a paragraph\n\nanother one\n")
    bad.write_bytes(b"fine\n\nbroken \xc3\x28\n")
    with pytest.raises(ValueError, match=r"bad\.txt: line 3"):
        make_text_shards([str(good), str(bad)], tokenizer.path, str(tmp_path / "out"), docs_per_shard=1)
    assert os.listdir(tmp_path / "out") == []


def test_missing_and_empty_patterns(shards, tmp_path):
    directory, _ = shards
    with pytest.raises(ShardError, match="matches no file"):
        TokenLoader(str(tmp_path / "nowhere" / "shard-{000000..000009}.tar"), seq_len=8, batch_size=1)
    with pytest.raises(ShardError, match="empty"):
        TokenLoader("", seq_len=8, batch_size=1)
    with pytest.raises(ShardError, match="manifest.json does not exist"):
        TokenLoader(str(tmp_path), seq_len=8, batch_size=1)
    # a brace range may run past the last shard, but not skip one in the middle
    assert len(list(read_documents(str(directory / "shard-{000000..000099}.tar")))) == 300
    os.remove(directory / "shard-000002.tar")
    with pytest.raises(ShardError, match="shard-000002.tar is missing"):
        TokenLoader(str(directory / "shard-{000000..000004}.tar"), seq_len=8, batch_size=1)
    (directory / "shard-000002.tar").write_bytes(b"")
    with pytest.raises(ShardError, match="shard-000002.tar is empty"):
        TokenLoader(str(directory / "shard-{000000..000004}.tar"), seq_len=8, batch_size=1)


def corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[len(data) // 2:]
    elif how == "payload":  # a token id in the first document
        data[512 + 1] ^= 0x01
    else:  # flip a byte in the name of a member header in the middle (member names are KEY.EXT, KEY 10 digits)
        header = next(o for o in range(len(data) // 1024 * 512, len(data), 512)
                      if data[o:o + 10].isdigit() and data[o + 10] == ord("."))
        data[header + 3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,message", [("truncated", "truncated"), ("header", "checksum mismatch"),
                                         ("payload", "sha256 differs")])
def test_corrupt_shard_is_an_error_naming_it_or_a_counted_skip(shards, caplog, how, message):
    directory, manifest = shards
    corrupt(directory / "shard-000003.tar", how)
    with pytest.raises(ShardError, match=f"shard-000003.tar.*{message}"):
        list(read_documents(str(directory)))
    loader = TokenLoader(str(directory), seq_len=16, batch_size=2, epochs=1)
    with pytest.raises(ShardError, match="shard-000003.tar"):
        list(loader)
    loader = TokenLoader(str(directory), seq_len=16, batch_size=2, epochs=1, skip_corrupt=True)
    with caplog.at_level(logging.WARNING, logger="pretrain.data.loader"):
        batches = list(loader)
    assert loader.skipped_shards == 1 and "shard-000003.tar" in caplog.text
    rows = sum((f["tokens"] - 1) // 16 for f in manifest["files"])  # the layout the manifest gives holds: the
    assert len(batches) == rows // 2                                # corrupt shard's rows are another's


def test_all_shards_corrupt_is_an_error_not_a_hang(shards):
    directory, _ = shards
    for name in os.listdir(directory):
        if name.endswith(".tar"):
            corrupt(directory / name, "header")
    loader = TokenLoader(str(directory), seq_len=16, batch_size=2, skip_corrupt=True)
    with pytest.raises(ShardError, match="no readable document in epoch 0"):
        next(iter(loader))


def test_shards_of_another_tokenizer_are_refused(shards):
    directory, _ = shards
    TokenLoader(str(directory), seq_len=8, batch_size=1, tokenizer_sha256=json.loads(
        (directory / "manifest.json").read_text())["tokenizer_sha256"])
    with pytest.raises(ShardError, match=r"shard-000000\.tar was written with tokenizer sha256"):
        TokenLoader(str(directory), seq_len=8, batch_size=1, tokenizer_sha256="f" * 64)


def test_pipe_urls_only_when_allowed(shards):
    directory, _ = shards
    url = f"pipe:cat {directory}/shard-00000{{0..1}}.tar"
    with pytest.raises(ShardError, match="allow_pipe"):
        TokenLoader(url, seq_len=8, batch_size=1)
    piped = [d.key.split("#")[1] for d in read_documents(url, allow_pipe=True)]
    assert piped == [d.key.split("#")[1] for d in islice(read_documents(str(directory)), 128)]
    sha256 = json.loads((directory / "manifest.json").read_text())["tokenizer_sha256"]
    loader = TokenLoader(url, seq_len=8, batch_size=2, allow_pipe=True, epochs=1, tokenizer_sha256=sha256)
    assert len(list(loader)) > 0
    loader = TokenLoader(url, seq_len=8, batch_size=2, allow_pipe=True, tokenizer_sha256="f" * 64)
    refusal = r"pipe:cat .*shard-00000[01]\.tar was written with tokenizer sha256 " + sha256
    with pytest.raises(ShardError, match=refusal):
        next(iter(loader))
    with pytest.raises(ShardError, match="exited with status"):
        list(read_documents(f"pipe:{sys.executable} -c 'import sys; sys.exit(3)'", allow_pipe=True))


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("compression", ["", "gz"])
def test_tar_reader_agrees_with_tarfile(tmp_path, tar_format, compression):
    rng = np.random.default_rng(0)
    names = ["a/b.txt", "x" * 80 + "/" + "y" * 30 + ".bin", "deep/" * 30 + "z.dat", "ünïcode/ſ.txt", "empty.txt"]
    if tar_format == tarfile.USTAR_FORMAT:
        names = [n for n in names if len(n) < 100 and n.isascii()]
    path = tmp_path / f"t.tar{'.gz' if compression else ''}"
    with tarfile.open(path, f"w:{compression}", format=tar_format) as tar:
        directory = tarfile.TarInfo("a")
        directory.type = tarfile.DIRTYPE
        tar.addfile(directory)
        for name in names:
            data = rng.bytes(int(rng.integers(0, 3000))) if name != "empty.txt" else b""
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    assert list(iter_members(str(path))) == expected


@pytest.mark.parametrize("pattern", ["d/shard-{000000..000123}.tar", "s{1..12}.t", "s{9..10}", "x{05..3}y", "s{0..0}",
                                     "p{7..007}", "{0..010}", "q{10..0}", "a{1,2}{3..4}", "plain.tar", "b{x,y}.tar"])
def test_fast_brace_expansion_agrees_with_braceexpand(pattern):
    from braceexpand import braceexpand

    from pretrain.data.shards import _brace_expand
    assert _brace_expand(pattern) == list(braceexpand(pattern))
