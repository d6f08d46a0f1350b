"""What sequence parallelism refuses at config load (each naming the key and why), and the dry run's memory."""
import pytest

from pretrain.config import ConfigError
from pretrain.estimate import estimate
from pretrain.tasks.config_checks import load_run_config

BASE = ["data.tokenizer=none.model", "data.train_shards=none", "model.vocab_size=512", "model.dim=64",
        "model.n_heads=4", "model.n_layers=2", "train.seq_len=64"]


def config(*overrides):
    return load_run_config(None, [*BASE, *overrides])


@pytest.mark.parametrize("overrides,reason", [
    (["parallel.sequence_parallel=3"], "must divide train.seq_len 64"),
    (["parallel.sequence_parallel=0"], "must be >= 1"),
    (["model.mixer=softmax", "model.n_heads=2", "parallel.sequence_parallel=4", "train.seq_len=64"],
     "2 heads over 4 sequence ranks"),
    (["model.mixer=aft_full", "model.mixer_options.aft_full.max_seq_len=64", "parallel.sequence_parallel=2"],
     "AFTFull has no sequence-parallel form"),
    (["model.mixer=inline", "model.mixer_options.inline.conv_size=8", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "a slice of 4 tokens is shorter than the 7 tokens before it that InLine"),
    (["model.mixer=aft_local", "model.mixer_options.aft_local.window=8", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "a slice of 4 tokens is shorter than the 7 tokens before it that AFTLocal"),
    (["model.mixer=linear", "model.mixer_options.linear.short_conv=6", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "shorter than the 5 tokens before it that LinearAttention reads (0 for its "
                                       "local window, 5 for short_conv)"),
    (["model.mixer=aft_local", "model.mixer_options.aft_local.window=3", "model.mixer_options.aft_local.short_conv=4",
      "train.seq_len=8", "parallel.sequence_parallel=2"], "shorter than the 5 tokens before it that AFTLocal reads"),
    (["model.mixer=gated_deltanet", "model.mixer_options.gated_deltanet.short_conv=8", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "a slice of 4 tokens is shorter than the 7 tokens before it that GatedDeltaNet"),
    (["model.mixer=retnet", "model.mixer_options.retnet.short_conv=8", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "a slice of 4 tokens is shorter than the 7 tokens before it that Retention"),
    (["model.mixer=mamba2", "model.mixer_options.mamba2.conv_size=8", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "a slice of 4 tokens is shorter than mamba2's convolution reach (7 tokens)"),
    (["model.mixer=rwkv7", "model.mixer_options.rwkv7.short_conv=5", "train.seq_len=8",
      "parallel.sequence_parallel=2"], "a slice of 4 tokens is shorter than the 5 tokens before it that rwkv7 reads "
                                       "(1 for its token shift, 4 for short_conv)"),
    (["model.layer_pattern=[linear,aft_full]", "model.mixer_options.aft_full.max_seq_len=64",
      "parallel.sequence_parallel=2"], "mixer 'aft_full' cannot split rows into 2 slices"),
])
def test_impossible_splits_are_refused_naming_the_key(overrides, reason):
    with pytest.raises(ConfigError, match="parallel.sequence_parallel") as caught:
        config(*overrides)
    assert reason in str(caught.value)


def test_vision_has_no_rows_to_split():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel.*task vision"):
        load_run_config("configs/vision/linear_tiny.yaml", ["parallel.sequence_parallel=2"])


def test_dry_run_measures_a_ranks_slice():
    """Activations at N = 2 are those of a row half as long; the model states do not change."""
    split = estimate(config("parallel.sequence_parallel=2", "model.mixer=linear"), 2)
    half = estimate(config("train.seq_len=32", "model.mixer=linear"), 2)
    whole = estimate(config("model.mixer=linear"), 2)
    assert split["memory_breakdown_bytes"]["activations"] == half["memory_breakdown_bytes"]["activations"]
    assert split["memory_breakdown_bytes"]["activations"] < whole["memory_breakdown_bytes"]["activations"]
    assert split["tokens_per_rank"] == whole["tokens_per_rank"] // 2
    assert {k: v for k, v in split["memory_breakdown_bytes"].items() if k != "activations"} == {
        k: v for k, v in whole["memory_breakdown_bytes"].items() if k != "activations"}
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        estimate(config("parallel.sequence_parallel=2"), 3)
