"""Tiny LMs for the transformers tests: every causal mixer registered, and random weights that spread the logits."""
import torch
from omegaconf import OmegaConf

from pretrain.attention import REGISTRY
from pretrain.config import Config, ModelConfig
from pretrain.models import build_lm

# every causal mixer registered, so a new one is tested without a change here; a hybrid of the decayed and
# delta-rule states with softmax's cache; and, last (the hybrid other tests take), one of three older kinds
CAUSAL_MIXERS = sorted(name for name, cls in REGISTRY.items() if cls.supports_causal)
PATTERNS = [[name] for name in CAUSAL_MIXERS] + [["gated_deltanet", "mamba2", "retnet", "softmax"],
                                                 ["linear", "softmax", "inline"]]


def random_lm(pattern: list[str], vocab_size: int, seed: int = 0, **model):
    """A tiny fp32 LM whose weights spread the logits, so greedy choices have no near-ties; and its ModelConfig."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, dim=32, n_layers=len(pattern), n_heads=4, layer_pattern=pattern,
                      mixer_options={"aft_full": {"max_seq_len": 256}, "aft_local": {"window": 5, "chunk_size": 16}},
                      **model)
    lm = build_lm(cfg).eval()
    with torch.no_grad():
        for param in lm.parameters():
            if param.dim() >= 2:
                param.normal_(0, 1.0 / param.shape[-1] ** 0.5)
    return lm, cfg


def run_config(model: ModelConfig, tokenizer: str) -> dict:
    """The resolved config of a run of that model, as an exported config.json holds it."""
    config = OmegaConf.to_container(OmegaConf.structured(Config(model=model)))
    config["data"].update(tokenizer=tokenizer, train_shards="shards/{000000..000000}.tar")
    return config
