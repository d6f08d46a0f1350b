"""Models built from registered token mixers: the causal LM and the hierarchical vision backbone."""
from .lm import Block, CausalLM, build_lm
from .vision import VisionBackbone, VisionBlock, build_vision_model
from .pretrained import load_pretrained
