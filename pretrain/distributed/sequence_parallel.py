"""Sequence parallelism set up from outside the model: the groups of ranks that share a row, and the mixers told
which slice they hold."""
import dataclasses

import torch.distributed as dist
from torch import nn

from pretrain.attention.base import Mixer
from pretrain.config import ConfigError
from pretrain.parallel import SequenceShard

from .process_group import World


def split_sequences(world: World, size: int) -> World:
    """``world`` with groups of ``size`` consecutive ranks sharing each row (``size`` 1: unchanged).

    Every rank must call it: creating a process group is collective, for every group.
    """
    if size == 1:
        return world
    if world.world_size % size:
        raise ConfigError("parallel.sequence_parallel", f"{size} must divide the number of ranks ({world.world_size})")
    shard = None
    for start in range(0, world.world_size, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if world.rank in ranks:
            shard = SequenceShard(group=group, rank=world.rank - start, size=size)
    return dataclasses.replace(world, sequence=shard)


def apply_sequence_parallel(model: nn.Module, shard: SequenceShard | None, seq_len: int) -> None:
    """Tell every mixer of ``model`` which slice of rows of ``seq_len`` tokens this rank holds (None: whole rows)."""
    if shard is None:
        return
    for name, module in model.named_modules():
        if getattr(getattr(module, "ffn", None), "shifts", False):  # a block's (RWKV's channel mixing)
            raise ValueError(f"{name}: its feed-forward's token shift reads the token before a slice, which crosses no "
                             "rank outside a mixer: model.ffn rwkv_channel_mix has no sequence-parallel form")
        if isinstance(module, Mixer):
            try:
                module.check_sequence_parallel(shard.size, seq_len // shard.size)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
            module.sequence = shard
