"""MQAR rows (pretrain.data.mqar) and their scoring (pretrain.tasks.recall): answers checked by brute force, the
stream fixed by seed, shared by the replicas and resumed exactly (on any number of them), a copying model at 100 %
and a random one at chance."""
import numpy as np
import pytest
import torch

from pretrain.config import ConfigError
from pretrain.data.mqar import IGNORE, MQARLoader, MQARSettingError, check_mixture, check_mqar, mqar_rows
from pretrain.tasks.config_checks import load_run_config
from pretrain.tasks.recall import recall_scores

SETTINGS = [dict(vocab_size=64, seq_len=32, num_pairs=8, query_power=0.01),
            dict(vocab_size=256, seq_len=100, num_pairs=4, query_power=1.0),
            dict(vocab_size=8192, seq_len=256, num_pairs=64, query_power=0.01)]


def brute_force_answer(row: np.ndarray, position: int, num_pairs: int) -> int:
    """The value stored with the key at ``position``: the token after its one occurrence among the pairs."""
    found = [i for i in range(0, 2 * num_pairs, 2) if row[i] == row[position]]
    assert len(found) == 1, f"key {row[position]} occurs {len(found)} times among the pairs"
    return int(row[found[0] + 1])


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"V{s['vocab_size']}-T{s['seq_len']}-N{s['num_pairs']}")
def test_every_answer_is_the_value_stored_with_its_key(setting):
    inputs, labels = mqar_rows(np.random.default_rng(3), 16, **setting)
    n, half = setting["num_pairs"], setting["vocab_size"] // 2
    assert inputs.shape == labels.shape == (16, setting["seq_len"])
    for row, target in zip(inputs, labels):
        keys, values = row[0:2 * n:2], row[1:2 * n:2]
        assert len(set(keys)) == n and len(set(values)) == n
        assert ((1 <= keys) & (keys < half)).all() and ((half <= values) & (values < setting["vocab_size"])).all()
        queried = np.nonzero(target != IGNORE)[0]
        assert len(queried) == n and (queried >= 2 * n).all() and ((queried - 2 * n) % 2 == 0).all()
        assert sorted(row[queried]) == sorted(keys)  # every key asked once
        for position in queried:
            assert target[position] == brute_force_answer(row, position, n)
        assert ((0 <= row) & (row < setting["vocab_size"])).all()


def test_a_small_query_power_asks_soon_after_the_pairs():
    def share_in_first_quarter(power):
        _, labels = mqar_rows(np.random.default_rng(0), 500, vocab_size=256, seq_len=256, num_pairs=16,
                              query_power=power)
        gaps = (np.nonzero(labels != IGNORE)[1] - 32) // 2  # 112 query slots after the 16 pairs
        return (gaps < 28).mean()

    assert share_in_first_quarter(0.01) > 0.55  # Zoology's power: most queries come early
    assert 0.22 < share_in_first_quarter(1.0) < 0.28  # power 1: evenly spread


def test_the_stream_is_fixed_by_seed_shared_by_replicas_and_resumes_exactly():
    def loader(**kw):
        return MQARLoader(**{**dict(vocab_size=128, seq_len=64, num_pairs=8, batch_size=4, rank=1, world_size=2,
                                    seed=7), **kw})

    first = loader()
    stream = iter(first)
    seen = [next(stream) for _ in range(3)]
    state = first.state_dict()
    rest = [next(stream) for _ in range(2)]

    resumed = loader()
    resumed.load_state_dict(state)
    again = iter(resumed)
    for expected in rest:
        got = next(again)
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(got[key], expected[key])
    assert torch.equal(next(iter(loader()))["input_ids"], seen[0]["input_ids"])  # same seed and rank: same rows
    alone = loader(rank=0, world_size=1)  # the one stream; replica 1 of 2 takes its batches 1, 3, 5, ...
    assert all(torch.equal(alone.batch(2 * k + 1)["input_ids"], seen[k]["input_ids"]) for k in range(3))
    on_three = [loader(rank=r, world_size=3) for r in range(3)]  # resumed on 3 replicas: batches 6, 7, 8 of it
    for r, replica in enumerate(on_three):
        replica.load_state_dict(state)
        assert torch.equal(next(iter(replica))["input_ids"], alone.batch(6 + r)["input_ids"])
    assert not torch.equal(next(iter(loader(seed=8)))["input_ids"], seen[0]["input_ids"])
    assert not torch.equal(loader(split="val").batch(0)["input_ids"], seen[0]["input_ids"])
    assert seen[0]["position_ids"][2].tolist() == list(range(64))  # one sequence per row

    with pytest.raises(ValueError, match="'seed' is 7, but this loader has 8"):
        loader(seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="'num_pairs'"):
        loader(num_pairs=4).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 1's of 2, written before the ranks shared one stream"):
        loader().load_state_dict({**state, "rank": 1, "world_size": 2})


