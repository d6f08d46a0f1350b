"""Tokenizer round trip on any UTF-8 text; input formats and document rules of raw text."""
import gzip
import hashlib
import json
import random

import pytest

from pretrain.data import Tokenizer, train_tokenizer
from pretrain.data.text_files import read_text_documents


def random_unicode(rng: random.Random, n: int) -> str:
    """Code points from every plane (no surrogates), with whitespace runs and ▁ over-represented."""
    chars = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.3:
            chars.append(rng.choice([" ", "  ", "\n", "\t", "\r\n", "\u2581", "\x00", "\u3000"]))
        elif kind < 0.6:
            chars.append(chr(rng.randrange(32, 127)))
        else:
            cp = rng.randrange(0x80, 0x110000)
            chars.append(chr(cp) if not 0xD800 <= cp < 0xE000 else "é")
    return "".join(chars)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_any_utf8_round_trips(corpus, tmp_path, model_type):
    paths, texts = corpus
    tok = train_tokenizer(paths, 320, str(tmp_path / "tok"), model_type=model_type)
    assert (tmp_path / "tok.vocab").is_file() and tok.vocab_size == 320
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.sha256 == hashlib.sha256((tmp_path / "tok.model").read_bytes()).hexdigest()
    rng = random.Random(model_type)
    samples = texts[:20] + [random_unicode(rng, rng.randint(0, 80)) for _ in range(200)] + ["", " ", "▁", " ▁ "]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids and tok.bos_id not in ids
    assert tok.encode_batch(samples) == [tok.encode(t) for t in samples]
    assert len(tok.encode(texts[0])) < len(texts[0].encode())  # it learned pieces, not just bytes


def test_training_is_reproducible_wherever_the_model_goes(corpus, tmp_path, tokenizer):
    paths, _ = corpus
    again = train_tokenizer(paths, 400, str(tmp_path / "elsewhere" / "other-name"))
    assert again.sha256 == tokenizer.sha256
    assert (tmp_path / "elsewhere" / "other-name.vocab").read_text().splitlines()[:4] == \
        ["<pad>\t0", "<unk>\t0", "<s>\t0", "</s>\t0"]


def test_sampling_bytes_and_bad_settings(corpus, tmp_path):
    paths, _ = corpus
    tok = train_tokenizer(paths, 320, str(tmp_path / "small"), sample_bytes=5_000)
    assert tok.decode(tok.encode("naïve ▁ 日本")) == "naïve ▁ 日本"
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(paths, 200, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(paths, 300, str(tmp_path / "x"), model_type="wordpiece")
    with pytest.raises(FileNotFoundError, match="missing.model"):
        Tokenizer(str(tmp_path / "missing.model"))


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\nstill fine\nbroken \xff\xfe here\n")
    with pytest.raises(ValueError, match=r"bad\.txt: line 3: invalid UTF-8 at byte 7"):
        list(read_text_documents([str(path)]))
    with pytest.raises(ValueError, match=r"bad\.txt: line 3"):
        train_tokenizer([str(path)], 300, str(tmp_path / "tok"))


WIKITEXT = """ 
 = Valkyria Chronicles III = 
 
 Senjō no Valkyria 3 is a tactical role @-@ playing game . 
 
 = = Gameplay = = 
 
 The game 's battle system = not a heading = 
 Key : Pld 
 = Played , W = 
 Wins , L 
 
 = Tower Building of the Little Rock Arsenal = 
 
 The Tower Building is a structure . 
 = = = Later use = = = 
 It served as a museum . 
"""


def test_txt_document_rules(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(WIKITEXT, encoding="utf-8")
    articles = list(read_text_documents([str(path)], txt_docs="wikitext"))
    assert len(articles) == 2
    assert articles[0].startswith(" = Valkyria Chronicles III = \n") and "= = Gameplay = =" in articles[0]
    assert articles[0].endswith(" = Played , W = \n Wins , L ")  # a table line is no heading
    assert articles[1].startswith(" = Tower Building") and articles[1].endswith("museum . ")
    paragraphs = list(read_text_documents([str(path)]))
    assert len(paragraphs) == 6 and "= Played" in paragraphs[3]
    assert paragraphs[-1] == " The Tower Building is a structure . \n = = = Later use = = = \n It served as a museum . "
    whole = list(read_text_documents([str(path)], txt_docs="file"))
    assert whole == [WIKITEXT[len(" \n"):-1]]
    with pytest.raises(ValueError, match="txt_docs"):
        list(read_text_documents([str(path)], txt_docs="sentences"))


def test_jsonl_and_gzip_inputs(tmp_path):
    records = [{"text": "one\n\ntwo"}, {"text": ""}, {"text": "three", "id": 3}]
    plain = tmp_path / "d.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(plain.read_text())
    with gzip.open(tmp_path / "t.txt.gz", "wt") as f:
        f.write("a\nb\n\nc\n")
    docs = list(read_text_documents([str(plain), str(tmp_path / "d.jsonl.gz"), str(tmp_path / "t.txt.gz")]))
    assert docs == ["one\n\ntwo", "three"] * 2 + ["a\nb", "c"]
    (tmp_path / "e.jsonl").write_text('{"text": "ok"}\n{"txt": "typo"}\n')
    with pytest.raises(ValueError, match=r"e\.jsonl: line 2: .*'text'"):
        list(read_text_documents([str(tmp_path / "e.jsonl")]))
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "half a pair \\ud83d here"}\n')
    with pytest.raises(ValueError, match=r"s\.jsonl: line 2: 'text' is not valid Unicode"):
        list(read_text_documents([str(tmp_path / "s.jsonl")]))


def test_wikitext_2_has_the_published_article_counts(shared_data):
    counts = [sum(1 for _ in read_text_documents([str(shared_data / "text" / "wikitext-2" / f"{split}.txt")],
                                                 txt_docs="wikitext")) for split in ("train", "valid", "test")]
    assert counts == [600, 60, 60]


def test_real_text_round_trips(shared_data, tmp_path):
    path = shared_data / "text" / "tinyshakespeare.txt"
    tok = train_tokenizer([str(path)], 2000, str(tmp_path / "shakespeare"), sample_bytes=300_000)
    text = path.read_text(encoding="utf-8")[:200_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2.5
