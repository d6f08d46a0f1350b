"""Dry-run numbers: ZeRO's model-state formulas, activations measured on meta against a real CPU forward."""
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pretrain.attention import REGISTRY
from pretrain.config import ConfigError, load_config
from pretrain.estimate import estimate, model_state_bytes
from pretrain.models import build_lm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["data.tokenizer=absent.model", "data.train_shards=x.tar", "model.vocab_size=97", "model.dim=32",
        "model.n_layers=3", "model.n_heads=4", "train.seq_len=24", "train.micro_batch_size=2"]


class GatedShift(nn.Module):
    """A test mixer that runs on meta: a gate times the previous token (saves its input, gate and shift)."""

    supports_causal: ClassVar[bool] = True

    def __init__(self, dim, num_heads, *, causal=True):
        super().__init__()
        self.gate, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, *, cu_seqlens=None, position_ids=None):
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return self.o_proj(torch.sigmoid(self.gate(x)) * shifted)

    def flops_per_token(self, seq_len):
        return 4 * self.gate.in_features**2


class Zero(GatedShift):
    """Saves nothing: the baseline for the approximation test."""

    def forward(self, x, *, cu_seqlens=None, position_ids=None):
        return torch.zeros_like(x)


class DataDependent(GatedShift):
    """Reads a value out of a tensor, as packed-document code does: impossible on the meta device."""

    def forward(self, x, *, cu_seqlens=None, position_ids=None):
        if int(self.gate(x).sum()) > 1e9:
            raise AssertionError
        return super().forward(x)


@pytest.fixture
def test_mixers(monkeypatch):
    for name, cls in [("gated_shift", GatedShift), ("zero", Zero), ("data_dependent", DataDependent)]:
        monkeypatch.setitem(REGISTRY, name, cls)


def tiny(*overrides):
    return load_config(None, [*TINY, *overrides])


@pytest.mark.parametrize("precision, stage, expected", [
    # Ψ = 1000 parameters on N = 4 ranks: (weights, gradients, optimizer states) in bytes, from the ZeRO paper
    ("bf16", 0, (2000, 2000, 12000)),
    ("bf16", 1, (2000, 2000, 3000)),
    ("bf16", 2, (2000, 500, 3000)),
    ("fp16", 3, (500, 500, 3000)),
    ("fp32", 0, (4000, 4000, 8000)),
    ("fp32", 3, (1000, 1000, 2000)),
])
def test_model_states_follow_zero(precision, stage, expected):
    states = model_state_bytes(1000, precision, stage, world_size=4)
    assert (states["weights"], states["gradients"], states["optimizer_states"]) == expected


def test_parameters_and_flops_are_the_real_models():
    cfg = tiny()
    model = build_lm(OmegaConf.to_object(cfg.model))
    result = estimate(cfg, world_size=1)
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["flops_per_token"] == 3 * model.flops_per_token(24)


def saved_bytes_of_a_real_forward(cfg) -> int:
    """What autograd keeps after a real CPU forward and loss: distinct storages, parameters excluded."""
    torch.manual_seed(0)
    model = build_lm(OmegaConf.to_object(cfg.model))
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)  # the training loss: the fused head
    return total


def kept_bytes(result) -> int:
    """The activations kept from forward to backward: the estimate's total less its working sets."""
    parts = result["activation_breakdown_bytes"]
    return sum(parts.values()) - parts["loss_working_set"] - parts["ffn_slice"] - parts["gradients_in_flight"]


@pytest.mark.parametrize("pattern", ["[]", "[gated_shift,softmax]"])
def test_activations_measured_on_meta_equal_a_real_cpu_forward(pattern, test_mixers):
    cfg = tiny(f"model.layer_pattern={pattern}", "model.n_layers=6")
    result = estimate(cfg, 1)
    assert kept_bytes(result) == saved_bytes_of_a_real_forward(cfg)
    assert result["activations_extrapolated_for"] == []


