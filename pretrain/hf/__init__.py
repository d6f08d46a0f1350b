"""A model exported here as a transformers model: ``AutoConfig``, ``AutoModelForCausalLM`` and ``AutoTokenizer``
load what ``tools/export.py`` writes; ``model.generate`` decodes from each mixer's own state.

Importing this package imports transformers (seconds), so nothing of the training stack does: ``import pretrain``
registers these classes only once transformers itself gets imported (``pretrain/__init__.py``).
"""
try:
    import transformers  # the missing extra is named here, not deep in a traceback
except ImportError as err:
    raise ImportError("pretrain.hf needs the 'hf' extra: pip install -e '.[hf]' -c constraints.txt (transformers "
                      "and lm-eval, at the versions tests/hf passes with)") from err

from .config import PretrainConfig
from .model import PretrainForCausalLM, MixerStateCache
from .tokenizer import PretrainTokenizer
from .registration import register

register()
