"""Models built from registered token mixers: the causal LM (the vision backbone arrives later)."""
from .lm import Block, CausalLM, build_lm
