"""Fixtures of the training tests: a generated corpus, a real tokenizer and real shards."""
import json
import random

import pytest

from pretrain.data import make_text_shards, train_tokenizer

SUBJECTS = ["the cat", "a dog", "my friend", "the river", "some bird", "our teacher"]
VERBS = ["sees", "likes", "follows", "finds", "draws", "hears"]
OBJECTS = ["the moon", "a stone", "the light", "an apple", "the road", "a song"]


def generated_document(rng: random.Random) -> str:
    """Sentences of a tiny grammar: predictable enough that a 2-layer model's loss visibly falls in 30 steps."""
    lines = []
    for _ in range(rng.randint(2, 12)):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        lines.append(" ".join(words) + rng.choice([".", "!", " today.", " again."]))
    return "\n".join(lines)


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory) -> dict[str, str]:
    """Tokenizer, train/val shards and a held-out text file, built with the data package's own tools."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("lm_data")
    splits = {"train": 600, "val": 24}
    for split, count in splits.items():
        with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(count):
                f.write(json.dumps({"text": generated_document(rng)}) + "\n")
    (root / "held_out.txt").write_text("\n".join(generated_document(rng) for _ in range(8)) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([str(root / "train.jsonl")], 320, str(root / "tok"))
    for split in splits:
        make_text_shards([str(root / f"{split}.jsonl")], tokenizer.path, str(root / split), docs_per_shard=50)
    return {"tokenizer": tokenizer.path,
            "train_shards": str(root / "train" / "shard-{000000..000099}.tar"),
            "val_shards": str(root / "val" / "shard-{000000..000099}.tar"),
            "held_out": str(root / "held_out.txt"),
            "root": str(root)}
