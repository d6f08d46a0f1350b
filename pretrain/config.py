"""One structured schema for a run: every key typed, documented and checked before any work starts.

``load_config(path, overrides)`` merges a YAML file and dotted ``key=value`` overrides onto the schema below,
(a file may start from another with ``base: other.yaml``, a path relative to itself, and change a few keys),
refuses unknown keys, wrong types, missing values and impossible combinations with a ``ConfigError`` that names
the key. It imports nothing of ours but the leaf ``pretrain.atomic`` (and not DeepSpeed): the checks that need the
model or the data (mixers that build, ``model.vocab_size`` from the tokenizer, ``vision.num_classes`` from the
shards' manifest) live with the tasks, in ``pretrain.tasks.config_checks``, whose ``load_run_config`` runs both.
"""
import math
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .atomic import atomic_path


class ConfigError(ValueError):
    """A bad configuration; ``key`` is the dotted key (or file) at fault and leads the message."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class RunConfig:
    dir: str = "runs/default"  # everything the run makes: config.yaml, tensorboard/, checkpoints/
    seed: int = 0  # model init, data order and dropout all derive from it


@dataclass
class ModelConfig:  # the LM's keys; a vision run reads only init_std, norm_eps and mixer_options
    vocab_size: int = 0  # 0 → taken from the tokenizer (data.tokenizer) at load time
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # the block's feed-forward: swiglu, or rwkv_channel_mix (RWKV's token-shifted ReLU², docs/MIXERS.md#rwkv7)
    ffn: str = "swiglu"
    ffn_hidden: int = 0  # the feed-forward's width; 0 → swiglu 8/3·dim, rwkv_channel_mix 4·dim, up to multiple_of
    multiple_of: int = 64
    norm_eps: float = 1.0e-5
    tie_embeddings: bool = True  # LM head shares the embedding matrix
    rope_theta: float = 10000.0  # RoPE base for every mixer with a rope_theta option (softmax)
    init_std: float = 0.02  # N(0, init_std) weights; residual output projections scaled by 1/√(2·n_layers)
    mixer: str = "softmax"  # the default mixer of every layer (a name in pretrain.attention.REGISTRY)
    layer_pattern: list[str] = field(default_factory=list)  # e.g. [linear, linear, linear, softmax]; [] → [mixer]
    mixer_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per mixer name: {option: value}
    # > 0: each block's norm + feed-forward runs over slices of this many tokens, keeping only its input for
    # backward (pretrain/models/mini_sequence.py): same outputs and gradients, less memory per token; 0: off
    mini_sequence: int = 0


@dataclass
class DataConfig:
    tokenizer: str | None = MISSING  # PREFIX.model, a sentencepiece model (task lm; a vision run needs none)
    # a shard pattern (brace expansion, http(s):// ok), a list of patterns read as one, or a mixture (task lm): a list
    # of {shards: PATTERN, weight: W > 0}, shared out by weight (mix_by) (task recall generates its rows: none)
    train_shards: Any = MISSING
    # a mixture's weights share out: tokens (as NeoX and OLMo weigh them) or documents; a source's optional
    # `name:` (letters, digits, _ and -) names its counts in the metrics: train/<name>_tokens (default source<i>)
    mix_by: str = "tokens"
    val_shards: str | None = None
    allow_pipe: bool = False  # pipe: URLs run shell commands; refused unless true
    shuffle_buffer: int = 1000  # images a shuffle window holds at least (task vision)
    # the text rows' lanes (docs/CONTRACTS.md): a replica reads 1/gcd(replicas, lanes) of the shards, and a worker
    # holds a packed shard per lane it reads; a multiple of the number of data-parallel replicas at scale
    lanes: int = 64
    num_workers: int = 1
    skip_corrupt: bool = False  # true: a corrupt shard mid-run is logged, counted, skipped
    verify_shards: bool = False  # true: every training shard's sha256 against its manifest before step 1


@dataclass
class TrainConfig:
    seq_len: int = 1024  # tokens per row (task lm; unused by vision)
    micro_batch_size: int = 4  # per rank: rows of seq_len tokens, or images
    grad_accum_steps: int = 1
    max_steps: int = 1000
    grad_clip: float = 1.0  # max global gradient norm; 0 → no clipping
    max_nonfinite_steps: int = 5  # K non-finite losses in a row stop the run
    # a run directory (its latest checkpoint) or a tools/export.py directory: start from its weights only (new
    # optimizer, schedule and data position; seq_len may differ), for context extension and fine-tuning. A run
    # that has a checkpoint of its own resumes from it instead.
    init_from: str | None = None
    # true: each block compiled (torch.compile per block, pretrain/models/compile.py; our ops stay opaque custom ops)
    compile: bool = False


@dataclass
class OptimConfig:  # AdamW
    lr: float = 3.0e-4
    min_lr: float = 3.0e-5
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 100
    decay_steps: int = 0  # wsd's final decay (steps)


def fitted_warmup(warmup_steps: int, max_steps: int) -> int:
    """The warmup a run of ``max_steps`` gets: ``schedule.warmup_steps``, or, when that is longer than the whole
    run (a first ten-step try of a config made for hundreds), a tenth of the run, the share configs/tiny_lm.yaml
    gives it. Shortened rather than refused: the try should run; the trainer says so in one line."""
    return warmup_steps if warmup_steps <= max_steps else max(1, max_steps // 10)


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0  # 0..3: 1 shards optimizer states, 2 also gradients, 3 also weights
    precision: str = "fp32"  # fp32 | bf16 | fp16
    offload_optimizer: bool = False  # optimizer states in CPU memory (ZeRO ≥ 1)
    offload_params: bool = False  # weights in CPU memory (ZeRO 3)
    activation_checkpointing: bool = False  # recompute each block in backward (DeepSpeed's checkpointing)
    extra: dict[str, Any] = field(default_factory=dict)  # raw keys merged into the generated DeepSpeed JSON


@dataclass
class ParallelConfig:
    # ranks that split one sequence (task lm): each holds train.seq_len / N contiguous tokens of every row; the
    # world is world_size / N data-parallel replicas of N consecutive ranks (docs/SEQUENCE_PARALLEL.md)
    sequence_parallel: int = 1
    # seconds a collective may wait for the slowest rank before the run fails; null keeps DeepSpeed's default (10
    # minutes, or DEEPSPEED_TIMEOUT minutes). A resume's checkpoint conversion is waited for outside collectives
    collective_timeout_s: float | None = None


@dataclass
class LogConfig:
    every: int = 10  # steps between training-metric logs
    val_every: int = 200  # steps between validations
    val_batches: int = 20


@dataclass
class CheckpointConfig:
    every: int = 500  # steps between checkpoints
    keep_last: int = 3


VISION_STAGES = 4  # the backbone's stages: the grid halves after each, so the output stride is patch_size·8


@dataclass
class VisionConfig:  # task vision: a hierarchical backbone of four stages (pretrain/models/vision.py)
    image_size: int = 224  # training crop side (square); evaluation may use any resolution
    num_classes: int = 0  # 0 → len(classes) in data.train_shards' manifest.json
    in_channels: int = 3
    patch_size: int = 4  # stem stride; each later stage halves the grid (output stride patch_size·8)
    stage_dims: list[int] = field(default_factory=lambda: [64, 128, 320, 512])
    stage_depths: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    stage_heads: list[int] = field(default_factory=lambda: [1, 2, 5, 8])
    stage_mixers: list[str] = field(default_factory=lambda: ["soft", "soft", "soft", "softmax"])  # built non-causal
    mlp_ratio: float = 4.0  # MLP hidden width / stage dim
    drop_path: float = 0.1  # stochastic depth, rising linearly over the blocks to this rate


@dataclass
class AugmentConfig:  # task vision: training augmentation and loss smoothing
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # random resized crop's area range
    hflip: bool = True  # random horizontal flip
    mixup_alpha: float = 0.0  # Beta(α, α) mixing of image pairs in a batch; 0 = off
    cutmix_alpha: float = 0.0  # Beta(α, α) box pasted from another image of the batch; 0 = off (both on: one per batch)
    label_smoothing: float = 0.1  # target mass spread evenly over all classes
    eval_crop_ratio: float = 0.875  # eval: short side → image_size/ratio, then a centre crop; 1.0 → resize only


@dataclass
class RecallConfig:  # task recall: MQAR rows of train.seq_len tokens, generated from run.seed (pretrain/data/mqar.py)
    vocab_size: int = 8192  # keys from the lower half, values from the upper; model.vocab_size 0 → this
    num_pairs: int = 16  # key-value pairs per row, each queried once after them (needs train.seq_len >= 4·num_pairs)
    query_power: float = 0.01  # query gaps drawn ∝ gap^(power−1) as in Zoology: small → queries soon after the pairs
    # [] → one setting (train.seq_len, num_pairs); else [{seq_len: T, num_pairs: N}, ...]: each row packs examples of
    # one setting drawn per row (T must divide train.seq_len; num_pairs above is then unused), validated per setting
    mixture: list[Any] = field(default_factory=list)


@dataclass
class Config:
    task: str = "lm"  # lm (causal language model) | vision (image classification) | recall (MQAR, a causal LM)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)


CHOICES = {
    "task": ("lm", "vision", "recall"),
    "schedule.name": ("cosine", "wsd", "constant"),
    "deepspeed.precision": ("fp32", "bf16", "fp16"),
    "data.mix_by": ("tokens", "documents"),
    "model.ffn": ("swiglu", "rwkv_channel_mix"),
}


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), *,
                foreign_keys: Collection[str] = ()) -> DictConfig:
    """The validated config from a YAML file (None: the schema's defaults) and ``key=value`` overrides.

    ``foreign_keys``: top-level keys of the file that another reader owns, left out (the transformers keys of an
    exported config.json, ``pretrain.hf``).
    """
    cfg = OmegaConf.structured(Config)
    if path is not None:
        for layer, source in _read_with_bases(Path(path)):
            for key in foreign_keys:
                layer.pop(key, None)
            cfg = _merge(cfg, layer, where=f"in {source}")
    for override in overrides:
        if "=" not in override:
            raise ConfigError(override, "an override must look like dotted.key=value")
    cfg = _merge_overrides(cfg, list(overrides))
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(_key_of(err), f"cannot resolve interpolation: {str(err.msg).splitlines()[0]}") from None
    if cfg.task == "vision" and OmegaConf.is_missing(cfg.data, "tokenizer"):
        cfg.data.tokenizer = None  # images need no tokenizer
    if cfg.task == "recall":  # generated rows of token ids: neither a tokenizer nor shards
        for key in ("tokenizer", "train_shards"):
            if OmegaConf.is_missing(cfg.data, key):
                cfg.data[key] = None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(missing[0], f"no value given (missing: {', '.join(missing)}); set it as {missing[0]}=...")
    _validate(cfg)
    return cfg


def save_config(cfg: DictConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, atomically: a crash never leaves a half-written file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(cfg, resolve=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _read_with_bases(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[DictConfig, Path]]:
    """The YAML layers of ``path``, its ``base:`` chain first, each with the file it came from."""
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError(str(path), f"base: files include each other ({chain})")
    layer = _read_yaml(path)
    base = layer.pop("base", None)
    if base is None:
        return [(layer, path)]
    if not isinstance(base, str):
        raise ConfigError(f"base (in {path})", f"must be the path of a YAML file, got {base!r}")
    return [*_read_with_bases(path.parent / base, (*seen, resolved)), (layer, path)]


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(str(path), "config file not found")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # YAML syntax errors come in several types
        raise ConfigError(str(path), f"not valid YAML: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(str(path), "the top level of a config must be a mapping of keys")
    return loaded


def _merge_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The overrides merged at once (each merge copies the whole config: ~20 ms, paid by every rank of a launch);
    only when that fails are they merged one by one, to name the one at fault."""
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException:
        for override in overrides:
            cfg = _merge(cfg, OmegaConf.from_dotlist([override]), where=f"in override {override!r}")
        return cfg


def _merge(cfg: DictConfig, other: DictConfig, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, other)
    except OmegaConfBaseException as err:
        message = "unknown key" if type(err).__name__ == "ConfigKeyError" else str(err.msg).splitlines()[0]
        raise ConfigError(_key_of(err), f"{message} ({where})") from None


def _key_of(err: OmegaConfBaseException) -> str:
    return getattr(err, "full_key", None) or "<config>"


def _validate(cfg: DictConfig) -> None:
    """Impossible values and combinations, each reported under the key to change."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(key, f"{value!r} is not one of {', '.join(allowed)}")
    positive = ["model.dim", "model.n_layers", "model.n_heads", "model.multiple_of", "model.norm_eps",
                "model.init_std", "train.seq_len", "train.micro_batch_size", "train.grad_accum_steps",
                "train.max_steps", "train.max_nonfinite_steps", "data.lanes", "optim.lr", "optim.eps", "log.every",
                "log.val_every", "log.val_batches", "checkpoint.every", "checkpoint.keep_last"]
    non_negative = ["model.vocab_size", "model.ffn_hidden", "model.mini_sequence", "data.shuffle_buffer",
                    "data.num_workers", "train.grad_clip", "optim.min_lr", "optim.weight_decay",
                    "schedule.warmup_steps", "schedule.decay_steps"]
    for key in positive:
        require(cfg, key, OmegaConf.select(cfg, key) > 0, "must be > 0")
    for key in non_negative:
        require(cfg, key, OmegaConf.select(cfg, key) >= 0, "must be >= 0")

    sp = cfg.parallel.sequence_parallel
    require(cfg, "parallel.sequence_parallel", sp >= 1, "must be >= 1")
    require(cfg, "parallel.sequence_parallel", sp == 1 or cfg.task == "lm",
            "splits LM rows; task vision has none and task recall trains whole rows")
    require(cfg, "parallel.sequence_parallel", cfg.train.seq_len % sp == 0,
            f"must divide train.seq_len {cfg.train.seq_len} (each rank holds an equal slice)")
    timeout = cfg.parallel.collective_timeout_s
    require(cfg, "parallel.collective_timeout_s", timeout is None or timeout > 0, "must be > 0 (or null)")
    require(cfg, "model.ffn", cfg.model.ffn != "rwkv_channel_mix" or sp == 1,
            f"rwkv_channel_mix does not combine with parallel.sequence_parallel {sp}: its token shift reads the "
            "previous slice's last token, which crosses no rank outside a mixer; use swiglu, or sequence_parallel 1")

    require(cfg, "train.compile", not (cfg.train.compile and sp > 1),
            f"does not combine with parallel.sequence_parallel {sp}: a mixer on a slice exchanges states with the "
            "other ranks inside its forward, which a compiled block cannot hold; set one of them off")
    require(cfg, "train.compile", not (cfg.train.compile and cfg.deepspeed.zero_stage == 3),
            "does not combine with deepspeed.zero_stage 3: ZeRO-3 gathers each module's weights in hooks the compiler "
            "may not trace, which would break every block's graph; use zero_stage 0, 1 or 2, or compile false")

    model = cfg.model
    if cfg.task in ("lm", "recall"):  # both are causal LMs
        require(cfg, "data.tokenizer", cfg.task != "lm" or cfg.data.tokenizer is not None,
                "task lm needs a sentencepiece model")
        require(cfg, "model.n_heads", model.dim % model.n_heads == 0,
                 f"model.dim {model.dim} must be divisible by model.n_heads {model.n_heads}")
        require(cfg, "model.layer_pattern",
                 not model.layer_pattern or model.n_layers % len(model.layer_pattern) == 0,
                 f"model.n_layers {model.n_layers} must be a multiple of the pattern length {len(model.layer_pattern)}")
    else:
        require(cfg, "model.mini_sequence", model.mini_sequence == 0,
                f"slices the rows of a causal LM's blocks; task {cfg.task} has no rows (set 0)")
        require(cfg, "model.ffn", model.ffn == "swiglu",
                f"{model.ffn!r} is a causal LM's feed-forward (its token shift reads the token before); task "
                f"{cfg.task}'s blocks use swiglu")
        _validate_vision(cfg)

    require(cfg, "optim.min_lr", cfg.optim.min_lr <= cfg.optim.lr, "must not exceed optim.lr")
    require(cfg, "optim.betas", len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas),
             "must be two numbers in [0, 1)")
    sched, steps = cfg.schedule, cfg.train.max_steps
    if sched.name == "wsd":
        require(cfg, "schedule.decay_steps", 0 < sched.decay_steps <= steps - fitted_warmup(sched.warmup_steps, steps),
                 "wsd needs 0 < decay_steps <= train.max_steps - schedule.warmup_steps")

    ds = cfg.deepspeed
    require(cfg, "deepspeed.zero_stage", 0 <= ds.zero_stage <= 3, "must be 0, 1, 2 or 3")
    require(cfg, "deepspeed.offload_optimizer", not ds.offload_optimizer or ds.zero_stage >= 1,
             "needs deepspeed.zero_stage >= 1")
    require(cfg, "deepspeed.offload_params", not ds.offload_params or ds.zero_stage == 3,
             "needs deepspeed.zero_stage 3")

    for key, shards in [*_train_shard_patterns(cfg), ("data.val_shards", cfg.data.val_shards)]:
        if not cfg.data.allow_pipe and (shards or "").startswith("pipe:"):
            raise ConfigError(key, f"pipe: URLs run shell commands; set data.allow_pipe=true to allow them "
                                   f"(got {shards!r})")


def _train_shard_patterns(cfg: DictConfig) -> list[tuple[str, str | None]]:
    """(key, pattern) of each pattern ``data.train_shards`` names, its form checked: one pattern, a list of them,
    or a mixture's sources ``{shards, weight}`` (weights > 0), each fault named by its entry's key."""
    key, value = "data.train_shards", cfg.data.train_shards
    if value is None or isinstance(value, str):
        return [(key, value)]
    if not isinstance(value, ListConfig) or len(value) == 0:
        raise ConfigError(key, f"expected a shard pattern, a list of patterns or a list of {{shards, weight}} "
                               f"sources (got {value!r})")
    require(cfg, key, cfg.task == "lm", f"task {cfg.task} reads one shard pattern (a string); lists need task lm")
    if all(isinstance(entry, str) for entry in value):
        return [(f"{key}[{i}]", entry) for i, entry in enumerate(value)]
    patterns, names = [], set()
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, DictConfig):
            raise ConfigError(where, f"expected {{shards: PATTERN, weight: NUMBER}}, as every entry of a mixture "
                                     f"(got {entry!r})")
        unknown = sorted(set(entry) - {"shards", "weight", "name"})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", "unknown key (a source has shards, weight and a name)")
        name = entry.get("name", f"source{i}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name in names:
            raise ConfigError(f"{where}.name", f"expected a name of letters, digits, _ and -, unique in the mixture "
                                               f"(got {name!r})")
        names.add(name)
        shards, weight = entry.get("shards"), entry.get("weight")
        if not isinstance(shards, str) or not shards.strip():
            raise ConfigError(f"{where}.shards", f"expected a shard pattern (got {shards!r})")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not (math.isfinite(weight)
                                                                                    and weight > 0):
            raise ConfigError(f"{where}.weight", f"must be a number > 0 (got {weight!r})")
        patterns.append((f"{where}.shards", shards))
    return patterns


def train_shard_sources(value: Any) -> str | list[tuple[str, float, str]] | None:
    """A checked ``data.train_shards`` as the data layer takes it: one pattern (a list of patterns joined by
    ``::``), or a mixture's (pattern, weight, name) sources (``source<i>`` when unnamed)."""
    if value is None or isinstance(value, str):
        return value
    if all(isinstance(entry, str) for entry in value):
        return "::".join(value)
    return [(entry["shards"], float(entry["weight"]), entry.get("name", f"source{i}")) for i, entry in enumerate(value)]


def _validate_vision(cfg: DictConfig) -> None:
    """The ``vision:`` and ``augment:`` sections: one entry per stage, sizes the backbone can take, sane rates."""
    v, a = cfg.vision, cfg.augment
    for key in ("vision.image_size", "vision.in_channels", "vision.patch_size", "vision.mlp_ratio"):
        require(cfg, key, OmegaConf.select(cfg, key) > 0, "must be > 0")
    require(cfg, "vision.num_classes", v.num_classes >= 0, "must be >= 0 (0: from the shards' manifest)")
    require(cfg, "vision.drop_path", 0 <= v.drop_path < 1, "must be in [0, 1)")
    stride = v.patch_size * 2 ** (VISION_STAGES - 1)
    require(cfg, "vision.image_size", v.image_size % stride == 0,
            f"must be a multiple of vision.patch_size·{2 ** (VISION_STAGES - 1)} = {stride} (the output stride)")
    for key in ("vision.stage_dims", "vision.stage_depths", "vision.stage_heads", "vision.stage_mixers"):
        require(cfg, key, len(OmegaConf.select(cfg, key)) == VISION_STAGES,
                f"needs one entry per stage ({VISION_STAGES})")
    for i, (dim, depth, heads) in enumerate(zip(v.stage_dims, v.stage_depths, v.stage_heads)):
        require(cfg, f"vision.stage_dims[{i}]", dim > 0, "must be > 0")
        require(cfg, f"vision.stage_depths[{i}]", depth > 0, "must be > 0")
        require(cfg, f"vision.stage_heads[{i}]", heads > 0 and dim % heads == 0,
                f"must be > 0 and divide vision.stage_dims[{i}] = {dim}")

    lo, hi = (list(a.crop_scale) + [None, None])[:2]
    require(cfg, "augment.crop_scale", len(a.crop_scale) == 2 and 0 < lo <= hi <= 1,
            "must be two numbers [min, max] with 0 < min <= max <= 1")
    require(cfg, "augment.mixup_alpha", a.mixup_alpha >= 0, "must be >= 0 (0: off)")
    require(cfg, "augment.cutmix_alpha", a.cutmix_alpha >= 0, "must be >= 0 (0: off)")
    require(cfg, "augment.label_smoothing", 0 <= a.label_smoothing < 1, "must be in [0, 1)")
    require(cfg, "augment.eval_crop_ratio", 0 < a.eval_crop_ratio <= 1, "must be in (0, 1]")


def require(cfg: DictConfig, key: str, ok: bool, message: str) -> None:
    """Raise a ``ConfigError`` naming ``key`` (and its value) unless ``ok``."""
    if not ok:
        raise ConfigError(key, f"{message} (got {OmegaConf.select(cfg, key)!r})")
