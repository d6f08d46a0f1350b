"""Dry-run numbers for a config — parameters, training FLOPs per token, memory per rank — in seconds, no data.

A vision run (``task: vision``) reports parameters, FLOPs per image and the model states per rank; its activations
are not measured (the backbone's grid mixers are not probed on meta), and the result says so.

The model is built on the meta device (shapes without storage), so a 1B-parameter config costs nothing.

Model states follow the ZeRO paper (Rajbhandari et al. 2020), Ψ parameters, N ranks, Adam:
- mixed precision (bf16/fp16): weights 2Ψ + gradients 2Ψ + optimizer states 12Ψ (fp32 master weights, m, v);
- fp32: 4Ψ + 4Ψ + 8Ψ (m, v; the weights are their own master copy);
- ZeRO stage 1 divides the optimizer states by N, stage 2 also the gradients, stage 3 also the weights;
- offload_optimizer moves the optimizer states to CPU memory, offload_params the weights (reported apart).
Activations are measured, not modelled: one forward on the meta device at (micro_batch_size, seq_len) through
the model's fused head and loss (``models/lm_head.py``), counting every tensor autograd saves for backward
(parameters excluded, views counted once); blocks of the same mixer save the same bytes, so one period of the
layer pattern is run.
A mixer whose forward needs data (``.item()``, ``nonzero`` on packed-document offsets) cannot run on meta; its
share is then taken as 5·dim values per token (input, q, k, v, output; 9·dim more with ``short_conv``: each of
q, k, v before its convolution, zero-padded, and before its SiLU) and the result names it.
On the meta device SDPA would take its math path and store the T×T weights; the GPU kernels (flash-attn, SDPA's
flash) keep only q, k, v, out and the log-sum-exp, so the measurement routes SDPA to that kernel's form.
Under sequence parallelism (``parallel.sequence_parallel: N``) a rank holds seq_len/N tokens of every row, so its
activations are measured at that length (Ulysses' all-to-all trades a slice of every head for every token of H/N
heads: the same size); the states the linear mixers exchange, N × [H, D, D] per layer, are small beside them.
With activation checkpointing each block keeps only its input, plus one block's activations while it is
recomputed. Not counted: temporary buffers (DeepSpeed's communication buckets, ZeRO-3 gathers,
allocator fragmentation), so treat the total as a floor with ~10–20 % headroom to plan for.
"""
import dataclasses

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.overrides import TorchFunctionMode

from .config import ConfigError, ModelConfig
from .models import build_lm, build_vision_model
from .ops.precision import DTYPES

BYTES_PER_PARAM = {  # weights, gradients, optimizer states (Adam), per parameter
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),
    "fp16": (2, 2, 12),
}
MIXER_TENSORS_PER_TOKEN = 5  # the fallback for mixers that cannot run on meta: input, q, k, v, output
SHORT_CONV_TENSORS_PER_TOKEN = 9  # and with short_conv: per q, k, v its projection, the zero-padded copy, the pre-SiLU


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
    with torch.device("meta"):
        model = build_lm(OmegaConf.to_object(cfg.model)).to(dtype)
        probe = build_lm(_one_pattern_period(OmegaConf.to_object(cfg.model))).to(dtype)
    parameters = sum(p.numel() for p in model.parameters())
    forward_flops = model.flops_per_token(train.seq_len)

    states = model_state_bytes(parameters, ds.precision, ds.zero_stage, world_size)
    period, rest, approximated = saved_activation_bytes(probe, train.micro_batch_size, local_len)
    per_block = [period[i % len(period)] for i in range(len(model.layers))]
    if ds.activation_checkpointing:
        block_input = train.micro_batch_size * local_len * cfg.model.dim * dtype.itemsize
        activations = len(per_block) * block_input + max(per_block) + rest
    else:
        activations = sum(per_block) + rest

    offloaded = {"weights": ds.offload_params, "gradients": False, "optimizer_states": ds.offload_optimizer}
    on_gpu = {k: 0 if offloaded[k] else v for k, v in states.items()}
    return {
        "parameters": parameters,
        "flops_per_token": 3 * forward_flops,  # training: forward + backward (2× forward); recomputation excluded
        "forward_flops_per_token": forward_flops,
        "memory_per_rank_bytes": sum(on_gpu.values()) + activations,
        "memory_breakdown_bytes": {**on_gpu, "activations": activations},
        "cpu_offload_bytes": sum(v for k, v in states.items() if offloaded[k]),
        "world_size": world_size,
        "zero_stage": ds.zero_stage,
        "precision": ds.precision,
        "micro_batch_size": train.micro_batch_size,
        "seq_len": train.seq_len,
        "sequence_parallel": split,
        "tokens_per_rank": train.micro_batch_size * local_len,
        "activation_checkpointing": ds.activation_checkpointing,
        "activations_approximated_for": approximated,  # mixers that cannot run on meta: 5·dim values per token
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
    """The model with one period of its layer pattern: blocks of one mixer save the same bytes, so measure each once."""
    return dataclasses.replace(model_cfg, n_layers=len(model_cfg.layer_pattern) or 1)


def saved_activation_bytes(model, batch: int, seq_len: int) -> tuple[list[int], int, list[str]]:
    """Bytes autograd saves in one training forward: per block, the rest (embedding, head, fp32 loss), and the
    mixers whose share had to be approximated because they do not run on the meta device."""
    device = next(model.parameters()).device
    counter = _SavedTensorCounter(model)
    hooks = [block.register_forward_pre_hook(lambda module, args, i=i: counter.switch(i))
             for i, block in enumerate(model.layers)]
    hooks.append(model.norm.register_forward_pre_hook(lambda module, args: counter.switch("rest")))
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
    return [counter.bytes[i] for i in range(len(model.layers))], counter.bytes["rest"], sorted(counter.approximated)


class _SavedTensorCounter:
    """Adds up the storage of saved tensors into the current bucket, each storage once, parameters never.

    Storages are told apart by their address, so the ones seen are kept alive: a freed address can be reused.
    """

    def __init__(self, model):
        self.seen = {p.untyped_storage()._cdata: p.untyped_storage() for p in model.parameters()}
        self.bytes = {i: 0 for i in range(len(model.layers))} | {"rest": 0}
        self.bucket = "rest"
        self.approximated = set()

    def switch(self, bucket) -> None:
        self.bucket = bucket

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in self.seen:
            self.seen[storage._cdata] = storage
            self.bytes[self.bucket] += storage.nbytes()
        return tensor

    def guarded(self, mixer):
        """``mixer.forward``, or where it needs data the meta device lacks (``.item()``, ``nonzero``), the bytes a
        q/k/v/o mixer keeps at least: its input, q, k, v and the op's output."""
        forward = mixer.forward

        def run(x, **kwargs):
            before = self.bytes[self.bucket]
            try:
                return forward(x, **kwargs)
            except (RuntimeError, NotImplementedError):  # data-dependent shapes have no meta form
                self.approximated.add(type(mixer).__name__)
                tensors = MIXER_TENSORS_PER_TOKEN + (SHORT_CONV_TENSORS_PER_TOKEN if getattr(mixer, "short_conv", 0)
                                                     else 0)
                self.bytes[self.bucket] = before + tensors * x.numel() * x.element_size()
                return torch.zeros_like(x)

        return run


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
