"""Training with each row split across ranks equals training on whole rows: real DeepSpeed runs on gloo ranks.

A hybrid LM (a linear layer and a softmax layer, so both the state exchange and Ulysses run; Gated DeltaNet's 3:1
hybrid; KDA and RWKV-7 with softmax) trains for a few
steps of two accumulated micro-batches. With ``parallel.sequence_parallel=2`` on 2 ranks the pair reads the rows
one rank reads alone, so the global batch is the same: losses, gradient norms, validation losses and final weights
must match one rank's to 1e-5 (fp32; the sums run in another order), under ZeRO 0, 2 and 3 (with activation
checkpointing, which replays the forward's collectives in backward). Then data × sequence parallel on 4 ranks against
data parallel on 2, an exact resume of a sequence-parallel run, and a mamba2 LM (a decayed state and a convolution
halo crossing ranks) split over 2 ranks against one.
"""
import shutil

import pytest
import torch

from pretrain.train import checkpoint

from launching import launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS = 4


LAYERS = {"hybrid": {"model__layer_pattern": "[linear,softmax]"},
          # the same model with its feed-forwards over slices of 16 tokens (model.mini_sequence): trains the same
          "hybrid_sliced": {"model__layer_pattern": "[linear,softmax]", "model__mini_sequence": 16},
          "mamba2": {"model__layer_pattern": "[mamba2]", "model__mixer_options__mamba2__chunk_size": 16,
                     "model__mixer_options__mamba2__state_size": 16},
          # Gated DeltaNet's 3:1 hybrid: the delta rule's state maps and its short convolutions' edges cross ranks
          "gdn_hybrid": {"model__layer_pattern": "[gated_deltanet,gated_deltanet,gated_deltanet,softmax]",
                         "model__n_layers": 4, "model__mixer_options__gated_deltanet__chunk_size": 16},
          # the diagonal-plus-low-rank mixers in a hybrid: KDA's per-channel transitions and RWKV-7's (its token
          # shift's last input too) as maps across ranks
          "dplr_hybrid": {"model__layer_pattern": "[kda,rwkv7,kda,softmax]", "model__n_layers": 4,
                          "model__mixer_options__kda__chunk_size": 16, "model__mixer_options__rwkv7__chunk_size": 16}}


def overrides(lm_data, run_dir, *, stage=0, sp=1, layers="hybrid", **extra):
    return tiny_overrides(lm_data, run_dir, deepspeed__zero_stage=stage, parallel__sequence_parallel=sp,
                          **LAYERS[layers], model__mixer_options__linear__chunk_size=16,
                          train__seq_len=96, train__grad_accum_steps=2, train__max_steps=STEPS,
                          schedule__warmup_steps=1, log__val_every=2, log__val_batches=4,
                          checkpoint__every=2, optim__eps=1e-6, **extra)
# optim.eps: Adam divides each coordinate's step by its own gradient scale, so with the default 1e-8 a coordinate
# whose gradient is round-off (~1e-8) takes a step of up to lr whose sign another summation order may flip (seen:
# 3e-5 on 7 of 12288 weights). 1e-6 damps those, so equal gradients show as equal weights; a wrong gradient scale,
# which Adam would hide, shows in train/grad_norm, compared before the optimizer.


@pytest.fixture(scope="module")
def runs(lm_data, tmp_path_factory):
    """``runs(ranks, sp, stage, layers)``: the directory of a finished run (each launched once)."""
    root, done = tmp_path_factory.mktemp("sp_runs"), {}

    def get(ranks: int, sp: int, stage: int = 0, layers: str = "hybrid"):
        key = (ranks, sp, stage, layers)
        if key not in done:
            run = root / f"r{ranks}_sp{sp}_z{stage}_{layers}"
            recompute = {"deepspeed__activation_checkpointing": "true"} if stage == 3 else {}  # collectives replayed
            launch(overrides(lm_data, run, stage=stage, sp=sp, layers=layers, **recompute), ranks=ranks)
            done[key] = run
        return done[key]

    return get


