"""The data path: sentencepiece tokenizers, webdataset shards, packed resumable batches (see docs/CONTRACTS.md)."""
from pretrain.data.loader import TokenLoader
from pretrain.data.shards import ShardError
from pretrain.data.text_shards import Document, make_text_shards, read_documents
from pretrain.data.tokenizer import Tokenizer, train_tokenizer

__all__ = ["Document", "ShardError", "TokenLoader", "Tokenizer", "make_text_shards", "read_documents",
           "train_tokenizer"]