def test_mixers_that_cannot_run_on_meta_are_measured_on_the_cpu_and_named(test_mixers):
    cfg = tiny("model.mixer=data_dependent", "train.seq_len=40")  # not a CPU probe length: extrapolated
    result = estimate(cfg, 1)
    assert result["activations_extrapolated_for"] == ["DataDependent"]
    assert kept_bytes(result) == saved_bytes_of_a_real_forward(cfg)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mini_sequence", [0, 16])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_breakdown_sums_to_the_total(checkpointing, mini_sequence, precision):
    result = estimate(tiny(f"deepspeed.activation_checkpointing={checkpointing}",
                           f"model.mini_sequence={mini_sequence}", f"deepspeed.precision={precision}"), 1)
    parts = result["activation_breakdown_bytes"]
    assert sum(parts.values()) == result["memory_breakdown_bytes"]["activations"]
    assert all(v >= 0 for v in parts.values())
    working = parts["loss_working_set"] if result["activation_peak_at"] == "loss" else parts["gradients_in_flight"]
    assert working > 0


@pytest.mark.parametrize("ffn, rows", [("swiglu", 1), ("rwkv_channel_mix", 2)])
def test_mini_sequence_keeps_only_the_feed_forward_input(ffn, rows):
    """A sliced feed-forward keeps its input: a row per block, two for a token-shifted one (each token beside the one
    before it, which the block hands it)."""
    whole, sliced = (estimate(tiny("model.n_layers=3", f"model.mini_sequence={tokens}", f"model.ffn={ffn}"), 1)
                     for tokens in (0, 16))
    row = 2 * 24 * 32 * 4  # micro-batch × seq_len × dim × fp32: the input each sliced feed-forward keeps
    assert sliced["activation_breakdown_bytes"]["ffns"] == 0
    assert sliced["activation_breakdown_bytes"]["ffn_norms"] == 3 * rows * row
    assert whole["activation_breakdown_bytes"]["ffns"] > 3 * 3 * row  # gate, up, their product at least: wider
    assert kept_bytes(sliced) < kept_bytes(whole)


def test_the_cpu_measurement_counts_what_short_convolutions_save():
    """Per q, k, v a short convolution keeps its input, the input with K − 1 zero rows in front, the pre-SiLU values
    and a document mask per tap: a mixer that cannot run on meta is measured on the CPU and extrapolated, which must
    count what a real forward of the whole row saves more with the convolutions, all but the masks (the CPU probe's
    rows are one document each, so no tap is masked: one byte per token and tap)."""
    def estimated(short_conv):
        result = estimate(tiny("model.mixer=linear", f"model.mixer_options.linear.short_conv={short_conv}"), 1)
        assert result["activations_extrapolated_for"] == ["LinearAttention"]
        return result["memory_breakdown_bytes"]["activations"]

    real = [saved_bytes_of_a_real_forward(tiny("model.mixer=linear", f"model.mixer_options.linear.short_conv={k}"))
            for k in (0, 4)]
    layers, tokens, dim, fp32 = 3, 2 * 24, 32, 4
    zero_rows, masks = 3 * 2 * 3 * dim * fp32, 3 * 3 * tokens  # per conv B × (K − 1) zero rows, K − 1 bool masks
    assert real[1] - real[0] == layers * (9 * tokens * dim * fp32 + zero_rows + masks)
    assert estimated(4) - estimated(0) == real[1] - real[0] - layers * masks


def test_activations_grow_linearly_in_tokens_with_no_quadratic_term():
    def activations(seq_len):
        return estimate(tiny(f"train.seq_len={seq_len}"), 1)["memory_breakdown_bytes"]["activations"]

    short, middle, long = activations(24), activations(48), activations(72)
    assert middle - short == long - middle > 0.9 * short  # equal steps: no T² term; the slope is nearly all of it


