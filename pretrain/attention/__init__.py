"""Token mixers as nn.Modules around one op each, and the registry that names them.

Each mixer module registers itself with ``@register(name)``; importing it here is what makes the name known.
"""
from .registry import REGISTRY, build_mixer, mixer_options, register

# Mixer modules (one import line each; the import registers the name):
from . import softmax
from . import linear
from . import cosine
from . import efficient
from . import inline
from . import aft
from . import soft
from . import retnet
from . import mamba2
from . import deltanet
from . import kda
from . import rwkv7
