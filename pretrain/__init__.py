"""pretrain: long-context pretraining with linear-time token mixers.

A model exported here is also a transformers model (``pretrain.hf``). Its classes are registered with transformers'
Auto classes as soon as both ``pretrain`` and ``transformers`` are imported, in either order, without this import
loading transformers (seconds) for training, which never needs it.
"""
import importlib.util
import sys


class _RegisterWithTransformers:
    """A ``sys.meta_path`` finder that finds nothing itself: when ``transformers`` is first imported, it has that
    module's own loader run and then imports ``pretrain.hf``, which registers our classes."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            try:
                importlib.import_module("pretrain.hf")
            except Exception as err:  # transformers itself must still import (another version, say)
                import warnings

                warnings.warn(f"pretrain.hf did not register with transformers {module.__version__}: {err}",
                              stacklevel=2)

        spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules:
    importlib.import_module("pretrain.hf")
elif importlib.util.find_spec("transformers") is not None:
    sys.meta_path.insert(0, _RegisterWithTransformers())