def test_impossible_settings_name_the_key():
    with pytest.raises(MQARSettingError, match="seq_len: 60 .* at least 4·num_pairs = 64"):
        check_mqar(vocab_size=256, seq_len=60, num_pairs=16, query_power=0.01)
    with pytest.raises(ConfigError, match="^train.seq_len: "):
        load_run_config("configs/recall/softmax.yaml", ["recall.num_pairs=16", "train.seq_len=60"])
    with pytest.raises(ConfigError, match="^recall.vocab_size: 32 gives 15 keys"):
        load_run_config("configs/recall/softmax.yaml", ["recall.vocab_size=32", "recall.num_pairs=16"])
    with pytest.raises(ConfigError, match="^recall.query_power: "):
        load_run_config("configs/recall/softmax.yaml", ["recall.query_power=0"])
    with pytest.raises(ConfigError, match="^model.vocab_size: 100 is smaller than recall.vocab_size 256"):
        load_run_config("configs/recall/softmax.yaml", ["model.vocab_size=100", "recall.vocab_size=256"])
    with pytest.raises(ConfigError, match="^parallel.sequence_parallel: .*task recall trains whole rows"):
        load_run_config("configs/recall/softmax.yaml", ["parallel.sequence_parallel=2"])
    cfg = load_run_config("configs/recall/softmax.yaml", [])
    assert cfg.model.vocab_size == cfg.recall.vocab_size and cfg.data.tokenizer is None


ZOOLOGY_MIXTURE = [(64, 4), (128, 8), (256, 16)]