def test_activation_checkpointing_keeps_one_input_per_block():
    def activations(*overrides):
        return estimate(tiny("deepspeed.activation_checkpointing=true", *overrides), 1)["memory_breakdown_bytes"][
            "activations"]

    block_input = 2 * 24 * 32 * 4  # micro-batch × seq_len × dim × fp32
    assert activations("model.n_layers=5") - activations("model.n_layers=3") == 2 * block_input
    assert activations() < estimate(tiny(), 1)["memory_breakdown_bytes"]["activations"]
    half = estimate(tiny("deepspeed.activation_checkpointing=true", "deepspeed.precision=bf16"), 1)
    bf16_input = 2 * 24 * 32 * 2
    assert half["memory_breakdown_bytes"]["activations"] > 3 * bf16_input


def test_total_is_the_breakdown_and_offload_moves_states_to_cpu():
    plain = estimate(tiny("deepspeed.zero_stage=3", "deepspeed.precision=bf16"), world_size=4)
    assert plain["memory_per_rank_bytes"] == sum(plain["memory_breakdown_bytes"].values())
    assert plain["cpu_offload_bytes"] == 0
    offloaded = estimate(tiny("deepspeed.zero_stage=3", "deepspeed.precision=bf16", "deepspeed.offload_optimizer=true",
                              "deepspeed.offload_params=true"), world_size=4)
    moved = plain["memory_breakdown_bytes"]["weights"] + plain["memory_breakdown_bytes"]["optimizer_states"]
    assert offloaded["cpu_offload_bytes"] == moved
    assert offloaded["memory_per_rank_bytes"] == plain["memory_per_rank_bytes"] - moved


def test_one_billion_softmax_config_dry_runs_without_data():
    result = estimate(load_config(CONFIGS / "softmax_lm_1b.yaml", []), world_size=8)
    assert 1.0e9 < result["parameters"] < 1.35e9
    assert 6 * result["parameters"] < result["flops_per_token"] < 8 * result["parameters"]  # 6N + attention
    assert result["memory_per_rank_bytes"] < 80 * 2**30  # fits one 80 GB GPU at ZeRO-2 on 8 ranks


def test_aft_config_dry_runs_at_about_a_billion_parameters():
    result = estimate(load_config(CONFIGS / "aft_lm_1b.yaml", []), world_size=8)
    assert 1.0e9 < result["parameters"] < 1.35e9


def test_bad_world_size_and_unknown_vocabulary_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        estimate(tiny(), world_size=0)
    with pytest.raises(ConfigError, match="model.vocab_size: 0 and the tokenizer absent.model does not exist"):
        estimate(tiny("model.vocab_size=0"), world_size=1)


@pytest.mark.parametrize("path", sorted((CONFIGS / "lm").glob("*_1b.yaml")), ids=lambda path: path.stem)
def test_every_mixer_family_1b_config_is_about_a_billion_parameters_and_fits_8_gpus(path):
    result = estimate(load_config(path, []), world_size=8)
    assert 0.9e9 < result["parameters"] < 1.5e9
    # 6 FLOPs per matmul weight (norm gains do none) plus what the mixer adds
    assert 5.9 * result["parameters"] < result["flops_per_token"] < 8 * result["parameters"]
    assert result["memory_per_rank_bytes"] < 80 * 2**30  # ZeRO-2 on 8 ranks of 80 GB


@pytest.mark.parametrize("mixer,rows", [("softmax", 1), ("data_dependent", 2)])  # measured on meta; on the CPU
def test_a_mixers_projections_are_counted_apart_from_its_op(mixer, rows, test_mixers):
    """A storage counts where it is first saved. The linear layers keep the mixer's input (q, k, v's, or the gate's:
    one storage) and the output projection's input, unless the op saved that first: SDPA keeps its output, which
    softmax's o_proj reads as a view, so that row is the op's; the gated shift's product is the projection's."""
    cfg = tiny(f"model.mixer={mixer}", "deepspeed.activation_checkpointing=false", "train.seq_len=40")
    parts = estimate(cfg, 1)["activation_breakdown_bytes"]
    row = 2 * 40 * 32 * 4  # micro-batch × seq_len × dim × fp32
    assert parts["mixer_projections"] == 3 * rows * row
    assert parts["mixer_ops"] > 0
