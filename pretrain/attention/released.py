"""Loading the authors' released attention layers into our mixers, so their checkpoints run here unchanged.

A released layer names its tensors its own way; each loader states ours ← theirs and ``load_renamed`` copies
them, refusing anything that would load a different function: a tensor missing on either side, or a shape that
differs. Only the attention layers carry over: the released backbones' blocks (norms, MLPs, stems) are not ours.
"""
import torch
from torch import nn

# ``SoftmaxFreeAttention`` of fudan-zvg/SOFT; ours ← theirs.
SOFT_NAMES = {
    "q_proj.weight": "W_q.weight", "q_proj.bias": "W_q.bias",
    "v_proj.weight": "W_v.weight", "v_proj.bias": "W_v.bias",
    "landmark_conv.weight": "attn.Qlandmark_op.weight",
    "landmark_norm.weight": "attn.Qnorm_act.0.weight", "landmark_norm.bias": "attn.Qnorm_act.0.bias",
    "v_conv.weight": "attn.conv.weight",
    "o_proj.weight": "ff.weight", "o_proj.bias": "ff.bias",
}

# ``InLineAttention`` of LeapLabTHU/InLine, its fused ``kv`` aside; ours ← theirs.
INLINE_NAMES = {
    "q_proj.weight": "q.weight", "q_proj.bias": "q.bias", "o_proj.weight": "proj.weight", "o_proj.bias": "proj.bias",
    # the dynamic kernel's generator: 1×1 conv, GELU, 1×1 conv
    **{f"kernel_net.{net}.{part}": f"residual.{net}.{part}" for net in ("0", "2") for part in ("weight", "bias")},
}


def load_renamed(module: nn.Module, state_dict: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    """Set each of ``module``'s tensors ``ours`` to ``state_dict[names[ours]]``; every one must be given, with
    its shape. Keys of ``state_dict`` that ``names`` does not mention are left alone (other layers)."""
    ours = module.state_dict()
    unused = sorted(theirs for key, theirs in names.items() if key not in ours and theirs in state_dict)
    if unused:
        raise ValueError(f"released tensors {unused} have no place in this {type(module).__name__}: build it with "
                         f"the released layer's options (qkv_bias / o_bias, conv_kernel, ...)")
    tensors = {}
    for key, mine in ours.items():
        theirs = names.get(key)
        if theirs is None or theirs not in state_dict:
            raise KeyError(f"released state dict has no {theirs or key!r} (for our {key!r})")
        if state_dict[theirs].shape != mine.shape:
            raise ValueError(f"released {theirs!r} has shape {tuple(state_dict[theirs].shape)}; our {key!r} needs "
                             f"{tuple(mine.shape)}: build the mixer with the released layer's sizes")
        tensors[key] = state_dict[theirs]
    module.load_state_dict(tensors)


def load_released_soft(mixer: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Load one released SOFT attention layer (``prefix``: where it sits in a whole checkpoint, e.g.
    ``"block1.0.att.mha."``) into a ``soft`` mixer built alike: ``qkv_bias=True, o_bias=True``,
    ``conv_kernel="per_head"``, the layer's ``conv_size`` and ``landmark_stride``."""
    load_renamed(mixer, state_dict, {ours: prefix + theirs for ours, theirs in SOFT_NAMES.items()})


def load_released_inline(mixer: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Load one released InLine attention layer (``prefix`` e.g. ``"block1.0.attn."``) into a non-causal
    ``inline`` mixer built with ``qkv_bias=True, o_bias=True`` and the local branch.

    The released ``kv`` projection stacks K's rows over V's; we split it. A layer with a spatial reduction
    (``sr``) is refused: the released forward reshapes the reduced K to the full token count, so only
    ``sr_ratio=1`` layers run there, and our mixer has none."""
    if f"{prefix}sr.weight" in state_dict:
        raise ValueError(f"released {prefix}sr.weight: a spatially reduced InLine layer (sr_ratio > 1) has no "
                         f"counterpart in our inline mixer")
    tensors, names = dict(state_dict), {ours: prefix + theirs for ours, theirs in INLINE_NAMES.items()}
    for part in ("weight", "bias"):
        fused = f"{prefix}kv.{part}"
        names[f"k_proj.{part}"], names[f"v_proj.{part}"] = f"{fused} (K half)", f"{fused} (V half)"
        if fused in state_dict:
            if state_dict[fused].shape[0] % 2:
                raise ValueError(f"released {fused!r} has {state_dict[fused].shape[0]} rows; K over V needs an "
                                 f"even count")
            tensors[f"{fused} (K half)"], tensors[f"{fused} (V half)"] = state_dict[fused].chunk(2)
    load_renamed(mixer, tensors, names)
