"""The config schema: YAML + overrides, every bad input refused naming its key, vocab from a real tokenizer."""
from pathlib import Path
from typing import ClassVar

import pytest
import sentencepiece
from omegaconf import OmegaConf
from torch import nn

from pretrain.attention import REGISTRY
from pretrain.config import ConfigError, load_config, save_config
from pretrain.tasks.config_checks import load_run_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DATA = ["data.tokenizer=tok.model", "data.train_shards=shards/shard-{000000..000003}.tar"]


def load(*overrides, path=None):
    return load_run_config(path, [*DATA, *overrides])


def refused(key, *overrides, path=None):
    """Loading fails with a ConfigError naming ``key``; returns the message for further checks."""
    with pytest.raises(ConfigError) as err:
        load(*overrides, path=path)
    assert err.value.key == key and str(err.value).startswith(f"{key}:")
    return str(err.value)


class WholeSequenceMixer(nn.Module):
    """A non-causal mixer (like SOFT): a causal LM must refuse it."""

    supports_causal: ClassVar[bool] = False

    def __init__(self, dim, num_heads, *, causal=True):
        super().__init__()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A real sentencepiece model (vocabulary 40) trained on generated text."""
    out = tmp_path_factory.mktemp("tok")
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = out / "corpus.txt"
    text.write_text("\n".join(" ".join(words[(i * j) % 8] for j in range(12)) for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(out / "sp"), vocab_size=40,
                                             model_type="bpe", minloglevel=2)
    return out / "sp.model"


def test_defaults_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {dim: 64, n_heads: 2}\ntrain: {seq_len: 128}\nrun: {dir: \"runs/${model.mixer}_x\"}\n")
    cfg = load("train.seq_len=256", "optim.betas=[0.8,0.99]", path=path)
    assert cfg.model.dim == 64 and cfg.model.n_layers == 4  # YAML over the schema's defaults
    assert cfg.train.seq_len == 256 and list(cfg.optim.betas) == [0.8, 0.99]  # overrides over YAML
    assert cfg.run.dir == "runs/softmax_x"  # interpolations resolved
    assert cfg.data.train_shards == "shards/shard-{000000..000003}.tar"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("**/*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_configs_load(path):
    cfg = load_run_config(path, [])
    assert cfg.task in ("lm", "vision", "recall") and cfg.train.max_steps > 0


def test_a_config_starts_from_its_base_and_changes_a_few_keys(tmp_path):
    (tmp_path / "family").mkdir()
    (tmp_path / "root.yaml").write_text("model: {dim: 64, n_heads: 2, mixer: linear}\ntrain: {seq_len: 128}\n")
    (tmp_path / "family" / "mid.yaml").write_text("base: ../root.yaml\nmodel: {n_layers: 2}\n")
    (tmp_path / "family" / "leaf.yaml").write_text("base: mid.yaml\nmodel: {mixer: cosine}\n")
    cfg = load("train.seq_len=64", path=tmp_path / "family" / "leaf.yaml")
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.mixer, cfg.train.seq_len) == (64, 2, "cosine", 64)
    assert "base" not in cfg


def test_bad_bases_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="include each other"):
        load(path=tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: absent.yaml\n")
    with pytest.raises(ConfigError, match="absent.yaml: config file not found"):
        load(path=tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: 3\nmodel: {colour: red}\n")
    with pytest.raises(ConfigError, match="base"):
        load(path=tmp_path / "d.yaml")


@pytest.mark.parametrize("override, key", [
    ("model.colour=blue", "model.colour"),
    ("trian.seq_len=3", "trian"),
    ("model.dim=wide", "model.dim"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("deepspeed.offload_optimizer=perhaps", "deepspeed.offload_optimizer"),
    ("optim.betas=0.9", "optim.betas"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, key):
    refused(key, override)


def test_override_without_equals_sign_is_refused():
    refused("train.seq_len", "train.seq_len")


def test_missing_values_name_the_key():
    with pytest.raises(ConfigError, match="data.train_shards: no value given"):
        load_run_config(None, ["data.tokenizer=tok.model"])


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(tmp_path / "absent.yaml", [])
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {dim: [64\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_run_config(broken, [])
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml: the top level"):
        load_run_config(listing, [])


def test_unknown_key_in_yaml_names_key_and_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("deepspeed: {zero_stag: 2}\n")
    assert "typo.yaml" in refused("deepspeed.zero_stag", path=path)


@pytest.mark.parametrize("overrides, key", [
    (["task=audio"], "task"),
    (["deepspeed.precision=fp8"], "deepspeed.precision"),
    (["schedule.name=linear"], "schedule.name"),
    (["model.n_heads=3"], "model.n_heads"),
    (["model.dim=0"], "model.dim"),
    (["train.seq_len=-1"], "train.seq_len"),
    (["optim.min_lr=1.0", "optim.lr=0.1"], "optim.min_lr"),
    (["optim.betas=[0.9,1.5]"], "optim.betas"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["schedule.name=wsd", "schedule.decay_steps=0"], "schedule.decay_steps"),
    (["deepspeed.zero_stage=4"], "deepspeed.zero_stage"),
    (["deepspeed.offload_optimizer=true", "deepspeed.zero_stage=0"], "deepspeed.offload_optimizer"),
    (["deepspeed.offload_params=true", "deepspeed.zero_stage=2"], "deepspeed.offload_params"),
    (["data.train_shards=pipe:curl -s http://x/{0..3}.tar"], "data.train_shards"),
    (["data.val_shards=pipe:cat v.tar"], "data.val_shards"),
    (["model.n_layers=6", "model.layer_pattern=[softmax,softmax,softmax,softmax]"], "model.layer_pattern"),
])
def test_impossible_values_and_combinations_name_the_key(overrides, key):
    refused(key, *overrides)


def test_a_first_short_try_of_a_config_is_not_refused_for_its_warmup():
    """configs/tiny_lm.yaml warms up over 30 steps; a newcomer's ten-step try was refused for it (the schedule
    shortens the warmup instead: tests/train/test_schedule.py), and so was wsd's decay that fits the shortened one."""
    assert load_config(CONFIGS / "tiny_lm.yaml", ["train.max_steps=10"]).schedule.warmup_steps == 30
    load_config(CONFIGS / "tiny_lm.yaml", ["train.max_steps=10", "schedule.name=wsd", "schedule.decay_steps=9"])
    refused("schedule.decay_steps", "train.max_steps=10", "schedule.warmup_steps=30", "schedule.name=wsd",
            "schedule.decay_steps=10")


