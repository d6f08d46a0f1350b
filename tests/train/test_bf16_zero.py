"""bf16 training under DeepSpeed ZeRO 2 and 3 with linear-attention layers (issue 7, item 3), on 2 gloo ranks.

The model is a hybrid: linear, cosine and inline layers (linear attention, ``impl=chunk``), an AFT-local layer
(the causal chunked AFT, 16-token chunks) and a softmax layer.
Under ``deepspeed.precision=bf16`` DeepSpeed casts the module to bf16 and keeps fp32 master weights in its ZeRO
optimizer, so the ops see bf16 q, k, v and must hand back bf16 gradients computed with fp32 sums.

Three launches: ZeRO-2 for all steps, and ZeRO-3 stopped half-way and relaunched on its own run directory.
No clipping and a constant learning rate after warmup, so stopping by ``train.max_steps`` changes nothing else
(with cosine, the schedule itself depends on ``max_steps``).
"""
import math

import pytest
import torch

from pretrain.train import checkpoint

from launching import launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS, CUT = 12, 6
LINEAR_MIXERS = ("linear", "cosine", "inline")


def bf16_overrides(lm_data, run_dir, stage, steps, impl="chunk"):
    linear_impl = {f"model__mixer_options__{name}__impl": impl for name in LINEAR_MIXERS}
    return tiny_overrides(lm_data, run_dir, deepspeed__zero_stage=stage, deepspeed__precision="bf16",
                          model__n_layers=5, model__layer_pattern="[" + ",".join(LINEAR_MIXERS) + ",aft_local,softmax]",
                          model__mixer_options__aft_local__window=8, model__mixer_options__aft_local__chunk_size=16,
                          train__max_steps=steps, train__grad_clip=0.0, schedule__name="constant",
                          checkpoint__every=CUT, log__val_every=CUT, log__val_batches=4, **linear_impl)


@pytest.fixture(scope="module")
def runs(lm_data, tmp_path_factory):
    """``{2: run_dir, 3: run_dir}``: ZeRO-2 uninterrupted; ZeRO-3 run to step CUT, then relaunched to STEPS."""
    root = tmp_path_factory.mktemp("bf16")
    launch(bf16_overrides(lm_data, root / "zero2", 2, STEPS), ranks=2)
    launch(bf16_overrides(lm_data, root / "zero3", 3, CUT), ranks=2)
    resumed = launch(bf16_overrides(lm_data, root / "zero3", 3, STEPS), ranks=2)
    assert f"resumed from {root / 'zero3' / 'checkpoints' / checkpoint.tag_for(CUT)}" in resumed.stdout, \
        resumed.stdout[-3000:]
    return {2: root / "zero2", 3: root / "zero3"}


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_losses_fall_and_grad_norms_stay_finite(runs, stage):
    metrics = read_metrics(runs[stage])
    assert sorted(metrics) == list(range(1, STEPS + 1))
    curve = [metrics[step]["train/loss"] for step in range(1, STEPS + 1)]
    norms = [metrics[step]["train/grad_norm"] for step in range(1, STEPS + 1)]
    assert all(math.isfinite(x) for x in curve + norms), (curve, norms)
    assert all(norm > 0 for norm in norms), norms
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.5, curve
    assert metrics[STEPS]["val/loss"] < metrics[CUT]["val/loss"]


def test_zero3_resumed_follows_zero2_step_for_step(runs):
    """Both stages do the same arithmetic per element: each rank's bf16 forward and backward on its own batch, a
    2-rank gradient average (a + b halved: exact whichever way round), AdamW on the fp32 masters, bf16 copies. Only
    the logged gradient norm differs, by a few fp32 ulps: each stage sums its squares over other partitions.

    With clipping on, that ulp would enter the clipping factor and so the masters, where bf16 rounding amplifies
    it (measured with grad_clip=1: norms 2e-5 apart by step 3, losses 7e-5 apart by step 6). The runs here clip
    nothing, so their losses must be equal bit for bit, the relaunch at step CUT included: it must restore the
    fp32 masters and Adam moments exactly, not rebuild them from the bf16 weights."""
    zero2, zero3 = read_metrics(runs[2]), read_metrics(runs[3])
    for step in range(1, STEPS + 1):
        assert zero3[step]["train/loss"] == zero2[step]["train/loss"], step
        assert zero3[step]["train/grad_norm"] == pytest.approx(zero2[step]["train/grad_norm"], rel=1e-6), step
    assert zero3[STEPS]["val/loss"] == zero2[STEPS]["val/loss"]


def test_checkpoints_hold_fp32_masters_and_bf16_weights(runs):
    """ZeRO-2's model file holds the bf16 weights the ranks compute with; every ZeRO checkpoint holds fp32
    masters (reassembled here from the ranks' optimizer files) of which those weights are the rounding, and the
    masters keep bits that bf16 cannot hold (they are no upcast copy)."""
    tag = checkpoint.tag_for(STEPS)
    masters = {}
    for stage, run in runs.items():
        masters[stage] = checkpoint.load_model_weights(run / "checkpoints", tag, zero_stage=stage)
        assert {t.dtype for t in masters[stage].values()} == {torch.float32}, stage
        moved = [name for name, w in masters[stage].items() if not torch.equal(w.bfloat16().float(), w)]
        assert "layers.0.mixer.q_proj.weight" in moved and "layers.3.mixer.q_proj.weight" in moved, (stage, moved)
        partitions = sorted((run / "checkpoints" / tag).glob("bf16_zero_pp_rank_*_optim_states.pt"))
        assert len(partitions) == 2, partitions
        for path in partitions:
            state = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            flat = state["single_partition_of_fp32_groups" if stage == 2 else "fp32_flat_groups"]
            assert {t.dtype for t in flat} == {torch.float32}, path
    weights = torch.load(runs[2] / "checkpoints" / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                         weights_only=False)["module"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    for name, w in weights.items():
        assert torch.equal(masters[2][name].bfloat16(), w), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_train_under_bf16_zero2_and_zero3(lm_data, tmp_path):
    """The same model with ``impl=triton`` on one GPU (one rank: nccl wants a device per rank). With one rank and
    no clipping the two stages do the same arithmetic, and the kernels use no atomics: equal losses, bit for bit
    (the logged norms sum their squares in another order, as on CPU)."""
    curves = {}
    for stage in (2, 3):
        launch(bf16_overrides(lm_data, tmp_path / f"zero{stage}", stage, STEPS, impl="triton"))
        curves[stage] = read_metrics(tmp_path / f"zero{stage}")
    losses = [curves[2][step]["train/loss"] for step in range(1, STEPS + 1)]
    assert [curves[3][step]["train/loss"] for step in range(1, STEPS + 1)] == losses
    for step in range(1, STEPS + 1):
        norms = [curves[stage][step]["train/grad_norm"] for stage in (2, 3)]
        assert math.isfinite(norms[0]) and norms[1] == pytest.approx(norms[0], rel=1e-6), (step, norms)
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
