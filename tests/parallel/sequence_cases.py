"""Cases of the sequence-parallel tests, shared by the test (the single-process reference) and the worker that
torchrun starts (each rank's slice). fp64 throughout, so forms that are exact agree to round-off.

Rows of T = 48 tokens hold documents that start, end and straddle the slice boundaries of N = 2, 3 and 4 (slices
of 24, 16 and 12 tokens: not multiples of the chunk of 16), a one-token document, a document covering whole
middle slices (the fold passes states through ranks where no document begins), and documents that begin one token
into a slice (a short convolution's first outputs there reach back into the previous slice only partly).
"""
from dataclasses import dataclass, field

import torch

from pretrain.attention import build_mixer
from pretrain.ops import cu_seqlens_from_position_ids
from pretrain.parallel import SequenceShard, shard_rows

DOCUMENTS = [[10, 14, 24], [30, 1, 17], [5, 40, 3], [48], [13, 12, 12, 11]]
SEQ_LEN, DIM, HEADS = 48, 16, 4


@dataclass(frozen=True)
class Case:
    mixer: str
    options: dict = field(default_factory=dict)


CASES = {
    "linear": Case("linear", {"chunk_size": 16}),
    "linear_none_norm": Case("linear", {"chunk_size": 16, "normalize": "none", "output_norm": True,
                                        "feature_map": "relu"}),
    "cosine": Case("cosine", {"chunk_size": 16}),
    "inline": Case("inline", {"chunk_size": 16, "conv_size": 4}),
    "softmax": Case("softmax", {}),
    "efficient": Case("efficient", {"chunk_size": 16}),
    "aft_simple": Case("aft_simple", {"chunk_size": 16}),
    "aft_local": Case("aft_local", {"chunk_size": 16, "window": 5}),
    "retnet": Case("retnet", {"chunk_size": 16}),
    "retnet_lightning_no_conv": Case("retnet", {"chunk_size": 16, "decay": "lightning", "layer_index": 1,
                                                "num_layers": 3, "short_conv": 0}),
    "mamba2": Case("mamba2", {"chunk_size": 16, "state_size": 8}),
    # short convolutions: the K − 1 inputs before a slice come in the states' packet (one variant per mixer; at
    # N = 4 the 12-token slices just hold InLine's 3 + 3 and AFT-local's 4 + 3 halo tokens)
    "linear_short_conv": Case("linear", {"chunk_size": 16, "short_conv": 4}),
    "cosine_short_conv": Case("cosine", {"chunk_size": 16, "short_conv": 3}),
    "inline_short_conv": Case("inline", {"chunk_size": 16, "conv_size": 4, "short_conv": 4}),
    "efficient_short_conv": Case("efficient", {"chunk_size": 16, "short_conv": 4}),
    "aft_simple_short_conv": Case("aft_simple", {"chunk_size": 16, "short_conv": 4}),
    "aft_local_short_conv": Case("aft_local", {"chunk_size": 16, "window": 5, "short_conv": 4}),
    "deltanet": Case("deltanet", {"chunk_size": 16}),
    "gated_deltanet": Case("gated_deltanet", {"chunk_size": 16}),
    "gated_deltanet_no_conv": Case("gated_deltanet", {"chunk_size": 16, "short_conv": 0}),
    "kda": Case("kda", {"chunk_size": 16}),
    "kda_no_conv": Case("kda", {"chunk_size": 16, "short_conv": 0}),
    # the token shift reads the previous slice's last input x (one token; K with short_conv's K − 1 behind it)
    "rwkv7": Case("rwkv7", {"chunk_size": 16}),
    "rwkv7_short_conv": Case("rwkv7", {"chunk_size": 16, "short_conv": 4, "decay_rank": 3, "rate_rank": 5,
                                       "gate_rank": 7}),
}


# A whole LM whose layers run every sequence-parallel mixer in turn, scored by its own fused loss: the embedding,
# norms, head and loss on a slice, and gradients that cross ranks through every kind of exchange (cosine's with its
# short convolutions' halo).
MODEL_LAYERS = ["linear", "inline", "efficient", "aft_local", "softmax", "aft_simple", "cosine", "retnet",
                "mamba2",
                "gated_deltanet", "kda", "rwkv7"]


def run_model(shard: SequenceShard | None, *, mini_sequence: int = 0, checkpointing: bool = False
              ) -> dict[str, torch.Tensor]:
    """The LM's summed NLL of the rows (of this rank's slice) and its parameters' gradients; optionally with its
    feed-forwards run over slices of ``mini_sequence`` tokens and every block checkpointed."""
    from pretrain.config import load_config
    from pretrain.distributed import apply_activation_checkpointing, apply_sequence_parallel
    from pretrain.tasks import build_model

    cfg = load_config(None, ["data.tokenizer=none", "data.train_shards=none", "model.vocab_size=97",
                             f"model.dim={DIM}", f"model.n_heads={HEADS}", f"model.n_layers={len(MODEL_LAYERS)}",
                             f"model.layer_pattern=[{','.join(MODEL_LAYERS)}]", f"train.seq_len={SEQ_LEN}",
                             "model.mixer_options.linear.chunk_size=16", "model.mixer_options.inline.chunk_size=16",
                             "model.mixer_options.efficient.chunk_size=16", "model.mixer_options.aft_local.window=5",
                             "model.mixer_options.aft_local.chunk_size=16",
                             "model.mixer_options.aft_simple.chunk_size=16", "model.mixer_options.cosine.short_conv=4",
                             "model.mixer_options.retnet.chunk_size=16", "model.mixer_options.mamba2.chunk_size=16",
                             "model.mixer_options.mamba2.state_size=8", f"model.mini_sequence={mini_sequence}",
                             "model.mixer_options.gated_deltanet.chunk_size=16",
                             "model.mixer_options.kda.chunk_size=16", "model.mixer_options.rwkv7.chunk_size=16"])
    torch.manual_seed(0)
    model = build_model(cfg).double()
    for parameter in model.parameters():
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    if checkpointing:
        apply_activation_checkpointing(model)
    ids = torch.randint(0, 97, (len(DOCUMENTS), SEQ_LEN + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": position_ids()}
    if shard is not None:
        apply_sequence_parallel(model, shard, SEQ_LEN)
        batch = shard_rows(batch, shard)
    loss = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    loss.backward()
    return {"loss": loss.detach(), **{f"grad/{name}": p.grad for name, p in model.named_parameters()}}


def position_ids() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def run_case(case: Case, shard: SequenceShard | None) -> dict[str, torch.Tensor]:
    """The mixer's output, input gradient and parameter gradients on this rank's slice (whole rows: ``shard``
    None), for a fixed upstream gradient."""
    torch.manual_seed(0)
    mixer = build_mixer(case.mixer, DIM, HEADS, causal=True, options=case.options).double()
    for parameter in mixer.parameters():  # biases and taps away from their zero/one inits
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    x = 0.5 * torch.randn(len(DOCUMENTS), SEQ_LEN, DIM, dtype=torch.float64)
    upstream = torch.randn_like(x)
    positions = position_ids()
    if shard is not None:
        part = shard.slice(SEQ_LEN)
        x, upstream, positions = x[:, part].contiguous(), upstream[:, part], positions[:, part].contiguous()
        mixer.sequence = shard
    x.requires_grad_(True)
    y = mixer(x, cu_seqlens=cu_seqlens_from_position_ids(positions), position_ids=positions)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad,
            **{f"grad/{name}": p.grad for name, p in mixer.named_parameters() if p.grad is not None}}
