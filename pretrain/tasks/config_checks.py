"""The config checks that need the model or the data, run once before any work starts.

``pretrain.config`` checks each key on its own and imports nothing of ours; what only the layers above it can
judge lives here: every mixer a run names is registered, takes its options and builds (on the meta device, so no
memory is spent), ``model.vocab_size`` comes from the tokenizer and ``vision.num_classes`` from the shards'
manifest when they are 0. Every error is still a ``ConfigError`` naming the key to change. ``launch/pretrain.py``
and the tools load configs through ``load_run_config``.
"""
import os
from collections.abc import Collection, Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from pretrain.attention import REGISTRY, build_mixer, mixer_options
from pretrain.config import VISION_STAGES, ConfigError, load_config, require
from pretrain.data import Tokenizer
from pretrain.data.shards import ShardError, is_streamed, load_manifest
from pretrain.models.lm import mixer_kwargs
from pretrain.models.vision import build_vision_model, stage_options
from pretrain.tasks.recall import check_recall_config


def load_run_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), *,
                    foreign_keys: Collection[str] = ()) -> DictConfig:
    """``pretrain.config.load_config``, then the checks of the run's task below: the config a run can start from."""
    cfg = load_config(path, overrides, foreign_keys=foreign_keys)
    check_run_config(cfg)
    return cfg


def check_run_config(cfg: DictConfig) -> None:
    """Refuse what the model or data cannot do, naming the key; fill ``model.vocab_size`` / ``vision.num_classes``
    when they are 0."""
    if cfg.task == "lm":
        check_mixer_options(cfg.model)
        _check_lm_mixers(cfg)
        _resolve_vocab_size(cfg)
    elif cfg.task == "recall":  # a causal LM on generated MQAR rows
        check_mixer_options(cfg.model)
        _check_lm_mixers(cfg)
        check_recall_config(cfg)
    else:
        check_mixer_options(cfg.model, stages=VISION_STAGES)
        _check_stage_mixers(cfg)
        _resolve_num_classes(cfg)
        _build_backbone_on_meta(cfg)


def check_mixer_options(model: DictConfig, *, stages: int | None = None) -> None:
    """Every ``model.mixer_options`` entry names a registered mixer and options it takes, of the default's type.

    A staged model (the vision backbone, ``stages`` of them) also takes a list with one such value per stage.
    """
    registered = ", ".join(sorted(REGISTRY)) or "none"
    for name, options in model.mixer_options.items():
        if name not in REGISTRY:
            raise ConfigError(f"model.mixer_options.{name}", f"no mixer {name!r}; registered: {registered}")
        known = mixer_options(name)
        for option, value in options.items():
            key = f"model.mixer_options.{name}.{option}"
            if option not in known:
                raise ConfigError(key, f"unknown option; {name!r} takes {sorted(known)}")
            default = known[option]
            per_stage = stages is not None and OmegaConf.is_list(value) and not isinstance(default, (list, tuple))
            if per_stage and len(value) != stages:
                raise ConfigError(key, f"a per-stage list needs {stages} entries, one per stage; got {len(value)}")
            if not all(_same_type(v, default) for v in (value if per_stage else [value])):
                per = " (or a list of them, one per stage)" if stages is not None else ""
                raise ConfigError(key, f"{value!r} should be a {type(default).__name__}{per} like the default "
                                       f"{default!r}")