def test_pipe_urls_pass_when_allowed():
    assert load("data.train_shards=pipe:cat a.tar", "data.allow_pipe=true").data.allow_pipe


def test_unregistered_mixers_name_their_key():
    assert "registered: " in refused("model.mixer", "model.mixer=nonexistent")
    refused("model.layer_pattern[1]", "model.n_layers=2", "model.layer_pattern=[softmax,nonexistent]")
    refused("model.mixer_options.nonexistent", "model.mixer_options.nonexistent.width=3")


def test_the_schema_alone_checks_keys_and_the_run_checks_add_model_and_data(tokenizer):
    """pretrain.config knows no mixer and reads no tokenizer; load_run_config adds both, on the same config."""
    overrides = [f"data.tokenizer={tokenizer}", "data.train_shards=x.tar", "model.mixer=nonexistent"]
    schema_only = load_config(None, overrides)
    assert schema_only.model.mixer == "nonexistent" and schema_only.model.vocab_size == 0
    with pytest.raises(ConfigError, match="model.mixer"):
        load_run_config(None, overrides)
    assert load_run_config(None, overrides[:2]).model.vocab_size == 40


def test_non_causal_mixer_is_refused_by_a_causal_lm(monkeypatch):
    monkeypatch.setitem(REGISTRY, "whole_sequence", WholeSequenceMixer)
    assert "no causal form" in refused("model.mixer", "model.mixer=whole_sequence")
    refused("model.layer_pattern[3]", "model.layer_pattern=[softmax,softmax,softmax,whole_sequence]")


