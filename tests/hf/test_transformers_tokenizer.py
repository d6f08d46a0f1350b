"""Issue 27, item 3: ``AutoTokenizer`` on an exported directory gives the ids ``pretrain.data.Tokenizer`` gives, with
the special-token conventions of training (nothing added; ``add_bos_token=True`` puts the ``eos`` a document follows
in front)."""
import pytest

from pretrain.data import Tokenizer, train_tokenizer
from pretrain.data.tokenizer import EOS_ID, PAD_ID
from pretrain.train.export import write_export

from tiny_lms import random_lm, run_config

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
from transformers import AutoTokenizer

AWKWARD = ["the river", " leading space", "tabs\tand\nnew lines\n\n", "über naïve 日本語 😀🦀", "▁mark and ▁▁",
           "literal </s> and <s> and <pad> are text", "", "  ", "ǅ unseen letters ∮ fall back to bytes"]


def test_ids_equal_ours_on_awkward_text(export, tokenizer_model):
    ours, theirs = Tokenizer(tokenizer_model), AutoTokenizer.from_pretrained(export(["linear"]))
    assert type(theirs).__name__ == "PretrainTokenizer"
    expected = [ours.encode(text) for text in AWKWARD]
    assert theirs(AWKWARD).input_ids == expected  # nothing added by default, as training adds nothing
    assert any(any(4 <= i < 260 for i in ids) for ids in expected)  # byte-fallback pieces took part
    assert [theirs.decode(ids) for ids in expected] == AWKWARD


def test_bos_is_the_eos_a_document_follows(export):
    directory = export(["linear"])
    plain = AutoTokenizer.from_pretrained(directory)
    with_bos = AutoTokenizer.from_pretrained(directory, add_bos_token=True)
    assert with_bos.bos_token_id == with_bos.eos_token_id == EOS_ID and with_bos.pad_token_id == PAD_ID
    assert with_bos("the river").input_ids == [EOS_ID] + plain("the river").input_ids
    batch = plain(["the", "the river stone"], padding=True)
    assert batch.input_ids[0][-1] == PAD_ID and batch.attention_mask[0][-1] == 0  # padded on the right


def test_save_pretrained_round_trips(export, tmp_path):
    """``add_bos_token`` is chosen at loading (transformers 5 leaves it out of a saved tokenizer_config.json)."""
    tokenizer = AutoTokenizer.from_pretrained(export(["linear"]))
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(AWKWARD).input_ids == tokenizer(AWKWARD).input_ids
    with_bos = AutoTokenizer.from_pretrained(tmp_path, add_bos_token=True)(AWKWARD).input_ids
    assert with_bos == [[EOS_ID] + ids for ids in tokenizer(AWKWARD).input_ids]


def test_ids_equal_ours_on_every_line_of_wikitext_2_test(shared_data, tmp_path):
    """A tokenizer trained on a sample of the training split meets the test split's rarer characters through byte
    fallback; every line of the test split is compared, through an exported directory as a user loads it."""
    wikitext = shared_data / "text" / "wikitext-2"
    ours = train_tokenizer([str(wikitext / "train.txt")], 1000, str(tmp_path / "wiki"), sample_bytes=300_000)
    lm, cfg = random_lm(["linear"], ours.vocab_size)
    write_export(lm, run_config(cfg, ours.path), tmp_path / "export")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "export")
    lines = (wikitext / "test.txt").read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4359  # 4,358 lines and the empty string after the last newline
    expected = ours.encode_batch(lines)
    assert theirs(lines).input_ids == expected
    assert sum(any(4 <= i < 260 for i in ids) for ids in expected) > 10  # lines that needed byte fallback
