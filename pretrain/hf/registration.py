"""Telling transformers' Auto classes about ours, under the model type exported directories name."""
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .config import PretrainConfig
from .model import PretrainForCausalLM
from .tokenizer import PretrainTokenizer


def register() -> None:
    """Register the config, model and tokenizer classes (again is a no-op)."""
    AutoConfig.register(PretrainConfig.model_type, PretrainConfig, exist_ok=True)
    AutoModelForCausalLM.register(PretrainConfig, PretrainForCausalLM, exist_ok=True)
    AutoTokenizer.register(PretrainConfig, tokenizer_class=PretrainTokenizer, exist_ok=True)
