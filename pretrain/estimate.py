"""Dry-run numbers for a config — parameters, training FLOPs per token, memory per rank — in seconds, no data.

A vision run (``task: vision``) reports parameters, FLOPs per image and the model states per rank; its activations
are not measured (the backbone's grid mixers are not probed on meta), and the result says so.

The model is built on the meta device (shapes without storage), so a 1B-parameter config costs nothing.

Model states follow the ZeRO paper (Rajbhandari et al. 2020), Ψ parameters, N ranks, Adam:
- mixed precision (bf16/fp16): weights 2Ψ + gradients 2Ψ + optimizer states 12Ψ (fp32 master weights, m, v);
- fp32: 4Ψ + 4Ψ + 8Ψ (m, v; the weights are their own master copy);
- ZeRO stage 1 divides the optimizer states by N, stage 2 also the gradients, stage 3 also the weights;
- offload_optimizer moves the optimizer states to CPU memory, offload_params the weights (reported apart).
Activations are measured where they can be, modelled where they must be, and reported by component, the parts
summing to the total (``activation_breakdown_bytes``). Measured: one forward on the meta device at
(micro_batch_size, seq_len) through the model's fused head and loss (``models/lm_head.py``), counting every
tensor autograd saves for backward (parameters excluded, views counted once) in the part of the block that saved
it — the mixer's norm, the mixer's projections (the inputs its linear layers keep), the rest of the mixer (feature
maps, short convolutions, gates and the op's saved tensors), the feed-forward's norm, the feed-forward — or the loss
(embedding, final norm, head); blocks of the same mixer save the same bytes, so one period of the layer pattern
is run, whole (``model.mini_sequence`` is then applied by arithmetic: a sliced feed-forward keeps its input only,
and recomputes one slice at a time). A mixer whose forward needs data (``.item()``, ``nonzero``
on packed-document offsets) cannot run on meta; it is run instead on the CPU at two short lengths and its bytes
extrapolated along the row (exact for what grows linearly in T, as every linear-time mixer's saved tensors do),
and the result names it. On the meta device SDPA would take its math path and store the T×T weights; the GPU
kernels (flash-attn, SDPA's flash) keep only q, k, v, out and the log-sum-exp, so the measurement routes SDPA to
that kernel's form. Modelled: the two moments memory peaks — the loss's end of the forward, when everything kept
is held with the head's chunk of logits (``lm_head.working_set_bytes``), and the backward of the last block,
which adds (with activation checkpointing) the recomputed block, one slice's feed-forward when sliced, and the
gradients in flight: the residual stream's and those of a mixer's q, k, v and output, 5 × tokens × dim values.
Under sequence parallelism (``parallel.sequence_parallel: N``) a rank holds seq_len/N tokens of every row, so its
activations are measured at that length (Ulysses' all-to-all trades a slice of every head for every token of H/N
heads: the same size); the states the linear mixers exchange, N × [H, D, D] per layer, are small beside them.
With activation checkpointing each block keeps only its input, plus one block's activations while it is
recomputed. Not counted: temporary buffers inside kernels and DeepSpeed's (communication buckets, ZeRO-3
gathers), allocator caching and fragmentation, so treat the total as a floor with ~10–20 % headroom to plan for;
``tools/bench_sequence_parallel.py`` sets the estimate beside a measured peak.
"""
import copy
import dataclasses

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.overrides import TorchFunctionMode

from .config import ConfigError, ModelConfig
from .models import build_lm, build_vision_model
from .models.lm_head import working_set_bytes
from .ops.precision import DTYPES

BYTES_PER_PARAM = {  # weights, gradients, optimizer states (Adam), per parameter
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),
    "fp16": (2, 2, 12),
}
# where a block's saved bytes are counted: a mixer's are split between its linear layers and the rest, its op
BLOCK_PARTS = ("mixer_norm", "mixer_projection", "mixer_op", "ffn_norm", "ffn")
GRADIENTS_IN_FLIGHT = 5  # [tokens, dim] gradients held at once in backward: the residual's, a mixer's q, k, v, out
CPU_PROBE_LENGTHS = (128, 256)  # a mixer that cannot run on meta is measured at these lengths on the CPU


