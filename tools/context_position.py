"""Loss against document position under several context lengths: does a model use its long context?

    python tools/context_position.py --run softmax=runs/ctx/softmax linear=runs/ctx/linear \\
        --data data/ctx/test --contexts 256 2048 16384 --json ctx.json --plot ctx.png

Every run is scored by ``tools/eval_ppl.py --by-position`` once per context C: windows of C tokens starting every
C/4, so a target sees between 3/4·C and C tokens of its document (its whole prefix when it sits nearer the start).
A context as long as the longest document gives every target its whole prefix.

Reading it: at a position p past C, the loss under context C minus the loss under a longer context is what the
tokens beyond C are worth to the model; a model that uses only its last few hundred tokens scores the same under
both. Under a context longer than the run's ``train.seq_len`` the positions past it are length extrapolation: a
softmax model meets RoPE rotations it never trained on, a linear model's state carries no position at all.

Prints a markdown table (mean nll per position bucket, a column per run and context); ``--json`` keeps every
score, ``--plot`` draws nll against position (and its gain over the shortest context), a column per run and
a line per context.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter
from pretrain.data.text_files import TXT_DOC_RULES

import benchlib  # tools/, beside this script
import eval_ppl


def labelled_run(text: str) -> tuple[str, str]:
    label, sep, run = text.partition("=")
    if not sep or not label or not run:
        raise argparse.ArgumentTypeError(f"expected LABEL=RUN_DIR, got {text!r}")
    return label, run


def score(run: str, context: int, args: argparse.Namespace) -> dict:
    """eval_ppl's figures for ``run`` with windows of ``context`` tokens every ``context // 4``."""
    options = argparse.Namespace(run=run, tag=args.tag, data=args.data, txt_docs=args.txt_docs, seq_len=context,
                                 stride=max(1, context // 4), batch_size=max(1, args.batch_tokens // context),
                                 device=args.device, by_position=True, sequence_parallel=1)
    return eval_ppl.evaluate(options)


def column(row: dict) -> str:
    return f"{row['label']} @{row['context']}"


def markdown(rows: list[dict]) -> str:
    """Mean nll per position bucket, a column per run and context; the overall nll in the last line."""
    buckets = list(dict.fromkeys(b["positions"] for row in rows for b in row["by_position"]))
    lines = ["| positions | tokens | " + " | ".join(column(row) for row in rows) + " |",
             "|---|---:|" + "---:|" * len(rows)]
    for bucket in buckets:
        found = [{b["positions"]: b for b in row["by_position"]}.get(bucket) for row in rows]
        tokens = next(b["tokens"] for b in found if b)
        lines.append(f"| {bucket} | {tokens:,} | " + " | ".join(f"{b['nll']:.3f}" if b else "—" for b in found) + " |")
    lines.append(f"| all | {rows[0]['tokens']:,} | " + " | ".join(f"{row['nll']:.3f}" for row in rows) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """A column per run, a line per context, against the first position of each bucket (log scale; bucket 0 left
    out): above, the nll; below, the nll less that under the shortest context, what the longer context is worth
    (below zero: it helps). The run's trained seq_len dashed."""
    plt = benchlib.pyplot()
    labels = list(dict.fromkeys(row["label"] for row in rows))
    contexts = sorted({row["context"] for row in rows})
    fig, axes = plt.subplots(2, len(labels), figsize=(4.2 * len(labels), 6), sharex=True, sharey="row", squeeze=False)
    for col, label in enumerate(labels):
        runs = {row["context"]: row for row in rows if row["label"] == label}
        shortest = {b["positions"]: b["nll"] for b in runs[min(runs)]["by_position"]}
        for context, row in sorted(runs.items()):
            buckets = [b for b in row["by_position"] if b["positions"] != "0"]
            starts = [int(b["positions"].split("-")[0]) for b in buckets]
            style = {"marker": "o", "markersize": 3, "label": f"context {context:,}",
                     "color": plt.cm.viridis(contexts.index(context) / max(1, len(contexts) - 1))}
            axes[0][col].plot(starts, [b["nll"] for b in buckets], **style)
            axes[1][col].plot(starts, [b["nll"] - shortest[b["positions"]] for b in buckets], **style)
        for ax in axes[:, col]:
            ax.axvline(runs[min(runs)]["train_seq_len"], color="gray", linewidth=0.8, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0][col].set_title(label, fontsize=9)
        axes[1][col].set_xlabel("position in the document (bucket start)")
    axes[0][0].set_ylabel("nll (nats)")
    axes[1][0].set_ylabel(f"nll − nll at context {min(contexts):,}")
    axes[0][-1].legend(fontsize=7)
    benchlib.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", nargs="+", type=labelled_run, required=True, metavar="LABEL=RUN",
                        help="runs to score, each named for the table (a run directory or an exported model)")
    parser.add_argument("--data", nargs="+", required=True, help="long documents: shards or text files, as eval_ppl")
    parser.add_argument("--contexts", nargs="+", type=int, required=True, help="window lengths in tokens")
    parser.add_argument("--tag", default="latest", help="checkpoint tag of every run")
    parser.add_argument("--txt-docs", choices=TXT_DOC_RULES, default="paragraphs",
                        help="document boundaries in .txt, as eval_ppl")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward (windows × context)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", type=Path, help="write every score here (rewritten after each)")
    parser.add_argument("--plot", type=Path, help="draw nll against position here (.png)")
    parser.add_argument("--add", action="store_true",
                        help="keep the rows of other labels already in --json: runs added to a table scored before, "
                             "which must score the same tokens at each context")
    args = parser.parse_args(argv)
    if min(args.contexts) < 4:
        parser.error(f"--contexts: a window needs at least 4 tokens, got {min(args.contexts)}")
    if args.add and not (args.json and args.json.exists()):
        parser.error("--add keeps the rows of an earlier --json: pass --json naming one that exists")

    labels = {label for label, _ in args.run}
    rows = [row for row in json.loads(args.json.read_text()) if row["label"] not in labels] if args.add else []
    kept_tokens = {row["context"]: row["tokens"] for row in rows}
    for label, run in args.run:
        for context in args.contexts:
            print(f"{label} @{context}: scoring {run}", file=sys.stderr)
            try:
                result = score(run, context, args)
            except (OSError, ValueError) as err:
                print(f"error: {label}={run}: {err}", file=sys.stderr)
                return 1
            if kept_tokens.get(context, result["tokens"]) != result["tokens"]:
                print(f"error: {label} @{context} scored {result['tokens']:,} tokens, the rows kept from {args.json} "
                      f"{kept_tokens[context]:,}: not the same documents (--data, --txt-docs or the tokenizer "
                      f"differ)", file=sys.stderr)
                return 1
            rows.append({"label": label, "run": run, "context": context, **result})
            if args.json:  # after every score, so a failure later keeps what was scored
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
