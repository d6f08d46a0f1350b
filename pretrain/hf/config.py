"""``PretrainConfig``: an exported ``config.json`` (the run's resolved config) read by transformers.

The file stays what ``pretrain.models.load_pretrained`` reads: its sections (``task``, ``model``, ``data``, ...)
are this config's attributes, written back unchanged by ``save_pretrained``. The few keys transformers looks for
(vocabulary size, width, depth, tied embeddings) are derived from the ``model`` section, never stored twice by
hand. The special ids live in the model's generation config (``PretrainForCausalLM``), where transformers 5 reads
them.
"""
from transformers import PretrainedConfig

from ..models.pretrained import TRANSFORMERS_KEYS, causal_lm_config


class PretrainConfig(PretrainedConfig):
    model_type = TRANSFORMERS_KEYS["model_type"]
    task: str = "lm"
    model: dict | None = None  # the ModelConfig section; None only for transformers' default instance

    def __post_init__(self, **kwargs):
        if self.model is not None:
            lm = self.lm_config()
            kwargs.update(vocab_size=lm.vocab_size, hidden_size=lm.dim, num_hidden_layers=lm.n_layers,
                          num_attention_heads=lm.n_heads, tie_word_embeddings=lm.tie_embeddings)
        super().__post_init__(**kwargs)

    def lm_config(self):
        """The ``pretrain.config.ModelConfig`` the model is built from (unknown keys and vision refused)."""
        return causal_lm_config({"task": self.task, "model": self.model}, self.name_or_path or "config.json")
