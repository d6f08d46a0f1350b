#!/usr/bin/env python
"""Sample text from a trained run: the prompt in one parallel pass, then one token at a time through ``step``.

    python tools/generate.py --run runs/tiny_lm --prompt "The history of" --max-new-tokens 64
    python tools/generate.py --run runs/tiny_lm --tag step00000500 --prompt "Once" --temperature 0.8 --top-p 0.9

The prompt goes through ``model.prefill``: each mixer's parallel (chunked) forward, which also hands over the state
that decoding goes on from. Linear mixers then decode with constant memory per token (their state is a fixed-size
sum); softmax layers keep a KV cache that grows by one key and value per token. Temperature 0 is greedy
decoding; otherwise the logits are divided by the temperature and cut to the ``--top-k`` most likely tokens and/or
the smallest set of probability ``--top-p`` before sampling.
Generation stops at the end-of-sequence token or after ``--max-new-tokens``. The text goes to stdout; the speed
(tokens/s of the prompt and of the generated tokens) to stderr.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` ``[B, V]`` with everything outside the top-k and the top-p nucleus set to -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the most likely token always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[B]`` from the last logits ``[B, V]``: argmax at temperature 0, else a filtered sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits.float() / temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, generator: torch.Generator | None = None,
             timings: dict | None = None) -> list[int]:
    """The tokens ``model`` appends to ``prompt_ids`` (eos excluded): ``model.prefill``, then ``model.step``.

    ``timings``, when given, receives the seconds spent on the prompt and on the new tokens.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token of context")
    device = next(model.parameters()).device
    start = time.perf_counter()
    logits, states = model.prefill(torch.tensor([prompt_ids], device=device))
    prompt_done = time.perf_counter()
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens:
        token = next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if eos_id is not None and token.item() == eos_id:
            break
        new_tokens.append(token.item())
        if len(new_tokens) < max_new_tokens:
            logits, states = model.step(token, states)
    if timings is not None:
        timings.update(prompt_s=prompt_done - start, generate_s=time.perf_counter() - prompt_done)
    return new_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", required=True, help="run directory (holds config.yaml and checkpoints/), or a model "
                                                     "directory written by tools/export.py")
    parser.add_argument("--tag", default="latest", help="checkpoint tag, e.g. step00000500 (default: latest)")
    parser.add_argument("--prompt", required=True, help="text to continue (at least one token)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; below 1 sharper, above flatter")
    parser.add_argument("--top-k", type=int, default=0, help="sample only among the K most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample only from the smallest set of probability P")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    for name, bad in (("--max-new-tokens", args.max_new_tokens < 0), ("--temperature", args.temperature < 0),
                      ("--top-k", args.top_k < 0), ("--top-p", not 0 < args.top_p <= 1)):
        if bad:
            parser.error(f"{name} is out of range")

    from pretrain.data import Tokenizer
    from pretrain.train.checkpoint import load_trained_model

    try:
        model, cfg, checkpoint_path = load_trained_model(Path(args.run), args.tag)
        tokenizer = Tokenizer(cfg.data.tokenizer)
        prompt_ids = tokenizer.encode(args.prompt)
        model.to(args.device)
        generator = torch.Generator(args.device).manual_seed(args.seed)
        timings: dict = {}
        new_tokens = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, eos_id=tokenizer.eos_id, generator=generator,
                              timings=timings)
    except (OSError, ValueError) as err:  # a missing run, tag or tokenizer; an empty prompt; a bad config
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(tokenizer.decode(prompt_ids + new_tokens))
    print(f"{checkpoint_path}: prompt {len(prompt_ids)} tokens at {len(prompt_ids) / timings['prompt_s']:.1f} tok/s, "
          f"generated {len(new_tokens)} tokens at {len(new_tokens) / max(timings['generate_s'], 1e-9):.1f} tok/s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
