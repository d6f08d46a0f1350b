#!/usr/bin/env python
"""Time per new token of transformers' ``model.generate`` on an exported model (``pretrain.hf``) against the prompt's
length: a linear-state mixer decodes each token from a state of fixed size, softmax attention reads a KV cache that
grows with the prompt.

    OMP_NUM_THREADS=1 python tools/bench_generate.py --mixers linear,softmax --prompts 256,8192 \\
        --json benchmarks/generate_cpu.json --markdown benchmarks/generate_cpu.md

Each mixer gets a model of random weights (``--dim``, ``--layers``, ``--heads``, ``--vocab``), exported as
``tools/export.py`` exports and loaded with ``AutoModelForCausalLM.from_pretrained``. Per prompt length, greedy
``generate`` of ``--new-tokens`` tokens; a logits processor notes the clock each time a token is chosen, so the
time per new token is (last − first) / (new tokens − 1): decoding forwards only, the prompt's pass excluded. Beside
it: the same figure for ``tools/generate.py``'s own loop on ``load_pretrained``'s model (transformers' overhead is
the difference), the prompt's pass, and the size of the decoding state after the prompt. The median of
``--repeats`` runs (the prompt lengths interleaved) is reported, with the machine's load average after each figure.
On a shared machine, one thread (``OMP_NUM_THREADS=1``): several threads of one token's small matmuls spin against
the other processes.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain.cli_help import HelpFormatter
from pretrain.config import ModelConfig
from pretrain.models import build_lm, load_pretrained
from pretrain.train.export import write_export

import generate as our_generate  # tools/, beside this script


def state_bytes(states) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(states)
               if isinstance(t, torch.Tensor))


def measure(model, ours, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    """One greedy generation through transformers and one through tools/generate.py, timed."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    prompt = torch.randint(4, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    clock = Clock()
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True)
    timings: dict = {}
    our_generate.generate(ours, prompt[0].tolist(), new_tokens, temperature=0.0, timings=timings)
    return {"hf_ms_per_token": 1e3 * (clock.times[-1] - clock.times[0]) / (new_tokens - 1),
            "hf_prompt_s": clock.times[0] - start,
            "ours_ms_per_token": 1e3 * timings["generate_s"] / new_tokens,
            "state_mb": state_bytes(out.cache.states) / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--mixers", default="linear,softmax", help="comma-separated registered causal mixers")
    parser.add_argument("--prompts", default="256,8192", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run (≥ 2)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the median is reported")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--markdown", type=Path, help="write a table here")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")
    from transformers import AutoModelForCausalLM

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for mixer in args.mixers.split(","):
            torch.manual_seed(0)
            cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                              mixer=mixer)
            write_export(build_lm(cfg), {"task": "lm", "model": asdict(cfg)}, Path(tmp) / mixer)
            model = AutoModelForCausalLM.from_pretrained(Path(tmp) / mixer).eval()
            ours = load_pretrained(Path(tmp) / mixer)
            measure(model, ours, 16, 4, args.vocab)  # warm-up: first calls set up kernels and caches
            prompts = [int(length) for length in args.prompts.split(",")]
            runs: dict[int, list[dict]] = {length: [] for length in prompts}
            for _ in range(args.repeats):  # the lengths interleaved, so a busy spell of the machine hits them alike
                for length in prompts:
                    runs[length].append(measure(model, ours, length, args.new_tokens, args.vocab))
            for length in prompts:
                record = {"mixer": mixer, "prompt": length, "new_tokens": args.new_tokens,
                          **{key: statistics.median(run[key] for run in runs[length]) for key in runs[length][0]},
                          "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}
                records.append(record)
                print(json.dumps(record), flush=True)
    if args.json:
        config = vars(args) | {"json": str(args.json), "markdown": str(args.markdown)}
        args.json.write_text(json.dumps({"config": config, "records": records}, indent=2) + "\n")
    if args.markdown:
        lines = ["| mixer | prompt | ms / new token (generate) | ms / new token (tools/generate.py) | prompt pass s "
                 "| state after prompt MiB | load |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['mixer']} | {r['prompt']} | {r['hf_ms_per_token']:.2f} | {r['ours_ms_per_token']:.2f} | "
                  f"{r['hf_prompt_s']:.2f} | {r['state_mb']:.2f} | {r['load']:.1f} |" for r in records]
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
