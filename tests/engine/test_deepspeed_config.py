"""The DeepSpeed JSON made from a config: our keys, then ``deepspeed.extra`` merged in deeply, winning."""
from pathlib import Path

import pytest

from pretrain.config import load_config
from pretrain.distributed.engine import deepspeed_config

DATA = ["data.tokenizer=tok.model", "data.train_shards=x.tar"]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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


@pytest.mark.parametrize("name", ["softmax_lm_1b.yaml", "lm/linear_1b.yaml", "lm/gdn_hybrid_1b.yaml"])
def test_the_1b_configs_state_the_engine_of_one_node_in_keys_deepspeed_accepts(name):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = deepspeed_config(load_config(CONFIGS / name, []), world_size=8)["zero_optimization"]
    assert zero == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                    "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 500_000_000}
    DeepSpeedZeroConfig(**zero)  # its schema refuses a key it does not know