def test_mixer_options_are_checked_by_name_type_and_construction():
    assert "qk_norm" in refused("model.mixer_options.softmax.rope_thetta", "model.mixer_options.softmax.rope_thetta=5")
    refused("model.mixer_options.softmax.qk_norm", "model.mixer_options.softmax.qk_norm=maybe")
    refused("model.mixer_options.softmax.rope_theta", "model.mixer_options.softmax.rope_theta=big")
    message = refused("model.mixer_options.softmax", "model.dim=36", "model.n_heads=4")  # head dim 9: odd
    assert "even head dimension" in message
    assert "impl must be one of" in refused("model.mixer_options.softmax", "model.mixer_options.softmax.impl=flex")
    cfg = load("model.mixer_options.softmax.rope_theta=500000", "model.mixer_options.softmax.qk_norm=true",
               "model.mixer_options.softmax.impl=varlen")
    assert cfg.model.mixer_options.softmax == {"rope_theta": 500000, "qk_norm": True, "impl": "varlen"}


def test_a_mixer_shorter_than_the_sequence_is_refused_at_load_time():
    """aft_full has a position bias only up to its max_seq_len: a longer train.seq_len fails before any work."""
    message = refused("model.mixer_options.aft_full.max_seq_len", "model.mixer=aft_full", "train.seq_len=512",
                      "model.mixer_options.aft_full.max_seq_len=256")
    assert "train.seq_len 512" in message
    assert load("model.mixer=aft_full", "train.seq_len=256", "model.mixer_options.aft_full.max_seq_len=256")


def test_vocab_size_comes_from_the_tokenizer(tokenizer):
    cfg = load_run_config(None, [f"data.tokenizer={tokenizer}", "data.train_shards=x.tar"])
    assert cfg.model.vocab_size == 40
    assert load_run_config(None, [f"data.tokenizer={tokenizer}", "data.train_shards=x.tar",
                              "model.vocab_size=64"]).model.vocab_size == 64  # padded up is fine
    with pytest.raises(ConfigError, match="model.vocab_size: 32 is smaller than the tokenizer's vocabulary"):
        load_run_config(None, [f"data.tokenizer={tokenizer}", "data.train_shards=x.tar", "model.vocab_size=32"])
    assert load().model.vocab_size == 0  # no tokenizer file: left for build_lm to refuse


def test_a_file_that_is_not_a_tokenizer_names_the_key(tmp_path):
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ConfigError, match="data.tokenizer: cannot load"):
        load_run_config(None, [f"data.tokenizer={junk}", "data.train_shards=x.tar"])


def test_saved_config_reloads_identically_and_atomically(tmp_path, tokenizer):
    overrides = [f"data.tokenizer={tokenizer}", "model.dim=64", "run.dir=${model.mixer}"]
    cfg = load_run_config(CONFIGS / "tiny_lm.yaml", overrides)
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temporary file left behind
    assert "vocab_size: 40" in path.read_text()  # the resolved value, for eval tools that read it back
    assert load_run_config(path, []) == cfg
    assert OmegaConf.to_container(load_run_config(path, [])) == OmegaConf.to_container(cfg)


# ---------------------------------------------------------------- task: vision

VISION = ["task=vision", "data.train_shards=shards/train", "vision.num_classes=10"]


def load_vision(*overrides):
    return load_run_config(None, [*VISION, *overrides])


def refused_vision(key, *overrides):
    with pytest.raises(ConfigError) as err:
        load_vision(*overrides)
    assert err.value.key == key and str(err.value).startswith(f"{key}:")
    return str(err.value)


def test_a_vision_config_needs_no_tokenizer_and_keeps_its_sections():
    cfg = load_vision("vision.stage_mixers=[linear,inline,soft,aft_conv]", "augment.mixup_alpha=0.8")
    assert cfg.data.tokenizer is None and cfg.vision.num_classes == 10
    assert list(cfg.vision.stage_mixers) == ["linear", "inline", "soft", "aft_conv"]
    assert cfg.augment.mixup_alpha == 0.8 and list(cfg.augment.crop_scale) == [0.08, 1.0]
    with pytest.raises(ConfigError, match="data.tokenizer: no value given"):  # the LM still needs one
        load_run_config(None, ["data.train_shards=x.tar"])


