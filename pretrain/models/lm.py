"""Decoder-only causal LM: pre-norm blocks of (token mixer, feed-forward), each mixer chosen by name from the registry.

The model never names a mixer: ``model.mixer`` (or the per-layer ``model.layer_pattern``, repeated to
``n_layers``) picks registered classes, so a new mixer needs no change here.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..attention import build_mixer, mixer_options
from ..attention.norm import RMSNorm
from ..config import ModelConfig
from ..ops import cu_seqlens_from_position_ids
from ..scopes import BLOCK, MIXER, scope
from .layers import RWKVChannelMix, SwiGLU, ffn_width, init_weights
from .left_padded import prefill_left_padded
from .lm_head import LMHead
from .mini_sequence import sliced

FFNS = {"swiglu": SwiGLU, "rwkv_channel_mix": RWKVChannelMix}  # model.ffn

# Model-level keys handed to every mixer that declares an option of the same name (per-mixer options win).
SHARED_MIXER_OPTIONS = ("rope_theta",)


def layer_mixers(model_cfg: ModelConfig) -> list[str]:
    """The mixer name of each layer: ``layer_pattern`` (or ``[mixer]``) repeated to ``n_layers``."""
    pattern = list(model_cfg.layer_pattern) or [model_cfg.mixer]
    return [pattern[i % len(pattern)] for i in range(model_cfg.n_layers)]


def mixer_kwargs(model_cfg: ModelConfig, name: str, layer_index: int = 0) -> dict:
    """The options ``name`` is built with: shared model keys it accepts, its place in the stack (``layer_index``,
    ``num_layers``) if it declares them (a per-layer decay schedule does), then ``model.mixer_options.<name>``."""
    accepted = mixer_options(name)
    options = {key: getattr(model_cfg, key) for key in SHARED_MIXER_OPTIONS if key in accepted}
    place = {"layer_index": layer_index, "num_layers": model_cfg.n_layers}
    options.update({key: value for key, value in place.items() if key in accepted})
    options.update(model_cfg.mixer_options.get(name) or {})
    return options


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + ffn(norm(x))``.

    ``mini_sequence`` > 0 runs the second half over slices of that many tokens, keeping only its input for
    backward (``mini_sequence.py``); the mixer sees the whole row, as its op needs. A feed-forward with a token shift
    (``ffn.shifts``) also reads the token before (zeros before a document's first), which the block hands it beside
    each token, so that half stays token-wise; its decoding state is then ``(mixer state, the last token's input)``.
    """

    def __init__(self, mixer: nn.Module, dim: int, ffn_hidden: int, norm_eps: float, mini_sequence: int = 0,
                 ffn: str = "swiglu"):
        super().__init__()
        self.mixer_norm = RMSNorm(dim, eps=norm_eps)
        self.mixer = mixer
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn = FFNS[ffn](dim, ffn_hidden)
        self.mini_sequence = mini_sequence

    def forward(self, x, cu_seqlens=None, position_ids=None):
        with scope(BLOCK):
            normed = self.mixer_norm(x)
            with scope(MIXER):
                mixed = self.mixer(normed, cu_seqlens=cu_seqlens, position_ids=position_ids)
            return self._then_ffn(x + mixed, position_ids)

    def _then_ffn(self, x, position_ids=None, last=None):
        """``x + ffn(norm(x))`` of ``x [B, T, C]`` (of ``[B, C]`` with ``last``, the token before it, when decoding).
        The token before each one: ``last`` or x's own, zeros where ``position_ids`` start a document (None: the
        row is one document)."""
        if not self.ffn.shifts:
            return sliced(self._ffn_residual, x, self.mini_sequence)
        if last is None:
            last = F.pad(x[:, :-1], (0, 0, 1, 0))
            if position_ids is not None:
                last = last * (position_ids > 0)[..., None].to(x.dtype)
        return sliced(self._ffn_residual, torch.cat([x, last], dim=-1), self.mini_sequence)

    def _ffn_residual(self, x):
        """Token-wise: ``x [..., C]``, or ``[..., 2C]`` for a token-shifted ffn (each token beside the one before)."""
        if not self.ffn.shifts:
            return x + self.ffn(self.ffn_norm(x))
        x, previous = x.chunk(2, dim=-1)
        return x + self.ffn(self.ffn_norm(x), self.ffn_norm(previous))  # the norm keeps zeros zero

    def step(self, x_t, state=None):
        """One token ``[B, C]`` through the block with its decoding ``state`` → ``(y_t, state)``."""
        if not self.ffn.shifts:
            mixed, state = self.mixer.step(self.mixer_norm(x_t), state)
            return self._then_ffn(x_t + mixed), state
        mixer_state, last = state if state is not None else (None, torch.zeros_like(x_t))
        mixed, mixer_state = self.mixer.step(self.mixer_norm(x_t), mixer_state)
        return self._then_ffn(x_t + mixed, last=last), (mixer_state, x_t + mixed)

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` → ``(y, state)``, the state for ``step`` to go on from."""
        mixed, state = self.mixer.prefill(self.mixer_norm(x))
        if self.ffn.shifts:
            state = (state, x[:, -1] + mixed[:, -1])
        return self._then_ffn(x + mixed), state


class CausalLM(nn.Module):
    """Token embedding → blocks → RMSNorm → LM head (optionally tied to the embedding), whose loss is fused in."""

    def __init__(self, model_cfg: ModelConfig):
        super().__init__()
        vocab, dim = model_cfg.vocab_size, model_cfg.dim
        if vocab <= 0:
            raise ValueError(
                f"model.vocab_size must be resolved (> 0), got {vocab}: set it, or point data.tokenizer at an "
                "existing sentencepiece model and load the config with pretrain.tasks.config_checks.load_run_config"
            )
        hidden = ffn_width(model_cfg.ffn, dim, model_cfg.ffn_hidden, model_cfg.multiple_of)
        self.embed = nn.Embedding(vocab, dim)
        names = layer_mixers(model_cfg)
        self.layers = nn.ModuleList(
            Block(build_mixer(name, dim, model_cfg.n_heads, causal=True,
                              options=mixer_kwargs(model_cfg, name, layer_index=index)),
                  dim, hidden, model_cfg.norm_eps, model_cfg.mini_sequence, model_cfg.ffn)
            for index, name in enumerate(names)
        )
        self.norm = RMSNorm(dim, eps=model_cfg.norm_eps)
        self.lm_head = LMHead(dim, vocab)
        if model_cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        init_weights(self, model_cfg.init_std, blocks=len(self.layers))

    def forward(self, input_ids, position_ids=None, labels=None, reduction="sum"):
        """``input_ids`` ``[B, T]`` → logits ``[B, T, V]``; ``position_ids`` restart at 0 at each document start.

        With ``labels [B, T]`` (-100: not scored), the summed fp32 NLL instead, without ever holding the logits
        (``reduction="none"``: each token's, for evaluation).
        """
        if position_ids is None:  # one document per row: the plain batched path, no cu_seqlens needed
            cu_seqlens = None
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        else:
            cu_seqlens = cu_seqlens_from_position_ids(position_ids)
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x, cu_seqlens, position_ids)
        return self.lm_head(self.norm(x), labels, reduction=reduction)

    def step(self, token_ids, states=None):
        """Decode one token per row: ``token_ids`` ``[B]`` → ``(logits [B, V], states)``; ``states=None`` at start.

        ``states`` holds each layer's mixer state: constant in size for linear mixers, a KV cache for softmax.
        """
        states = list(states) if states is not None else [None] * len(self.layers)
        x = self.embed(token_ids)
        for i, block in enumerate(self.layers):
            x, states[i] = block.step(x, states[i])
        return self.lm_head(self.norm(x)), states

    def prefill(self, input_ids, starts=None):
        """A prompt ``[B, T]`` in one parallel pass → ``(logits of its last token [B, V], states)`` for ``step``;
        ``starts [B]``: prompts of different lengths, left-padded, row b's from column ``starts[b]``."""
        logits, states = self.forward_with_state(input_ids, last=1, starts=starts)
        return logits[:, 0], states

    def forward_with_state(self, input_ids, states=None, *, last: int = 0, starts=None):
        """``input_ids [B, T]`` continuing from ``states`` (None: from the start) → ``(logits, states after them)``;
        the logits of every token ``[B, T, V]``, or of the ``last`` few.

        From the start the tokens go through each mixer's parallel ``prefill``; after a state, one at a time through
        ``step``, which every mixer has (decoding feeds one token at a time, so that is the path that counts).
        ``starts [B]`` (from the start only): prompts of different lengths, row b's beginning at column ``starts[b]``
        after left padding, each prefilled as if alone (``left_padded.py``; the pads' logits are zeros).
        """
        if starts is not None:
            if states is not None:
                raise ValueError("starts (left-padded prompts) apply from the start only; a state goes on from each "
                                 "row's own tokens")
            return prefill_left_padded(self, input_ids, starts, last=last)
        x = self.embed(input_ids)
        if states is None:
            states = []
            for block in self.layers:
                x, state = block.prefill(x)
                states.append(state)
        else:
            states, outputs = list(states), []
            for x_t in x.unbind(dim=1):
                for i, block in enumerate(self.layers):
                    x_t, states[i] = block.step(x_t, states[i])
                outputs.append(x_t)
            x = torch.stack(outputs, dim=1)
        return self.lm_head(self.norm(x[:, -last:] if last else x)), states

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token (a multiply-add = 2): every mixer and FFN, plus the LM head; training ≈ 3×."""
        return sum(self.flops_by_part(seq_len).values())

    def flops_by_part(self, seq_len: int) -> dict[str, float]:
        """``flops_per_token`` by part: the layers of each mixer class together (its ``flops_per_token`` says what
        it counts), the feed-forwards (by class too), the LM head. The embedding is a lookup: no FLOPs."""
        parts: dict[str, float] = {}
        for block in self.layers:
            for module, flops in ((block.mixer, block.mixer.flops_per_token(seq_len)),
                                  (block.ffn, block.ffn.flops_per_token())):
                name = type(module).__name__
                parts[name] = parts.get(name, 0.0) + flops
        parts["LMHead"] = 2.0 * self.lm_head.in_features * self.lm_head.out_features
        return parts


def build_lm(model_cfg: ModelConfig) -> CausalLM:
    """The causal LM described by a ``ModelConfig`` (``vocab_size`` already resolved). A loaded config's node
    converts with ``OmegaConf.to_object(cfg.model)``: the model takes plain values, never OmegaConf nodes."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"build_lm takes a pretrain.config.ModelConfig, got {type(model_cfg).__name__}; "
                        "convert a loaded config with OmegaConf.to_object(cfg.model)")
    return CausalLM(model_cfg)
