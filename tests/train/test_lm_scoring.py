"""The shared scoring of documents: every token once, enough context, and packing that changes nothing."""
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.data.shards import ShardError
from pretrain.distributed.process_group import World
from pretrain.models import build_lm
from pretrain.tasks.config_checks import load_run_config
from pretrain.tasks.lm import LMTask
from pretrain.tasks.lm_scoring import (
    IGNORE,
    POSITION_BUCKETS,
    batch_nll,
    document_windows,
    position_bucket,
    score_documents,
)

EOS = 3


@pytest.mark.parametrize("seq_len,stride", [(8, 8), (8, 3), (7, 1), (16, 5), (5, 5)])
def test_windows_score_every_token_once_with_enough_context(seq_len, stride):
    rng = np.random.default_rng(seq_len * 10 + stride)
    for n in [1, 2, seq_len - 1, seq_len, seq_len + 1, 3 * seq_len + 2, int(rng.integers(1, 80))]:
        tokens = rng.integers(4, 100, size=n)
        stream = np.concatenate([[EOS], tokens])
        scored, start = [], 0
        windows = document_windows(tokens, seq_len=seq_len, stride=stride, eos_id=EOS)
        for inputs, positions, targets, target_positions in windows:
            assert len(inputs) == len(positions) == len(targets) == len(target_positions) <= seq_len
            assert (target_positions == np.arange(start, start + len(inputs))).all()  # stream index − 1
            assert (inputs == stream[start:start + len(inputs)]).all()
            for j in np.flatnonzero(targets != IGNORE):
                i = start + j + 1  # stream index of the target
                assert targets[j] == stream[i]
                assert j + 1 >= min(i, seq_len - stride + 1)  # context length
                scored.append(i)
            if start == 0:  # the lone eos, then the document from position 0
                assert positions.tolist() == [0] + list(range(len(inputs) - 1))
            else:
                assert positions.tolist() == list(range(len(inputs)))
            start += stride
        assert scored == list(range(1, n + 1))


def test_stride_must_fit_the_window():
    with pytest.raises(ValueError, match="stride"):
        next(document_windows(np.arange(4, 10), seq_len=4, stride=5, eos_id=EOS))


@pytest.mark.parametrize("stride", [32, 11])
def test_packed_batches_score_like_each_window_alone(stride):
    """Windows share rows as separate segments; the total must equal scoring each window in a row of its own."""
    torch.manual_seed(0)
    model = build_lm(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2)).eval()
    rng = np.random.default_rng(stride)
    docs = [rng.integers(4, 50, size=int(n)) for n in rng.integers(1, 90, size=12)]
    scores = score_documents(model, docs, seq_len=32, stride=stride, batch_size=3, eos_id=EOS,
                             device=torch.device("cpu"))
    nll, tokens = scores.nll, scores.tokens
    expected_nll, expected_tokens = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            for inputs, positions, targets, _ in document_windows(doc, seq_len=32, stride=stride, eos_id=EOS):
                row = {name: torch.from_numpy(a).long()[None] for name, a in
                       (("input_ids", inputs), ("position_ids", positions), ("labels", targets))}
                window_nll, window_tokens = batch_nll(model, row, torch.device("cpu"))
                expected_nll += window_nll.item()
                expected_tokens += window_tokens
    assert tokens == expected_tokens == sum(len(d) for d in docs)
    assert nll == pytest.approx(expected_nll, rel=1e-5)


@pytest.mark.parametrize("stride", [32, 11])
def test_loss_by_position_holds_every_token_once_in_its_bucket(stride):
    """Each scored token's own NLL (from the full logits of its window alone) lands in the bucket of its document
    position; the buckets add up to the totals."""
    torch.manual_seed(0)
    model = build_lm(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2)).double().eval()
    rng = np.random.default_rng(stride)
    docs = [rng.integers(4, 50, size=int(n)) for n in rng.integers(1, 90, size=12)]
    scores = score_documents(model, docs, seq_len=32, stride=stride, batch_size=3, eos_id=EOS,
                             device=torch.device("cpu"), by_position=True)
    expected = torch.zeros(POSITION_BUCKETS, 2, dtype=torch.float64)
    with torch.no_grad():
        for doc in docs:
            for window, (inputs, positions, targets, _) in enumerate(
                    document_windows(doc, seq_len=32, stride=stride, eos_id=EOS)):
                logits = model(torch.from_numpy(inputs)[None], position_ids=torch.from_numpy(positions)[None])[0]
                token_nll = F.cross_entropy(logits, torch.from_numpy(targets), ignore_index=IGNORE, reduction="none")
                for j in np.flatnonzero(targets != IGNORE):  # target j of the window starting at window · stride
                    bucket = int(window * stride + j).bit_length()
                    expected[bucket, 0] += token_nll[j].item()
                    expected[bucket, 1] += 1
    assert scores.by_position[:, 1].sum() == scores.tokens == sum(len(d) for d in docs)
    assert scores.by_position[:, 0].sum().item() == pytest.approx(scores.nll, rel=1e-9)
    torch.testing.assert_close(scores.by_position, expected, rtol=1e-9, atol=1e-9)


def test_position_buckets_double():
    edges = torch.tensor([0] + [p for k in range(1, 47) for p in (2 ** k - 1, 2 ** k)])
    assert position_bucket(edges).tolist() == [int(p).bit_length() for p in edges.tolist()]


def test_trainer_validation_refuses_a_damaged_shard_naming_it(lm_data, tmp_path):
    """Validation reads the shards as eval_ppl does: each checked against the sha256 its manifest records."""
    val = tmp_path / "val"
    shutil.copytree(lm_data["root"] + "/val", val)
    damaged = sorted(val.glob("*.tar"))[0]
    data = bytearray(damaged.read_bytes())
    data[512 + 1] ^= 0x01  # a token of the first document: the tar still parses
    damaged.write_bytes(bytes(data))
    cfg = load_run_config("configs/tiny_lm.yaml", [f"data.tokenizer={lm_data['tokenizer']}",
                                               f"data.train_shards={lm_data['train_shards']}",
                                               f"data.val_shards={val}", "data.num_workers=0"])
    task = LMTask(cfg, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    with pytest.raises(ShardError, match=f"{damaged.name} is corrupt"):
        task.validate(task.build_model().eval(), torch.device("cpu"))


def test_trainer_refuses_validation_shards_of_another_tokenizer_at_its_start(lm_data, tmp_path):
    """As the training shards: at the task's start (not at the first validation, hours later), in one line naming
    the shard and both sha256."""
    from pretrain.config import ConfigError
    from pretrain.data import Tokenizer, make_text_shards, train_tokenizer

    other = train_tokenizer([f"{lm_data['root']}/train.jsonl"], 300, str(tmp_path / "other"))
    make_text_shards([f"{lm_data['root']}/val.jsonl"], other.path, str(tmp_path / "val"), docs_per_shard=50)
    cfg = load_run_config("configs/tiny_lm.yaml", [f"data.tokenizer={lm_data['tokenizer']}",
                                               f"data.train_shards={lm_data['train_shards']}",
                                               f"data.val_shards={tmp_path / 'val'}", "data.num_workers=0"])
    with pytest.raises(ConfigError) as refused:
        LMTask(cfg, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    said = str(refused.value)
    assert said.startswith(f"data.val_shards: shard {tmp_path / 'val' / 'shard-000000.tar'} was written with "
                           f"tokenizer sha256 {other.sha256} "), said
    assert said.endswith(f"but this run's tokenizer is {Tokenizer(lm_data['tokenizer']).sha256}"), said
