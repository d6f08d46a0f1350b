"""Score a trained recall run on fresh MQAR rows at several numbers of pairs and lengths, longer than trained too.

    python tools/eval_recall.py --run runs/recall/linear --pairs 8 16 32 64 --seq-lens 256 512 1024 --json out.json
    python tools/eval_recall.py --run runs/recall_zoology/gated_deltanet --settings 64:4 128:8 256:16 512:64 1024:64

The rows come from the ``test`` stream of ``--seed``, which no training or validation batch draws. Each setting
reports the share of answers whose argmax is right, their mean NLL, and the bytes of the model's decoding state
after a prompt of that length (every layer's, one row, fp32): constant for the linear mixers, a KV cache growing
with length for softmax. For each layer whose state decays (retnet, mamba2, gated_deltanet) it also reports the
mean log-decay per token over those rows (``log_decay``): about ``−1/mean`` tokens is how far back that layer's
trained gate remembers, the reading that tells a gate stuck forgetting fast from one that learned to hold. A
setting the model cannot run (more pairs than the length holds, a length beyond aft_full's ``max_seq_len``) is
reported with the reason and no accuracy.
"""
import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pretrain.attention.base import Mixer  # noqa: E402
from pretrain.cli_help import HelpFormatter  # noqa: E402
from pretrain.data.mqar import MQARLoader, MQARSettingError  # noqa: E402
from pretrain.tasks.recall import mixture_of, recall_scores  # noqa: E402
from pretrain.train.checkpoint import load_trained_model  # noqa: E402


@torch.no_grad()
def state_bytes(model, seq_len: int) -> int:
    """Bytes of every layer's decoding state after a ``seq_len``-token prompt of one row."""
    _, states = model.prefill(torch.zeros(1, seq_len, dtype=torch.long))
    return sum(t.numel() * t.element_size() for t in _tensors(states))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


@contextmanager
def decay_readings(model):
    """Yields a dict that, on leaving, maps each layer whose state decays (its mixer's module name) to the mean of
    its ``log_decay`` over the heads and tokens of every forward pass made inside."""
    totals: dict[str, list[float]] = {}

    def reading(name):
        def read(mixer, args):
            g = mixer.log_decay(args[0])
            if g is not None:
                tokens = args[0].shape[0] * args[0].shape[1]
                total = totals.setdefault(name, [0.0, 0])
                total[0] += g.double().mean().item() * tokens
                total[1] += tokens
        return read

    hooks = [module.register_forward_pre_hook(reading(name)) for name, module in model.named_modules()
             if isinstance(module, Mixer)]
    means: dict[str, float] = {}
    try:
        yield means
    finally:
        for hook in hooks:
            hook.remove()
        means.update({name: total / tokens for name, (total, tokens) in totals.items()})


def trained_settings(cfg) -> list[tuple[int, int]]:
    """The ``(seq_len, num_pairs)`` settings the run trained on."""
    return mixture_of(cfg) or [(cfg.train.seq_len, cfg.recall.num_pairs)]


def score(model, cfg, *, seq_len: int, num_pairs: int, rows: int, batch_size: int, seed: int) -> dict:
    """One setting's accuracy, NLL and state size, or the reason it cannot run."""
    result = {"seq_len": seq_len, "num_pairs": num_pairs, "trained": (seq_len, num_pairs) in trained_settings(cfg)}
    batch_size = min(batch_size, rows)
    try:
        stream = MQARLoader(vocab_size=cfg.recall.vocab_size, seq_len=seq_len, num_pairs=num_pairs,
                            batch_size=batch_size, query_power=cfg.recall.query_power, seed=seed, split="test")
        result["state_bytes"] = state_bytes(model, seq_len)
        with decay_readings(model) as log_decay:
            correct, answers, nll = recall_scores(model, map(stream.batch, range(-(-rows // batch_size))),
                                                  torch.device("cpu")).tolist()
    except (MQARSettingError, ValueError) as err:  # ValueError: a mixer refusing the length (aft_full)
        return {**result, "skipped": str(err)}
    result.update(accuracy=correct / answers, nll=nll / answers, answers=int(answers))
    return {**result, "log_decay": log_decay} if log_decay else result


def setting_arg(text: str) -> tuple[int, int]:
    """``T:N`` → ``(T, N)``."""
    try:
        length, pairs = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LENGTH:PAIRS such as 256:16; got {text!r}") from None
    return length, pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="run directory of a task: recall run")
    parser.add_argument("--tag", default="latest", help="checkpoint tag (default: the run's latest)")
    parser.add_argument("--pairs", type=int, nargs="+", help="numbers of key-value pairs (default: the trained one)")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="row lengths (default: trained, 2x, 4x)")
    parser.add_argument("--settings", type=setting_arg, nargs="+", metavar="T:N",
                        help="(length, pairs) settings scored, instead of the grid of --pairs × --seq-lens "
                             "(default for a mixture run: its settings, then each at twice the length)")
    parser.add_argument("--rows", type=int, default=256, help="rows scored per setting")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the test rows")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    model, cfg, checkpoint = load_trained_model(args.run, args.tag)
    if cfg.task != "recall":
        parser.error(f"--run {args.run} is a task {cfg.task!r} run; eval_recall scores task recall runs")
    if args.settings and (args.pairs or args.seq_lens):
        parser.error("give --settings, or --pairs and --seq-lens, not both")
    trained, mixture = cfg.train.seq_len, mixture_of(cfg)
    settings = args.settings
    if settings is None and mixture and not (args.pairs or args.seq_lens):
        settings = [*mixture, *((2 * length, pairs) for length, pairs in mixture)]
    if settings is None:
        settings = [(seq_len, num_pairs) for seq_len in args.seq_lens or [trained, 2 * trained, 4 * trained]
                    for num_pairs in args.pairs or [cfg.recall.num_pairs]]
    results = [score(model, cfg, seq_len=seq_len, num_pairs=num_pairs, rows=args.rows, batch_size=args.batch_size,
                     seed=args.seed) for seq_len, num_pairs in settings]
    report = {"run": str(args.run), "checkpoint": str(checkpoint), "seed": args.seed,
              "mixers": list(cfg.model.layer_pattern) or [cfg.model.mixer], "dim": cfg.model.dim,
              "trained": [{"seq_len": length, "num_pairs": pairs} for length, pairs in trained_settings(cfg)],
              "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    decays = any("log_decay" in r for r in results)
    header = "| seq_len | pairs | accuracy | nll | state bytes |" + " mean log-decay per token, by layer |" * decays
    print(header + "\n|---|---|---|---|---|" + "---|" * decays)
    for r in results:
        accuracy = f"{r['accuracy']:.3f}" if "accuracy" in r else f"— ({r['skipped']})"
        nll = f"{r['nll']:.3f}" if "nll" in r else "—"
        line = f"| {r['seq_len']} | {r['num_pairs']} | {accuracy} | {nll} | {r.get('state_bytes', '—')} |"
        if decays:
            line += " " + ", ".join(f"{value:.2g}" for value in r.get("log_decay", {}).values()) + " |"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
