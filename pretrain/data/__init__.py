"""The data path: sentencepiece tokenizers, webdataset shards, packed token batches and augmented image batches,
resumable (see docs/CONTRACTS.md).

Names are imported on first use, so the tools that only tokenize or shard do not pay for importing torch.
"""
import importlib

_HOMES = {
    "TokenLoader": "pretrain.data.loader",
    "MixtureLoader": "pretrain.data.loader",
    "ImageLoader": "pretrain.data.image_loader",
    "ShardError": "pretrain.data.shards",
    "Document": "pretrain.data.text_shards",
    "make_text_shards": "pretrain.data.text_shards",
    "read_documents": "pretrain.data.text_shards",
    "Tokenizer": "pretrain.data.tokenizer",
    "train_tokenizer": "pretrain.data.tokenizer",
    "make_image_shards": "pretrain.data.images",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'pretrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
