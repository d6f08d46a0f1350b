"""The checks of ``task: vision`` configs (the ``vision:`` and ``augment:`` sections), and the class count.

Kept apart from ``pretrain.config`` so that module stays the schema plus the LM's checks; every error still names
the key to change. ``vision.num_classes: 0`` is filled from ``data.train_shards``' ``manifest.json``.
"""
import os

from omegaconf import DictConfig

from .config import ConfigError, require, validate_mixer_options

STAGES = 4  # the backbone's stages: the grid halves after each, so the output stride is patch_size·8


def validate_vision(cfg: DictConfig) -> None:
    """Refuse impossible vision and augmentation values naming the key; resolve ``vision.num_classes``; build the
    backbone on the meta device, so a mixer or option that cannot work fails here and not on the first batch."""
    v, a = cfg.vision, cfg.augment
    for key in ("vision.image_size", "vision.in_channels", "vision.patch_size", "vision.mlp_ratio"):
        require(cfg, key, _select(cfg, key) > 0, "must be > 0")
    require(cfg, "vision.num_classes", v.num_classes >= 0, "must be >= 0 (0: from the shards' manifest)")
    require(cfg, "vision.drop_path", 0 <= v.drop_path < 1, "must be in [0, 1)")
    stride = v.patch_size * 2 ** (STAGES - 1)
    require(cfg, "vision.image_size", v.image_size % stride == 0,
            f"must be a multiple of vision.patch_size·{2 ** (STAGES - 1)} = {stride} (the backbone's output stride)")
    for key in ("vision.stage_dims", "vision.stage_depths", "vision.stage_heads", "vision.stage_mixers"):
        require(cfg, key, len(_select(cfg, key)) == STAGES, f"needs one entry per stage ({STAGES})")
    for i, (dim, depth, heads) in enumerate(zip(v.stage_dims, v.stage_depths, v.stage_heads)):
        require(cfg, f"vision.stage_dims[{i}]", dim > 0, "must be > 0")
        require(cfg, f"vision.stage_depths[{i}]", depth > 0, "must be > 0")
        require(cfg, f"vision.stage_heads[{i}]", heads > 0 and dim % heads == 0,
                f"must be > 0 and divide vision.stage_dims[{i}] = {dim}")
    validate_mixer_options(cfg.model, stages=STAGES)
    _validate_stage_mixers(cfg)

    lo, hi = (list(a.crop_scale) + [None, None])[:2]
    require(cfg, "augment.crop_scale", len(a.crop_scale) == 2 and 0 < lo <= hi <= 1,
            "must be two numbers [min, max] with 0 < min <= max <= 1")
    require(cfg, "augment.mixup_alpha", a.mixup_alpha >= 0, "must be >= 0 (0: off)")
    require(cfg, "augment.cutmix_alpha", a.cutmix_alpha >= 0, "must be >= 0 (0: off)")
    require(cfg, "augment.label_smoothing", 0 <= a.label_smoothing < 1, "must be in [0, 1)")
    require(cfg, "augment.eval_crop_ratio", 0 < a.eval_crop_ratio <= 1, "must be in (0, 1]")

    _resolve_num_classes(cfg)
    _build_on_meta(cfg)


def _select(cfg: DictConfig, key: str):
    section, name = key.split(".")
    return cfg[section][name]


def _validate_stage_mixers(cfg: DictConfig) -> None:
    """Each stage's mixer is registered and builds non-causal at that stage's width with its options."""
    import torch

    from .attention import REGISTRY, build_mixer
    from .models.vision import stage_options

    v = cfg.vision
    for i, (name, dim, heads) in enumerate(zip(v.stage_mixers, v.stage_dims, v.stage_heads)):
        if name not in REGISTRY:
            raise ConfigError(f"vision.stage_mixers[{i}]",
                              f"mixer {name!r} is not registered; registered: {', '.join(sorted(REGISTRY))}")
        try:
            with torch.device("meta"):
                build_mixer(name, dim, heads, causal=False, options=stage_options(cfg.model, name, i, STAGES))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"model.mixer_options.{name}",
                              f"mixer {name!r} cannot be built for stage {i} (dim {dim}, {heads} heads): {err}"
                              ) from None


def _manifest_classes(train_shards: str) -> list[str] | None:
    """Class names from the manifest of the training shards' directory (the pattern's folder), or None."""
    from .data.shards import ShardError, load_manifest

    directory = train_shards if os.path.isdir(train_shards) else os.path.dirname(train_shards)
    try:
        return load_manifest(directory or ".").get("classes")
    except ShardError:
        return None


def _resolve_num_classes(cfg: DictConfig) -> None:
    """``vision.num_classes: 0`` → the number of classes the training shards' manifest lists; an explicit number
    smaller than that list is refused (labels would fall outside the head)."""
    classes = None if cfg.data.train_shards.startswith("pipe:") else _manifest_classes(cfg.data.train_shards)
    if cfg.vision.num_classes == 0:
        if not classes:
            raise ConfigError("data.train_shards", f"no manifest.json with 'classes' beside {cfg.data.train_shards} "
                                                   "(made by tools/make_shards.py images); set vision.num_classes")
        cfg.vision.num_classes = len(classes)
    require(cfg, "vision.num_classes", classes is None or cfg.vision.num_classes >= len(classes),
            f"is smaller than the {len(classes or [])} classes of data.train_shards' manifest")


def _build_on_meta(cfg: DictConfig) -> None:
    """The whole backbone on the meta device: shapes only, no memory; what the stage checks missed fails here."""
    import torch

    from .models.vision import build_vision_model

    try:
        with torch.device("meta"):
            build_vision_model(cfg)
    except (ValueError, TypeError) as err:
        raise ConfigError("vision", f"the backbone cannot be built: {err}") from None
