"""Pure functions on tensors [B, T, H, D]: the math of each mixer, each beside its naive reference.

Nothing here knows about modules, configs or DeepSpeed.
"""
from .varlen import cu_seqlens_from_position_ids

# Op exports (one line per op family):
from .efficient import efficient_attention, efficient_attention_naive
from .delta_rule import delta_rule, delta_rule_naive
from .dplr import dplr_delta_rule
from .aft import (aft_conv2d, aft_conv2d_naive, aft_full, aft_full_naive, aft_local, aft_local_naive, aft_simple,
                  aft_simple_naive)
from .linear_attention import LinearAttentionState, linear_attention
from .decayed_linear_attention import decayed_linear_attention
from .rope import apply_rope, rope_rotation
from .softmax import softmax_attention, softmax_attention_naive
from .soft import newton_schulz_pinv, soft_attention, soft_attention_naive
from .short_conv import short_conv, short_conv_naive
