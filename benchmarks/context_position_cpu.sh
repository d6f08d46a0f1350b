#!/usr/bin/env bash
# Does a linear LM use long context? Tiny LMs (4 layers, width 256: configs/tiny_lm.yaml for softmax,
# configs/lm/<mixer>_tiny.yaml for linear (elu+1), inline, mamba2, gated_deltanet, the 3:1 gated DeltaNet +
# softmax hybrid, kda, rwkv7, and kda with its output gate started shut), each trained at 2,048 tokens for 500
# steps of 2 rows on one CPU thread, then scored per document position by tools/context_position.py under windows
# of 16, 64, 256, 2,048 and 24,576 tokens (longer than any held-out document). Data: War and Peace
# (../shared/data/text/warandpeace.txt, Project Gutenberg). Books One to Fourteen, one document each (33k–103k tokens), train; Book Fifteen and the two
# epilogues, cut at paragraphs into 8 documents of 4.7k–17k tokens, held out. Writes its runs to ${OUT:-/tmp/ctx};
# the figures to benchmarks/context_position_cpu.{json,png}; the table it prints is in context_position_cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ctx}
PY=.venv/bin/python
mkdir -p "$OUT"
$PY - ../shared/data/text/warandpeace.txt "$OUT" <<'EOF'
import json, re, sys
text = open(sys.argv[1], encoding="utf-8").read()
body = text[text.index("BOOK ONE: 1805\n\n\n"):text.index("End of the Project Gutenberg")]  # after the contents
starts = [m.start() for m in re.finditer(r"^(BOOK [A-Z]+:|FIRST EPILOGUE|SECOND EPILOGUE)", body, re.M)]
parts = [body[a:b].strip() for a, b in zip(starts, starts[1:] + [len(body)])]

def pieces(part, size):  # paragraphs gathered into pieces of at most ~size characters
    out, cur = [], ""
    for para in part.split("\n\n"):
        if cur and len(cur) + len(para) > size:
            out.append(cur)
            cur = ""
        cur = cur + "\n\n" + para if cur else para
    return out + [cur]

with open(f"{sys.argv[2]}/train.jsonl", "w") as f:
    f.writelines(json.dumps({"text": p}) + "\n" for p in parts[:14])
with open(f"{sys.argv[2]}/test.jsonl", "w") as f:
    f.writelines(json.dumps({"text": q}) + "\n" for p in parts[14:] for q in pieces(p, 60000))
EOF
[ -f "$OUT/tok.model" ] || $PY tools/train_tokenizer.py --input "$OUT/train.jsonl" --vocab-size 4096 --out "$OUT/tok"
for split in train test; do
  [ -f "$OUT/$split/manifest.json" ] || $PY tools/make_shards.py text --input "$OUT/$split.jsonl" \
      --tokenizer "$OUT/tok.model" --out "$OUT/$split" --docs-per-shard 100
done
# MIXERS names the runs to train (a run with a checkpoint is kept) and score; the JSON keeps the rows of the others
# (--add), so mixers can join the table later at the same budget.
MIXERS=${MIXERS:-softmax linear inline mamba2 gated_deltanet gdn_hybrid kda rwkv7 kda_shut_gate}
for mixer in $MIXERS; do
  config=configs/lm/${mixer}_tiny.yaml
  [ "$mixer" = softmax ] && config=configs/tiny_lm.yaml
  [ -f "$OUT/runs/$mixer/checkpoints/latest" ] && continue
  OMP_NUM_THREADS=1 $PY launch/pretrain.py --config "$config" run.dir="$OUT/runs/$mixer" \
      data.tokenizer="$OUT/tok.model" data.train_shards="$OUT/train" data.val_shards=null data.num_workers=0 \
      train.seq_len=2048 train.micro_batch_size=2 train.max_steps=500 log.every=10 checkpoint.every=100
done
ADD=()
[ -f benchmarks/context_position_cpu.json ] && ADD=(--add)
OMP_NUM_THREADS=1 $PY tools/context_position.py --run $(for m in $MIXERS; do echo "$m=$OUT/runs/$m"; done) \
    --data "$OUT/test" --contexts 16 64 256 2048 24576 "${ADD[@]}" \
    --json benchmarks/context_position_cpu.json --plot benchmarks/context_position_cpu.png
