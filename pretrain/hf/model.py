"""``PretrainForCausalLM``: our causal LM as a transformers model, and the cache that carries its mixers' states.

No second model definition: the module tree is ``build_lm``'s own (``embed``, ``layers``, ``norm``, ``lm_head``),
so the safetensors keys are those ``tools/export.py`` writes and ``load_pretrained`` reads, and the forward passes
are ``CausalLM``'s methods, run on this module.

Decoding keeps each layer's state as its mixer returns it (a KV cache for softmax, ``S``/``z`` and convolution
tails for the linear-state mixers, whatever a new mixer keeps): ``MixerStateCache`` holds them unopened, so
``model.generate`` decodes a new token in the time of one ``step`` whatever the prompt's length, and a new mixer
needs nothing here.

Prompts of different lengths are decoded together padded on the left (what transformers' ``generate`` and
lm-evaluation-harness's generative tasks send): each row's prompt is prefilled alone, so no pad enters a state
(``pretrain.models.left_padded``), and each row decodes at its own positions. A forward without a cache also
accepts right padding (what lm-evaluation-harness sends to score), whose pads come after every real token and so
change none of their logits; left pads are there a document of their own, apart from the row's tokens.
"""
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map
from transformers import Cache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.lm import CausalLM, build_lm
from ..models.pretrained import TRANSFORMERS_KEYS, TRANSFORMERS_MODULE, TRANSFORMERS_MODULE_SOURCE
from .config import PretrainConfig

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class MixerStateCache(Cache):
    """Each layer's decoding state, as its mixer's ``prefill``/``step`` left it, and how many tokens it has seen.

    The states are opaque here; the one thing relied on (docs/CONTRACTS.md, "Token mixers") is that every tensor
    in a state has the batch as its first dimension, so beam search can pick rows. A recurrent state cannot be
    rolled back, so cropping (assisted decoding) is refused.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__(layers=[])
        self.states: list | None = None  # one per layer; None before the first tokens
        self.seen = 0  # columns, pads included
        self.pads: torch.Tensor | None = None  # each row's left pads [B] (prompts of different lengths), else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def is_linear(self) -> list[bool]:
        """False: transformers then hands over only the tokens past ``get_seq_length`` when a cache is reused."""
        return [False] * len(self.states or [])

    def reset(self) -> None:
        self.states, self.seen, self.pads = None, 0, None

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a recurrent mixer state cannot be rolled back: MixerStateCache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_rows(self, rows):
        self.states, self.pads = tree_map(lambda leaf: rows(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                                          (self.states, self.pads))


class PretrainForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PretrainConfig
    base_model_prefix = ""
    _input_embed_layer = "embed"
    _tied_weights_keys = {"lm_head.weight": "embed.weight"}  # tied when config.tie_word_embeddings (model section)
    _is_stateful = True  # transformers refuses assisted decoding, which would roll states back

    # CausalLM's own passes, run on this module, which holds its submodules under the same names
    _forward_lm = CausalLM.forward
    forward_with_state = CausalLM.forward_with_state

    def __init__(self, config: PretrainConfig):
        super().__init__(config)
        if config.model is None:
            raise ValueError("PretrainConfig has no 'model' section: load an exported directory (tools/export.py)")
        for name, module in build_lm(config.lm_config()).named_children():
            self.add_module(name, module)
        # the special ids an exported config.json gives transformers' generation config, for a model built from a
        # config alone too (from_config)
        self.generation_config.update(**{key: TRANSFORMERS_KEYS[key] for key in SPECIAL_IDS})
        self.post_init()

    def _init_weights(self, module):
        """Nothing: ``build_lm`` initialised every weight already (``pretrain.models.layers.init_weights``)."""

    def get_output_embeddings(self):
        return self.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward makes its own MixerStateCache

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: MixerStateCache | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, **unused) -> CausalLMOutputWithPast:
        """Logits of ``input_ids [B, T]`` (of the last ``logits_to_keep`` tokens when > 0).

        With ``use_cache`` (or a ``cache``) the tokens continue the cache's states and the cache comes back
        holding the states after them; without, one parallel forward (``position_ids``, if given, restart at 0 at
        each packed document). ``labels`` are the inputs themselves, shifted inside (transformers' convention):
        the loss is the mean NLL of ``labels[:, 1:]`` given the tokens before, -100 not scored. Other keywords
        transformers passes (``return_dict``, ...) change nothing; those asking for what this model does not give
        are refused.
        """
        for name in ("inputs_embeds", "output_attentions", "output_hidden_states"):
            if unused.get(name) not in (None, False):
                raise ValueError(f"PretrainForCausalLM does not support {name}")
        use_cache = cache is not None if use_cache is None else use_cache
        pads = _left_pads(attention_mask, input_ids.shape[0], decoding=use_cache)
        tokens = input_ids.shape[1]
        if use_cache:
            cache = cache if cache is not None else MixerStateCache()
            if cache.states is None:
                cache.pads = pads
            elif attention_mask is not None:
                _check_same_pads(pads, cache.pads)
            expected = _row_positions(cache.seen, tokens, cache.pads, input_ids.device)
            _check_positions(position_ids, expected, f"continue the cache's {cache.seen} tokens")
            starts = cache.pads if cache.states is None else None
            logits, cache.states = self.forward_with_state(input_ids, cache.states, last=logits_to_keep,
                                                           starts=starts)
            cache.seen += tokens
        else:
            if pads is not None:  # the left pads a document of their own, each row's tokens another from 0
                expected = _row_positions(0, tokens, pads, input_ids.device)
                _check_positions(position_ids, expected, "count each row's tokens from its first after the pads")
                position_ids = torch.where(expected >= 0, expected, torch.arange(tokens, device=input_ids.device))
            logits = self._forward_lm(input_ids, position_ids=position_ids)
            logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
            cache = None
        loss = None
        if labels is not None:
            if logits.shape[1] != labels.shape[1]:
                raise ValueError(f"labels of {labels.shape[1]} tokens need the logits of all of them; "
                                 f"logits_to_keep={logits_to_keep} kept {logits.shape[1]}")
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device))
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save, plus the module trust_remote_code loading imports (as ``tools/export.py`` writes)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        (Path(save_directory) / TRANSFORMERS_MODULE).write_text(TRANSFORMERS_MODULE_SOURCE, encoding="utf-8")


def _left_pads(attention_mask: torch.Tensor | None, batch: int, *, decoding: bool) -> torch.Tensor | None:
    """Each row's pads before its first real token ``[B]`` (None: no row has any), from a 0/1 ``attention_mask``
    whose rows are each one run of real tokens: left-padded, or right-padded where no state goes on after them
    (a forward without a cache). Holes, and right padding while decoding, are refused."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
        raise ValueError(f"attention_mask must be [batch, tokens] 0/1; got {tuple(attention_mask.shape)} for a "
                         f"batch of {batch}")
    mask = attention_mask.bool()
    pads, real = (mask.cumsum(1) == 0).sum(1), mask.sum(1)
    columns = torch.arange(mask.shape[1], device=mask.device)
    if (real == 0).any() or not torch.equal(mask, (columns >= pads[:, None]) & (columns < (pads + real)[:, None])):
        raise ValueError("attention_mask has a row without real tokens or a pad between two real tokens: each row "
                         "must be one run of real tokens, padded on the left (or, without a cache, on the right)")
    if decoding and (pads + real < mask.shape[1]).any():
        raise ValueError("PretrainForCausalLM decodes left-padded rows only: the attention mask has a pad after a real "
                         "token; pad on the left (tokenizer.padding_side = 'left', as generate expects)")
    return pads if pads.any() else None


def _row_positions(seen: int, tokens: int, pads: torch.Tensor | None, device) -> torch.Tensor:
    """``[B or 1, tokens]``: the positions of columns ``seen …`` in each row's own sequence (negative: a left pad)."""
    columns = torch.arange(seen, seen + tokens, device=device)[None]
    return columns if pads is None else columns - pads.to(device)[:, None]


def _check_same_pads(pads: torch.Tensor | None, cached: torch.Tensor | None) -> None:
    """A mask while decoding must pad each row as the prompt's did: the cache's states were prefilled so."""
    if (pads is None) != (cached is None) or (pads is not None and not torch.equal(pads, cached.to(pads.device))):
        describe = lambda p: "none" if p is None else p.tolist()
        raise ValueError(f"attention_mask's left pads per row ({describe(pads)}) are not those the cache's prompt "
                         f"had ({describe(cached)}): decode on with the mask the prompt was prefilled with")


def _check_positions(position_ids: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    """``position_ids`` must be each row's own positions (``expected``; those of the pads, negative there, are not
    read): decoding goes on from the states at the positions after their tokens."""
    if position_ids is None:
        return
    if position_ids.shape[-1] != expected.shape[-1] or ((position_ids != expected) & (expected >= 0)).any():
        raise ValueError(f"position_ids {position_ids.tolist()} do not {what}: expected "
                         f"{expected.clamp(min=-1).tolist()} (-1: a pad, any value)")
