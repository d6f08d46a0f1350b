"""How sure are the small differences in context_position_cpu.md? Per-token nll of one run under two windows, paired
token by token at positions >= 1,024, with a 95 % interval from a block bootstrap (blocks of 512 consecutive
positions of one document, so that neighbouring tokens, which are not independent, are resampled together).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_position_spread.py /tmp/ctx/runs/linear /tmp/ctx/test 256 2048

Windows as eval_ppl's with --stride C/4 (pretrain.tasks.lm_scoring.document_windows); a context of 0 means the
whole document in one window.
"""
import sys

import numpy as np
import torch

from pretrain.data import Tokenizer, read_documents
from pretrain.tasks.lm_scoring import IGNORE, document_windows
from pretrain.train.checkpoint import load_trained_model

FROM, BLOCK, DRAWS = 1024, 512, 2000


@torch.no_grad()
def token_nll(model, tokens: np.ndarray, context: int, eos_id: int) -> np.ndarray:
    """nll of every target of one document (index = its position), each scored once as eval_ppl scores it."""
    seq_len = context or len(tokens) + 1
    out = np.full(len(tokens), np.nan)
    for inputs, positions, targets, target_positions in document_windows(
            tokens, seq_len=seq_len, stride=max(1, seq_len // 4), eos_id=eos_id):
        nll = model(torch.from_numpy(inputs)[None], position_ids=torch.from_numpy(positions)[None],
                    labels=torch.from_numpy(targets)[None], reduction="none")[0].double().numpy()
        scored = targets != IGNORE
        out[target_positions[scored]] = nll[scored]
    assert not np.isnan(out).any()
    return out


def main(run: str, data: str, *contexts: str) -> None:
    model, cfg, _ = load_trained_model(run, "latest")
    eos = Tokenizer(cfg.data.tokenizer).eos_id
    docs = [d.tokens.astype(np.int64) for d in read_documents(data)]
    per_context = {int(c): [token_nll(model, d, int(c), eos) for d in docs] for c in contexts}
    rng = np.random.default_rng(0)
    for short, long in zip(per_context, list(per_context)[1:]):
        blocks = [(b - a)[i:i + BLOCK] for a, b in zip(per_context[short], per_context[long])
                  for i in range(FROM, len(a), BLOCK)]
        sums, counts = np.array([x.sum() for x in blocks]), np.array([len(x) for x in blocks])
        draws = rng.integers(0, len(blocks), (DRAWS, len(blocks)))
        means = sums[draws].sum(1) / counts[draws].sum(1)
        low, high = np.percentile(means, [2.5, 97.5])
        print(f"{run}: context {short or 'whole'} -> {long or 'whole'}, positions >= {FROM}: nll change "
              f"{sums.sum() / counts.sum():+.4f} (95 % {low:+.4f} .. {high:+.4f}; {counts.sum():,} tokens, "
              f"{len(blocks)} blocks)")


if __name__ == "__main__":
    main(*sys.argv[1:])
