"""``PretrainTokenizer``: the run's sentencepiece model as a transformers tokenizer, giving exactly the ids of
``pretrain.data.Tokenizer`` (byte fallback, and its handling of a literal ``▁``, included: it runs its ``encode``).

Special tokens follow training: no id is added by default (``encode`` adds none; shards append ``eos`` to every
document). A document follows the previous one's ``eos``, so ``eos`` is also the beginning-of-sequence token
(``bos_token`` is ``</s>``, as GPT-2's is its end-of-text); ``add_bos_token=True`` prepends it, which is how
``pretrain.tasks.lm_scoring`` scores a document's first token. Special tokens typed in the text are text, as
sentencepiece reads them (``split_special_tokens``).
"""
import shutil
from pathlib import Path

import sentencepiece as spm
from transformers import PreTrainedTokenizer

from ..data.tokenizer import Tokenizer
from ..models.pretrained import TOKENIZER


class PretrainTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": TOKENIZER}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, add_bos_token: bool = False, **kwargs):
        self.vocab_file = vocab_file
        self.add_bos_token = add_bos_token
        self._tokenizer = Tokenizer(vocab_file)
        pieces = spm.SentencePieceProcessor(model_file=vocab_file)
        self._pieces = [pieces.id_to_piece(i) for i in range(pieces.get_piece_size())]
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        eos = self._pieces[self._tokenizer.eos_id]
        for name, piece in (("bos_token", eos), ("eos_token", eos), ("unk_token", pieces.id_to_piece(pieces.unk_id())),
                            ("pad_token", self._pieces[self._tokenizer.pad_id])):
            kwargs.setdefault(name, piece)
        kwargs.update(split_special_tokens=True, clean_up_tokenization_spaces=False,
                      special_tokens_pattern="bos" if add_bos_token else "none")
        super().__init__(add_bos_token=add_bos_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def get_vocab(self) -> dict[str, int]:
        return {**self._ids, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self._pieces[i] for i in self._tokenizer.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids.get(token, self._ids[self.unk_token])

    def _convert_id_to_token(self, index: int) -> str:
        return self._pieces[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Sentencepiece's decoding of each run of ordinary pieces; a special token as its text (sentencepiece
        would decode it to nothing)."""
        text, run = [], []
        for token in tokens:
            if token in self.all_special_tokens:
                text += [self._tokenizer.decode(run), token]
                run = []
            else:
                run.append(self._ids[token])
        return "".join(text) + self._tokenizer.decode(run)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + TOKENIZER)
        if Path(self.vocab_file).resolve() != out.resolve():
            shutil.copyfile(self.vocab_file, out)
        return (str(out),)
