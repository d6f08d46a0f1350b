"""AFT — the Attention Free Transformer (Zhai et al. 2021): per-channel attention with a learned position bias.

docs/MIXERS.md#aft. Layout ``[B, T, C]`` (AFT has no heads except AFT-conv's kernel groups).
``Y_t = σ(Q_t) ⊙ Σ_{t'} e^{K_{t'} + w_{t,t'}} ⊙ V_{t'} / Σ_{t'} e^{K_{t'} + w_{t,t'}}``; causal: ``t' ≤ t``.

- ``aft_full``: any bias ``w [T_max, T_max]``; O(T·C) memory beside the bias by two matmuls with ``e^w``.
- ``aft_local``: a relative bias inside a window of ``s`` tokens and **0 outside** (distant tokens still count):
  ``num = Σ_all e^K V + Σ_{|t−t'|<s} (e^w − 1) e^K V`` (den: V → 1).
- ``aft_simple``: no bias — a (prefix) softmax over positions, per channel.
- ``aft_conv2d``: per-head s×s relative biases on an image grid, as a depthwise convolution.

``naive.py`` holds the definitions (the oracle), ``parallel.py`` the whole-sequence forms, ``chunk.py`` the causal
local/simple forms over packed documents, ``state.py`` the prefix state a sequence-parallel rank hands on.
"""
from .naive import aft_conv2d_naive, aft_full_naive, aft_local_naive, aft_simple_naive
from .parallel import aft_conv2d, aft_full, aft_local, aft_simple
from .state import aft_state, combine_aft_states, state_as_token

__all__ = ["aft_full", "aft_local", "aft_simple", "aft_conv2d", "aft_full_naive", "aft_local_naive",
           "aft_simple_naive", "aft_conv2d_naive", "aft_state", "combine_aft_states", "state_as_token"]