def estimate(cfg: DictConfig, world_size: int) -> dict:
    """Parameters, FLOPs per token and the memory of one rank for the run ``cfg`` on ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if cfg.task == "vision":
        return estimate_vision(cfg, world_size)
    if cfg.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size", f"0 and the tokenizer {cfg.data.tokenizer} does not exist; give the "
                                              "size (model.vocab_size=32000) or an existing data.tokenizer")
    ds, train = cfg.deepspeed, cfg.train
    dtype = DTYPES[ds.precision]
    split = cfg.parallel.sequence_parallel
    if world_size % split:
        raise ConfigError("parallel.sequence_parallel", f"{split} must divide the number of ranks ({world_size})")
    local_len = train.seq_len // split  # a rank's slice of every row: its activations are those of a row this long
    model_cfg = OmegaConf.to_object(cfg.model)
    with torch.device("meta"):
        model = build_lm(model_cfg).to(dtype)
        probe = build_lm(_one_pattern_period(model_cfg)).to(dtype)
    parameters = sum(p.numel() for p in model.parameters())
    forward_flops = model.flops_per_token(train.seq_len)

    states = model_state_bytes(parameters, ds.precision, ds.zero_stage, world_size)
    period, rest, extrapolated = saved_activation_bytes(probe, train.micro_batch_size, local_len)
    parts, peak_at = activation_parts([period[i % len(period)] for i in range(len(model.layers))], rest,
                                      tokens=train.micro_batch_size * local_len, dim=cfg.model.dim, dtype=dtype,
                                      vocab=cfg.model.vocab_size, checkpointing=ds.activation_checkpointing,
                                      mini_sequence=cfg.model.mini_sequence,
                                      ffn_input_rows=2 if model.layers[0].ffn.shifts else 1)
    activations = sum(parts.values())

    offloaded = {"weights": ds.offload_params, "gradients": False, "optimizer_states": ds.offload_optimizer}
    on_gpu = {k: 0 if offloaded[k] else v for k, v in states.items()}
    return {
        "parameters": parameters,
        "flops_per_token": 3 * forward_flops,  # training: forward + backward (2× forward); recomputation excluded
        "forward_flops_per_token": forward_flops,
        "memory_per_rank_bytes": sum(on_gpu.values()) + activations,
        "memory_breakdown_bytes": {**on_gpu, "activations": activations},
        "activation_breakdown_bytes": parts,  # at the peak: the loss's end of the forward, or the backward
        "activation_peak_at": peak_at,
        "cpu_offload_bytes": sum(v for k, v in states.items() if offloaded[k]),
        "world_size": world_size,
        "zero_stage": ds.zero_stage,
        "precision": ds.precision,
        "micro_batch_size": train.micro_batch_size,
        "seq_len": train.seq_len,
        "sequence_parallel": split,
        "tokens_per_rank": train.micro_batch_size * local_len,
        "activation_checkpointing": ds.activation_checkpointing,
        "mini_sequence": cfg.model.mini_sequence,
        "activations_extrapolated_for": extrapolated,  # mixers that cannot run on meta: measured short on the CPU
    }


def estimate_vision(cfg: DictConfig, world_size: int) -> dict:
    """Parameters, FLOPs per image at ``vision.image_size`` and the model states of one rank of a vision run."""
    ds, size = cfg.deepspeed, cfg.vision.image_size
    with torch.device("meta"):
        model = build_vision_model(OmegaConf.to_object(cfg.vision), OmegaConf.to_object(cfg.model))
    parameters = sum(p.numel() for p in model.parameters())
    forward_flops = model.flops_per_image(size, size)
    states = model_state_bytes(parameters, ds.precision, ds.zero_stage, world_size)
    return {
        "parameters": parameters,
        "flops_per_image": 3 * forward_flops,  # training: forward + backward (2× forward)
        "forward_flops_per_image": forward_flops,
        "image_size": size,
        "model_state_bytes_per_rank": sum(states.values()),
        "memory_breakdown_bytes": states,
        "activations": "not measured for vision",
        "world_size": world_size,
        "zero_stage": ds.zero_stage,
        "precision": ds.precision,
        "micro_batch_size": cfg.train.micro_batch_size,
    }


def model_state_bytes(parameters: int, precision: str, zero_stage: int, world_size: int) -> dict[str, int]:
    """Weights, gradients and optimizer states held by one rank (ZeRO paper's 2Ψ + 2Ψ + 12Ψ, sharded by stage)."""
    weights, gradients, optimizer = (b * parameters for b in BYTES_PER_PARAM[precision])
    return {
        "weights": weights // world_size if zero_stage >= 3 else weights,
        "gradients": gradients // world_size if zero_stage >= 2 else gradients,
        "optimizer_states": optimizer // world_size if zero_stage >= 1 else optimizer,
    }


def _one_pattern_period(model_cfg: ModelConfig) -> ModelConfig:
    """The model with one period of its layer pattern (blocks of one mixer save the same bytes, so measure each
    once), unsliced: what a block saves whole is measured, and ``activation_parts`` applies the slicing."""
    return dataclasses.replace(model_cfg, n_layers=len(model_cfg.layer_pattern) or 1, mini_sequence=0)


def activation_parts(blocks: list[dict[str, int]], rest: int, *, tokens: int, dim: int, dtype: torch.dtype,
                     vocab: int, checkpointing: bool, mini_sequence: int,
                     ffn_input_rows: int = 1) -> tuple[dict[str, int], str]:
    """One rank's activation bytes at their peak, by component (summing to the total), and which moment that is.

    ``blocks``: each block's saved bytes by part (``BLOCK_PARTS``), measured whole; ``rest``: the loss's;
    ``ffn_input_rows``: the rows a sliced feed-forward keeps as its input (2 for a token-shifted one).
    """
    row = tokens * dim * dtype.itemsize  # one [tokens, dim] tensor: a block's input, the residual's gradient

    def block_bytes(block):
        return sum(block.values())

    slice_bytes = 0
    if mini_sequence:  # the feed-forward keeps its input; in backward one slice's activations come back at a time
        share = min(mini_sequence, tokens) / tokens
        slice_bytes = int(max(share * (block["ffn_norm"] + block["ffn"]) for block in blocks))
        blocks = [{**block, "ffn_norm": ffn_input_rows * row, "ffn": 0} for block in blocks]
    kept = [] if checkpointing else blocks  # held from a block's forward to its backward
    recomputed = [max(blocks, key=block_bytes)] if checkpointing else []  # held while the block's backward runs
    at_loss = working_set_bytes(tokens, vocab, dtype)
    in_backward = sum(map(block_bytes, recomputed)) + slice_bytes + GRADIENTS_IN_FLIGHT * row
    peak_at = "loss" if at_loss >= in_backward else "backward"
    held = kept + (recomputed if peak_at == "backward" else [])
    parts = {"block_inputs": len(blocks) * row if checkpointing else 0}
    parts |= {f"{part}s": sum(block[part] for block in held) for part in BLOCK_PARTS}
    parts["loss"] = rest
    parts["loss_working_set"] = at_loss if peak_at == "loss" else 0
    parts["ffn_slice"] = slice_bytes if peak_at == "backward" else 0
    parts["gradients_in_flight"] = GRADIENTS_IN_FLIGHT * row if peak_at == "backward" else 0
    return parts, peak_at


def saved_activation_bytes(model, batch: int, seq_len: int) -> tuple[list[dict[str, int]], int, list[str]]:
    """Bytes autograd saves in one training forward: per block and part of it (``BLOCK_PARTS``), the rest
    (embedding, final norm, head, fp32 loss), and the mixers that had to be measured on the CPU instead."""
    device = next(model.parameters()).device
    buckets = [(i, part) for i in range(len(model.layers)) for part in BLOCK_PARTS] + ["rest"]
    counter = _SavedTensorCounter(model.parameters(), buckets)
    hooks = []
    for i, block in enumerate(model.layers):
        for part, module in (("mixer_norm", block.mixer_norm), ("mixer_op", block.mixer), ("ffn_norm", block.ffn_norm),
                             ("ffn", block.ffn)):
            hooks += counter.switch_at(module, (i, part))
        hooks += counter.split_projections(block.mixer, (i, "mixer_projection"), (i, "mixer_op"))
    hooks += counter.switch_at(model.norm, "rest")
    for block in model.layers:
        block.mixer.forward = counter.guarded(block.mixer)
    input_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), _FlashShapedSDPA():
            model(input_ids, labels=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
        for block in model.layers:
            del block.mixer.forward  # back to the class's forward
    blocks = [{part: counter.bytes[i, part] for part in BLOCK_PARTS} for i in range(len(model.layers))]
    return blocks, counter.bytes["rest"], sorted(counter.extrapolated)


class _SavedTensorCounter:
    """Adds up the storage of saved tensors into the current bucket, each storage once, parameters never.

    Storages are told apart by their address, so the ones seen are kept alive: a freed address can be reused.
    Buckets switch when a module starts (``switch_at``); the hooks act for that module only, not for a deep copy
    of it (which inherits its hooks: ``cpu_saved_bytes``' twin).
    """

    def __init__(self, parameters, buckets):
        self.seen = {p.untyped_storage()._cdata: p.untyped_storage() for p in parameters}
        self.bytes = dict.fromkeys(buckets, 0)
        self.bucket = "rest"
        self.extrapolated = set()
        self.cpu_measured = {}  # repr(mixer) → (bytes per token, bytes per row) from its CPU twin

    def switch(self, bucket) -> None:
        self.bucket = bucket

    def switch_at(self, module, bucket, after=None) -> list:
        """Hooks: ``bucket`` from when ``module`` starts (and ``after`` from when it ends, if given)."""
        def to(target):
            return lambda hooked, *_: self.switch(target) if hooked is module else None

        hooks = [module.register_forward_pre_hook(to(bucket))]
        return hooks + ([module.register_forward_hook(to(after))] if after is not None else [])

    def split_projections(self, mixer, projection, rest) -> list:
        """Hooks that count what ``mixer``'s linear layers save (their inputs) in ``projection``, the rest in
        ``rest``."""
        return [hook for module in mixer.modules() if isinstance(module, torch.nn.Linear)
                for hook in self.switch_at(module, projection, after=rest)]

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in self.seen:
            self.seen[storage._cdata] = storage
            self.bytes[self.bucket] += storage.nbytes()
        return tensor

    def guarded(self, mixer):
        """``mixer.forward``, or where it needs data the meta device lacks (``.item()``, ``nonzero``), its bytes
        measured on a CPU twin at short lengths (``cpu_saved_bytes``) and extrapolated to ``x``'s."""
        forward = mixer.forward

        def run(x, **kwargs):
            counted, (layer, _) = dict(self.bytes), self.bucket  # the mixer's pre-hook set (layer, "mixer_op")
            try:
                return forward(x, **kwargs)
            except (RuntimeError, NotImplementedError):  # data-dependent shapes have no meta form
                self.bytes = counted  # what the failed attempt counted goes
                self.extrapolated.add(type(mixer).__name__)
                key = repr(mixer)
                if key not in self.cpu_measured:
                    self.cpu_measured[key] = cpu_saved_bytes(mixer, x.shape[-1], x.dtype)
                batch, seq_len, _ = x.shape
                for part, (per_token, per_row) in self.cpu_measured[key].items():
                    self.bytes[layer, part] += round(batch * (per_row + per_token * seq_len))
                return torch.zeros_like(x)

        return run


def cpu_saved_bytes(mixer, dim: int, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """What a copy of ``mixer`` on the CPU saves for backward in a forward over one row of width ``dim``, as
    (bytes per token, bytes per row) for its projections and the rest (``mixer_projection``, ``mixer_op``), from
    ``CPU_PROBE_LENGTHS``: a linear-time mixer's saved tensors grow linearly in T."""
    twin = copy.deepcopy(mixer).to_empty(device="cpu")
    vars(twin).pop("forward", None)  # the class's forward, not the guard the probe put on the original
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in [*twin.parameters(), *twin.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
    parts = ("mixer_projection", "mixer_op")
    measured = []
    for length in CPU_PROBE_LENGTHS:
        counter = _SavedTensorCounter(twin.parameters(), parts)
        counter.switch("mixer_op")
        hooks = counter.split_projections(twin, "mixer_projection", "mixer_op")
        x = torch.randn(1, length, dim, generator=generator).to(dtype).requires_grad_()  # as a block's is
        try:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                twin(x)
        finally:
            for hook in hooks:
                hook.remove()
        measured.append(counter.bytes)
    (short, long), (a, b) = measured, CPU_PROBE_LENGTHS
    per_token = {part: (long[part] - short[part]) / (b - a) for part in parts}
    return {part: (per_token[part], short[part] - per_token[part] * a) for part in parts}


class _FlashShapedSDPA(TorchFunctionMode):
    """SDPA through the flash kernel's signature, so what it saves is what a GPU flash kernel saves."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, *rest = args
        attn_mask = kwargs.get("attn_mask", rest[0] if rest else None)
        is_causal = kwargs.get("is_causal", rest[2] if len(rest) > 2 else False)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                             attn_mask=attn_mask)
        return out
