"""Pure functions on tensors [B, T, H, D]: the math of each mixer, each beside its naive reference.

Nothing here knows about modules, configs or DeepSpeed.
"""
from .varlen import cu_seqlens_from_position_ids

# Op exports (one line per op family):
