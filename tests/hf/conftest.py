"""Fixtures of the transformers tests: a small sentencepiece model and exported directories of tiny random LMs.

The tests need the ``hf`` extra (``pip install -e '.[hf]'``; ``make setup`` installs it): each module skips without
it."""
import random

import pytest

from pretrain.data import train_tokenizer
from pretrain.train.export import write_export

from tiny_lms import random_lm, run_config

WORDS = ["the", "a", "river", "stone", "light", "über", "naïve", "日本", "😀", "x=1;", "42", "▁mark", "\n"]


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> str:
    """A 300-piece sentencepiece model, trained as the project trains them (byte fallback, special ids fixed)."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("hf_tokenizer")
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(300)),
                                     encoding="utf-8")
    return train_tokenizer([str(root / "corpus.txt")], 300, str(root / "tok")).path


@pytest.fixture(scope="session")
def export(tokenizer_model, tmp_path_factory):
    """``export(pattern, **model)``: the directory tools/export.py would write for such an LM (written once)."""
    root, done = tmp_path_factory.mktemp("hf_exports"), {}

    def get(pattern: list[str], **model):
        key = ("+".join(pattern), *sorted(model.items()))
        if key not in done:
            lm, cfg = random_lm(pattern, 300, **model)
            done[key] = root / "-".join(map(str, key))
            write_export(lm, run_config(cfg, tokenizer_model), done[key])
        return done[key]

    return get