@pytest.mark.parametrize("overrides, key", [
    (["vision.stage_dims=[64,128,320]"], "vision.stage_dims"),
    (["vision.stage_mixers=[soft,soft,soft]"], "vision.stage_mixers"),
    (["vision.stage_heads=[1,3,5,8]"], "vision.stage_heads[1]"),
    (["vision.stage_depths=[2,0,2,2]"], "vision.stage_depths[1]"),
    (["vision.stage_mixers=[soft,soft,nonexistent,softmax]"], "vision.stage_mixers[2]"),
    (["vision.image_size=100"], "vision.image_size"),  # not a multiple of patch_size·8 = 32
    (["vision.patch_size=0"], "vision.patch_size"),
    (["vision.drop_path=1.0"], "vision.drop_path"),
    (["vision.num_classes=-1"], "vision.num_classes"),
    (["augment.crop_scale=[0.5,0.2]"], "augment.crop_scale"),
    (["augment.crop_scale=[0.0,1.0]"], "augment.crop_scale"),
    (["augment.crop_scale=[0.5,1.5]"], "augment.crop_scale"),
    (["augment.crop_scale=[0.5]"], "augment.crop_scale"),
    (["augment.mixup_alpha=-0.1"], "augment.mixup_alpha"),
    (["augment.cutmix_alpha=-1"], "augment.cutmix_alpha"),
    (["augment.label_smoothing=1.0"], "augment.label_smoothing"),
    (["augment.eval_crop_ratio=0"], "augment.eval_crop_ratio"),
    (["vision.augment=1"], "vision.augment"),
])
def test_impossible_vision_values_name_the_key(overrides, key):
    refused_vision(key, *overrides)


def test_vision_mixer_options_are_built_non_causal_per_stage():
    """SOFT has no causal form: a vision stage takes it; a bad option of a stage's mixer names the option's key."""
    assert load_vision("model.mixer_options.soft.landmark_stride=2").model.mixer_options.soft.landmark_stride == 2
    refused_vision("model.mixer_options.soft.landmark_strid", "model.mixer_options.soft.landmark_strid=2")
    assert "stage 0" in refused_vision("model.mixer_options.linear", "vision.stage_mixers=[linear,soft,soft,soft]",
                                       "model.mixer_options.linear.feature_map=nonexistent")


def test_a_vision_mixer_option_may_differ_per_stage():
    """SOFT's published landmark strides shrink with the grid (8, 4, 2): one value per stage, each type-checked."""
    cfg = load_vision("model.mixer_options.soft.landmark_stride=[8,4,2,1]")
    assert list(cfg.model.mixer_options.soft.landmark_stride) == [8, 4, 2, 1]
    assert "4 entries" in refused_vision("model.mixer_options.soft.landmark_stride",
                                         "model.mixer_options.soft.landmark_stride=[8,4,2]")
    refused_vision("model.mixer_options.soft.landmark_stride", "model.mixer_options.soft.landmark_stride=[8,4,2,x]")
    refused("model.mixer_options.softmax.rope_theta", "model.mixer_options.softmax.rope_theta=[1.0,2.0,3.0,4.0]")


def test_num_classes_comes_from_the_shards_manifest(tmp_path):
    shards = tmp_path / "train"
    shards.mkdir()
    (shards / "manifest.json").write_text('{"classes": ["cat", "dog", "frog"], "files": []}')
    for train_shards in (str(shards), str(shards / "shard-{000000..000009}.tar")):
        cfg = load_run_config(None, ["task=vision", f"data.train_shards={train_shards}"])
        assert cfg.vision.num_classes == 3
    assert "3 classes" in refused_vision("vision.num_classes", f"data.train_shards={shards}", "vision.num_classes=2")
    message = refused_vision("data.train_shards", f"data.train_shards={tmp_path / 'none'}", "vision.num_classes=0")
    assert "manifest.json" in message and "vision.num_classes" in message
