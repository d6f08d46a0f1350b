"""Sentencepiece tokenizers that round-trip any UTF-8 text: ``decode(encode(x)) == x``.

Training settings that make the round trip exact: byte fallback (characters outside the vocabulary become their
UTF-8 bytes ``<0x..>``), the ``identity`` normalization (no NFKC), no dummy prefix, whitespace kept as is.
Sentencepiece writes spaces as ``▁`` (U+2581), so a literal ``▁`` in the text is encoded as its three byte pieces.

Special ids, fixed for every model trained here: ``pad=0``, ``unk=1``, ``bos=2``, ``eos=3``. ``encode`` adds none of
them; shards append ``eos`` to every document (see ``pretrain.data.text_shards``).

The same inputs and seed give the same model file wherever it is written, on machines with the same number of
cores (sentencepiece's multi-threaded training depends on the thread count).
"""
import hashlib
import io
import os
import random
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm

from pretrain.data.text_files import read_text_documents

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_SPACE_MARK = "\u2581"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """A trained sentencepiece model; ``sha256`` identifies it (shards record it in their manifest)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model {path!r} does not exist")
        self.path = path
        self.sha256 = file_sha256(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as err:
            raise ValueError(f"tokenizer model {path!r} is not a sentencepiece model ({err})") from None
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id, self.bos_id, self.eos_id = self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id()
        mark = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_MARK.encode()]
        self._space_mark_ids = mark if self._sp.unk_id() not in mark else None  # None: no byte fallback

    def encode(self, text: str) -> list[int]:
        if _SPACE_MARK not in text or self._space_mark_ids is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(_SPACE_MARK)):
            if i:
                ids.extend(self._space_mark_ids)
            ids.extend(self._sp.encode(part))
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, the plain ones in one threaded sentencepiece call."""
        plain = [i for i, t in enumerate(texts) if _SPACE_MARK not in t]
        out: list[list[int]] = [[] for _ in texts]
        for i, ids in zip(plain, self._sp.encode([texts[i] for i in plain])):
            out[i] = ids
        for i, text in enumerate(texts):
            if _SPACE_MARK in text:
                out[i] = self.encode(text)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _training_lines(paths: list[str], txt_docs: str, sample_bytes: int | None, seed: int,
                    progress: bool) -> Iterator[str]:
    """Non-blank lines of the documents; with ``sample_bytes``, an even random sample of about that many bytes.

    Sampling needs the total, so the input is read twice (reading is much faster than training).
    """
    def lines() -> Iterator[str]:
        for doc in read_text_documents(paths, txt_docs=txt_docs, progress=progress):
            yield from (line for line in doc.split("\n") if line.strip())

    keep = 1.0
    if sample_bytes is not None:
        total = sum(len(line.encode()) for line in lines())
        keep = min(1.0, sample_bytes / max(total, 1))
    rng = random.Random(seed)
    for line in lines():
        if keep >= 1.0 or rng.random() < keep:
            yield line


def train_tokenizer(inputs: list[str], vocab_size: int, out_prefix: str, *, model_type: str = "bpe",
                    sample_bytes: int | None = None, txt_docs: str = "paragraphs", seed: int = 0,
                    progress: bool = False) -> Tokenizer:
    """Train on ``inputs`` (paths) and write ``out_prefix.model`` / ``out_prefix.vocab``."""
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type={model_type!r}: expected 'bpe' or 'unigram'")
    if vocab_size <= 256 + 4:
        raise ValueError(f"vocab_size={vocab_size}: must exceed 260 (256 byte pieces + pad/unk/bos/eos)")
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # sentencepiece seeds from the clock otherwise
    try:
        spm.SentencePieceTrainer.train(  # into memory: a model_prefix would be recorded in the model (and its sha256)
            sentence_iterator=_training_lines(inputs, txt_docs, sample_bytes, seed, progress),
            model_writer=model, vocab_size=vocab_size, model_type=model_type,
            byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, character_coverage=0.9995,
            max_sentence_length=1 << 16, input_sentence_size=0, num_threads=os.cpu_count() or 1,
            minloglevel=0 if progress else 2)
    except RuntimeError as err:
        raise ValueError(f"sentencepiece training with vocab_size={vocab_size} failed: {err}") from None
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    with open(out_prefix + ".model", "wb") as f:
        f.write(model.getvalue())
    trained = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with open(out_prefix + ".vocab", "w", encoding="utf-8") as f:
        for i in range(trained.get_piece_size()):
            f.write(f"{trained.id_to_piece(i)}\t{trained.get_score(i):g}\n")
    return Tokenizer(out_prefix + ".model")