def _same_type(value: Any, default: Any) -> bool:
    """Does ``value`` fit an option whose default is ``default``? Simple defaults only; the mixer checks the rest."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (int, str)):
        return type(value) is type(default)
    return True


def _check_lm_mixers(cfg: DictConfig) -> None:
    """Every mixer the LM names is registered and causal and builds with its options; under sequence parallelism
    it can take a slice of a row; a mixer with a longest sequence (``max_seq_len``, e.g. aft_full's position bias)
    covers ``train.seq_len``."""
    model, seq_len, sequence_parallel = cfg.model, cfg.train.seq_len, cfg.parallel.sequence_parallel
    registered = ", ".join(sorted(REGISTRY)) or "none"
    named = [("model.mixer", model.mixer)]
    named += [(f"model.layer_pattern[{i}]", name) for i, name in enumerate(model.layer_pattern)]
    for key, name in named:
        if name not in REGISTRY:
            raise ConfigError(key, f"mixer {name!r} is not registered (yet); registered: {registered}")
        if not REGISTRY[name].supports_causal:
            raise ConfigError(key, f"mixer {name!r} has no causal form, and a causal LM needs one")
    for name in dict.fromkeys(list(model.layer_pattern) or [model.mixer]):
        try:
            with torch.device("meta"):
                mixer = build_mixer(name, model.dim, model.n_heads, causal=True,
                                    options=mixer_kwargs(OmegaConf.to_object(model), name))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"model.mixer_options.{name}", f"mixer {name!r} cannot be built: {err}") from None
        if sequence_parallel > 1:
            try:
                mixer.check_sequence_parallel(sequence_parallel, seq_len // sequence_parallel)
            except ValueError as err:
                raise ConfigError("parallel.sequence_parallel", f"mixer {name!r} cannot split rows into "
                                  f"{sequence_parallel} slices: {err}") from None
        longest = getattr(mixer, "max_seq_len", None)
        if longest is not None and seq_len > longest:
            raise ConfigError(f"model.mixer_options.{name}.max_seq_len",
                              f"{longest} is shorter than train.seq_len {seq_len}: {name!r} has no form beyond it")


def _resolve_vocab_size(cfg: DictConfig) -> None:
    """Fill ``model.vocab_size`` from the tokenizer when 0; refuse an explicit size smaller than its vocabulary."""
    if not os.path.isfile(cfg.data.tokenizer):
        return  # the dry run needs no tokenizer when vocab_size is given; build_lm refuses a 0 left here
    try:
        tokenizer_vocab = Tokenizer(cfg.data.tokenizer).vocab_size
    except (OSError, ValueError) as err:
        raise ConfigError("data.tokenizer", f"cannot load sentencepiece model {cfg.data.tokenizer}: {err}") from None
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer_vocab
    require(cfg, "model.vocab_size", cfg.model.vocab_size >= tokenizer_vocab,
            f"{cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")


def _check_stage_mixers(cfg: DictConfig) -> None:
    """Each stage's mixer is registered and builds non-causal at that stage's width with its options."""
    v = cfg.vision
    for i, (name, dim, heads) in enumerate(zip(v.stage_mixers, v.stage_dims, v.stage_heads)):
        if name not in REGISTRY:
            raise ConfigError(f"vision.stage_mixers[{i}]",
                              f"mixer {name!r} is not registered; registered: {', '.join(sorted(REGISTRY))}")
        try:
            with torch.device("meta"):
                options = stage_options(OmegaConf.to_object(cfg.model), name, i, VISION_STAGES)
                build_mixer(name, dim, heads, causal=False, options=options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"model.mixer_options.{name}",
                              f"mixer {name!r} cannot be built for stage {i} (dim {dim}, {heads} heads): {err}"
                              ) from None


def _manifest_classes(train_shards: str) -> list[str] | None:
    """Class names from the manifest of the training shards' directory (the pattern's folder), or None."""
    directory = train_shards if os.path.isdir(train_shards) else os.path.dirname(train_shards)
    try:
        return load_manifest(directory or ".").get("classes")
    except ShardError:
        return None


def _resolve_num_classes(cfg: DictConfig) -> None:
    """``vision.num_classes: 0`` → the number of classes the training shards' manifest lists; an explicit number
    smaller than that list is refused (labels would fall outside the head)."""
    classes = None if is_streamed(cfg.data.train_shards) else _manifest_classes(cfg.data.train_shards)
    if cfg.vision.num_classes == 0:
        if not classes:
            raise ConfigError("data.train_shards", f"no manifest.json with 'classes' beside {cfg.data.train_shards} "
                                                   "(made by tools/make_shards.py images); set vision.num_classes")
        cfg.vision.num_classes = len(classes)
    require(cfg, "vision.num_classes", classes is None or cfg.vision.num_classes >= len(classes),
            f"is smaller than the {len(classes or [])} classes of data.train_shards' manifest")


def _build_backbone_on_meta(cfg: DictConfig) -> None:
    """The whole backbone on the meta device: shapes only, no memory; what the stage checks missed fails here."""
    try:
        with torch.device("meta"):
            build_vision_model(OmegaConf.to_object(cfg.vision), OmegaConf.to_object(cfg.model))
    except (ValueError, TypeError) as err:
        raise ConfigError("vision", f"the backbone cannot be built: {err}") from None