def assert_same_training(run, reference, stage, ref_stage=0):
    got, want = read_metrics(run), read_metrics(reference)
    for step in range(1, STEPS + 1):
        for key in ("train/loss", "train/grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
        if "val/loss" in want[step]:
            assert got[step]["val/loss"] == pytest.approx(want[step]["val/loss"], rel=1e-5), step
    assert got[STEPS]["train/tokens_seen"] == want[STEPS]["train/tokens_seen"]
    tag = checkpoint.tag_for(STEPS)
    weights = checkpoint.load_model_weights(run / "checkpoints", tag, zero_stage=stage)
    expected = checkpoint.load_model_weights(reference / "checkpoints", tag, zero_stage=ref_stage)
    for name, tensor in expected.items():
        error = torch.linalg.vector_norm(weights[name] - tensor) / torch.linalg.vector_norm(tensor)
        assert error < 1e-5, (name, float(error))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_sequence_ranks_train_as_one_rank(runs, stage):
    assert_same_training(runs(2, 2, stage), runs(1, 1), stage)


def test_a_mamba2_lm_on_two_sequence_ranks_trains_as_one_rank(runs):
    assert_same_training(runs(2, 2, layers="mamba2"), runs(1, 1, layers="mamba2"), 0)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_gated_deltanet_hybrid_on_two_sequence_ranks_trains_as_one_rank(runs, stage):
    """The delta rule's state maps and convolution edges cross the slice boundary of 48 tokens."""
    assert_same_training(runs(2, 2, stage, layers="gdn_hybrid"), runs(1, 1, layers="gdn_hybrid"), stage)


def test_the_dplr_hybrid_on_two_sequence_ranks_trains_as_one_rank(runs):
    """KDA's and RWKV-7's diagonal-plus-low-rank state maps, convolution edges and RWKV-7's token shift cross the
    slice boundary, at ZeRO 2."""
    assert_same_training(runs(2, 2, 2, layers="dplr_hybrid"), runs(1, 1, layers="dplr_hybrid"), 2)


def test_mini_sequence_blocks_on_two_sequence_ranks_at_zero_3_train_as_one_rank(runs):
    """Sliced feed-forwards inside DeepSpeed's activation checkpointing, on 48-token slices of the rows."""
    assert_same_training(runs(2, 2, 3, layers="hybrid_sliced"), runs(1, 1), 3)


def test_data_and_sequence_parallel_on_four_ranks_train_as_data_parallel_on_two(runs):
    assert_same_training(runs(4, 2), runs(2, 1), 0)


def test_a_sequence_parallel_run_resumes_exactly(runs, lm_data, tmp_path):
    finished = runs(2, 2, 2)
    run = tmp_path / "resumed"
    shutil.copytree(finished, run)
    (run / "checkpoints" / "latest").write_text(checkpoint.tag_for(2))
    launch(overrides(lm_data, run, stage=2, sp=2), ranks=2)
    resumed, reference = read_metrics(run), read_metrics(finished)
    for step in range(3, STEPS + 1):
        assert resumed[step]["train/loss"] == reference[step]["train/loss"]
        assert resumed[step]["train/grad_norm"] == reference[step]["train/grad_norm"]


def test_world_size_not_divisible_by_the_sequence_ranks_is_refused(lm_data, tmp_path):
    result = launch(overrides(lm_data, tmp_path / "odd", sp=2), ranks=1, check=False)
    # e.g. a resume on an odd number of ranks: a config error, found once the ranks are known, exits as all do (2)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "config error: parallel.sequence_parallel: 2 must divide the number of ranks (1)" in result.stderr


def test_eval_ppl_split_over_two_sequence_ranks_agrees_with_one_process(runs, lm_data):
    """Rows of 192 tokens, longer than the validation documents, so some rows end in padding that fills a whole
    slice (checked below): such a rank scores nothing and still joins every collective."""
    import json
    import os
    import subprocess

    import numpy as np

    from pretrain.data.shards import expand_shards
    from pretrain.data.text_shards import read_shard_documents
    from pretrain.tasks.lm_scoring import IGNORE, packed_rows

    from launching import PYTHON, REPO

    documents = [doc.tokens for doc in read_shard_documents(expand_shards(lm_data["val_shards"]))]
    rows = list(packed_rows(documents, seq_len=192, stride=192, eos_id=3))
    assert any(np.all(targets[96:] == IGNORE) for _, _, targets, _ in rows)

    def eval_ppl(*launcher, extra=()):
        result = subprocess.run([*launcher, "tools/eval_ppl.py", "--run-dir", str(runs(2, 2, 0)), "--data",
                                 lm_data["val_shards"], "--seq-len", "192", "--batch-size", "2", "--json", *extra],
                                cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-4000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    whole = eval_ppl(PYTHON)
    split = eval_ppl(PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     extra=("--sequence-parallel", "2"))
    assert split["sequence_parallel"] == 2 and split["ranks"] == 2
    assert (split["tokens"], split["bytes"], split["words"]) == (whole["tokens"], whole["bytes"], whole["words"])
    assert split["nll"] == pytest.approx(whole["nll"], rel=1e-6)
