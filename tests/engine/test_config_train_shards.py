"""data.train_shards' forms: one pattern, a list of patterns, a mixture of {shards, weight} sources (checked by key)."""
import pytest

from pretrain.config import ConfigError, load_config, train_shard_sources

MIX = ("data.train_shards=[{shards: 'a/{0..3}.tar', weight: 3}, "
       "{shards: 'https://h/b-{000..009}.tar', weight: 0.5, name: code}]")


def load(*overrides):
    return load_config(None, ["data.tokenizer=tok.model", *overrides])


def test_each_form_reaches_the_data_layer_as_one_pattern_or_weighted_sources():
    assert train_shard_sources(load("data.train_shards=a/{0..3}.tar").data.train_shards) == "a/{0..3}.tar"
    assert train_shard_sources(load("data.train_shards=[a/x.tar,b/y.tar]").data.train_shards) == "a/x.tar::b/y.tar"
    assert train_shard_sources(load(MIX).data.train_shards) == [("a/{0..3}.tar", 3.0, "source0"),
                                                                ("https://h/b-{000..009}.tar", 0.5, "code")]
    assert load(MIX).data.mix_by == "tokens"  # as NeoX and OLMo weigh a mixture


@pytest.mark.parametrize("value, key, says", [
    ("[{shards: a.tar, weight: 1}, {shards: b.tar, weight: 0}]", "data.train_shards[1].weight", "must be a number > 0"),
    ("[{shards: a.tar, weight: -2}]", "data.train_shards[0].weight", "must be a number > 0"),
    ("[{shards: a.tar}]", "data.train_shards[0].weight", "must be a number > 0 (got None)"),
    ("[{shards: a.tar, weight: heavy}]", "data.train_shards[0].weight", "must be a number > 0"),
    ("[{shards: '', weight: 1}]", "data.train_shards[0].shards", "expected a shard pattern"),
    ("[{shards: a.tar, weight: 1, colour: web}]", "data.train_shards[0].colour", "unknown key"),
    ("[{shards: a.tar, weight: 1, name: a/b}]", "data.train_shards[0].name", "expected a name of letters"),
    ("[{shards: a.tar, weight: 1, name: x}, {shards: b.tar, weight: 1, name: x}]", "data.train_shards[1].name",
     "unique in the mixture"),
    ("[{shards: a.tar, weight: 1}, b.tar]", "data.train_shards[1]", "expected {shards: PATTERN, weight: NUMBER}"),
    ("[]", "data.train_shards", "expected a shard pattern"),
    ("[{shards: 'pipe:cat a.tar', weight: 1}]", "data.train_shards[0].shards", "set data.allow_pipe=true"),
])
def test_a_bad_source_is_refused_naming_its_key(value, key, says):
    with pytest.raises(ConfigError) as err:
        load(f"data.train_shards={value}")
    assert err.value.key == key and says in str(err.value), str(err.value)


def test_a_vision_run_reads_one_pattern():
    with pytest.raises(ConfigError, match=r"^data.train_shards: task vision reads one shard pattern"):
        load_config(None, ["task=vision", MIX])