def test_a_mixture_packs_whole_examples_of_one_setting_per_row():
    loader = MQARLoader(vocab_size=8192, seq_len=256, batch_size=48, mixture=ZOOLOGY_MIXTURE, seed=2)
    batch = loader.batch(0)
    inputs, labels, positions = (batch[key].numpy() for key in ("input_ids", "labels", "position_ids"))
    assert inputs.shape == labels.shape == positions.shape == (48, 256)
    seen = set()
    for row, target, position in zip(inputs, labels, positions):
        length = int(np.argmax(position[1:] == 0) + 1) if (position[1:] == 0).any() else 256
        setting = next(s for s in ZOOLOGY_MIXTURE if s[0] == length)
        seen.add(setting)
        assert (position == np.tile(np.arange(length), 256 // length)).all()  # each example its own document
        for start in range(0, 256, length):  # every answer is the value stored with its key, inside its example
            example, answers = row[start:start + length], target[start:start + length]
            queried = np.nonzero(answers != IGNORE)[0]
            assert len(queried) == setting[1]
            for at in queried:
                assert answers[at] == brute_force_answer(example, at, setting[1])
    assert seen == set(ZOOLOGY_MIXTURE)  # 48 rows draw every setting
    again = MQARLoader(vocab_size=8192, seq_len=256, batch_size=48, mixture=ZOOLOGY_MIXTURE, seed=2).batch(0)
    assert all(torch.equal(again[key], batch[key]) for key in batch)


def test_a_mixture_stream_resumes_and_refuses_another_mixture():
    first = MQARLoader(vocab_size=64, seq_len=32, batch_size=4, mixture=[(16, 2), (32, 4)], seed=1)
    stream = iter(first)
    next(stream)
    state = first.state_dict()
    expected = next(stream)
    resumed = MQARLoader(vocab_size=64, seq_len=32, batch_size=4, mixture=[(16, 2), (32, 4)], seed=1)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], expected["input_ids"])
    with pytest.raises(ValueError, match="'mixture'"):
        MQARLoader(vocab_size=64, seq_len=32, batch_size=4, mixture=[(32, 4)], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks key 'num_pairs'"):
        MQARLoader(vocab_size=64, seq_len=32, batch_size=4, num_pairs=4, seed=1).load_state_dict(state)


def test_impossible_mixtures_name_the_entry():
    with pytest.raises(MQARSettingError, match=r"^mixture\[1\].seq_len: 96 does not divide the rows of 256"):
        check_mixture(vocab_size=8192, seq_len=256, mixture=[(64, 4), (96, 8)], query_power=0.01)
    with pytest.raises(MQARSettingError, match=r"^mixture\[0\].seq_len: 64 holds the 32 pairs"):
        check_mixture(vocab_size=8192, seq_len=256, mixture=[(64, 32)], query_power=0.01)
    with pytest.raises(ConfigError, match=r"^recall.mixture\[1\].seq_len: 48 does not divide"):
        load_run_config("configs/recall/softmax.yaml",
                        ["recall.mixture=[{seq_len: 32, num_pairs: 4}, {seq_len: 48, num_pairs: 4}]"])
    with pytest.raises(ConfigError, match=r"^recall.mixture\[0\]: expected \{seq_len: T, num_pairs: N\}"):
        load_run_config("configs/recall/softmax.yaml", ["recall.mixture=[{seq_len: 32}]"])
    with pytest.raises(ConfigError, match=r"^recall.vocab_size: 32 gives 15 keys"):
        load_run_config("configs/recall/softmax.yaml", ["recall.vocab_size=32",
                                                        "recall.mixture=[{seq_len: 64, num_pairs: 16}]"])


class CopyingModel:
    """Brute-force recall: at every position, the logits put 1 on the token that followed the current token's
    first occurrence among the pairs (the first ``2·num_pairs`` tokens), 0 elsewhere."""

    def __init__(self, vocab_size, num_pairs):
        self.vocab_size, self.num_pairs = vocab_size, num_pairs

    def __call__(self, input_ids, position_ids=None):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for b, row in enumerate(input_ids.tolist()):
            stored = {}
            for i in range(0, 2 * self.num_pairs, 2):
                stored.setdefault(row[i], row[i + 1])
            for t, token in enumerate(row):
                if token in stored:
                    logits[b, t, stored[token]] = 1.0
        return logits


def test_a_copying_model_recalls_everything_and_a_random_one_is_at_chance():
    loader = MQARLoader(vocab_size=64, seq_len=64, num_pairs=8, batch_size=32, seed=1)
    batches = [loader.batch(i) for i in range(16)]  # 16·32·8 = 4096 answers
    correct, answers, nll = recall_scores(CopyingModel(64, 8), batches, torch.device("cpu")).tolist()
    assert answers == 4096 and correct == answers

    generator = torch.Generator().manual_seed(0)

    def random_model(input_ids, position_ids=None):
        return torch.randn(*input_ids.shape, 64, generator=generator)

    correct, answers, nll = recall_scores(random_model, batches, torch.device("cpu")).tolist()
    chance, spread = 1 / 64, 4 * (1 / 64 * 63 / 64 / answers) ** 0.5  # 4 standard deviations of the binomial
    assert abs(correct / answers - chance) < spread
    assert nll / answers > np.log(64)  # random logits are worse than uniform ones


@pytest.mark.parametrize("override, key", [("recall.num_pair=4", "recall.num_pair: unknown key"),
                                           ("recall.vocab_size=16", "recall.vocab_size: 16 gives 7 keys"),
                                           ("recall.num_pairs=20", "train.seq_len: 64 holds the 20 pairs")])
def test_the_launcher_refuses_a_bad_recall_key_naming_it(tmp_path, override, key):
    """launch/pretrain.py loads through load_run_config, so check_recall_config runs before any work: one line, exit
    2, no run directory."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/recall/softmax.yaml",
                             f"run.dir={run_dir}", override], cwd=repo, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"config error: {key}"), result.stderr
    assert not run_dir.exists()
