"""The DeepSpeed JSON made from a config: our keys, then ``deepspeed.extra`` merged in deeply, winning."""
from pretrain.config import load_config
from pretrain.distributed.engine import deepspeed_config

DATA = ["data.tokenizer=tok.model", "data.train_shards=x.tar"]


def test_extra_keys_merge_into_nested_sections_and_win():
    cfg = load_config(None, [*DATA, "deepspeed.zero_stage=2", "train.micro_batch_size=3", "train.grad_accum_steps=2",
                             "deepspeed.extra.zero_optimization.reduce_bucket_size=1000",
                             "deepspeed.extra.gradient_clipping=0.5", "deepspeed.extra.flops_profiler.enabled=true"])
    config = deepspeed_config(cfg, world_size=4)
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}  # merged, not replaced
    assert config["gradient_clipping"] == 0.5  # extra wins
    assert config["flops_profiler"] == {"enabled": True}  # a key we do not model passes through
    assert config["train_batch_size"] == 3 * 2 * 4
    assert type(config) is dict and type(config["zero_optimization"]) is dict  # plain JSON for DeepSpeed
