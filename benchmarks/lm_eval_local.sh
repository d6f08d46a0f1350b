#!/usr/bin/env bash
# lm-evaluation-harness on a model trained here, offline, on a local multiple-choice task (issue 27): a tiny InLine LM
# (configs/lm/inline_tiny.yaml: 4 layers, width 256) trained on WikiText-2 for 300 steps of 4 × 256 tokens on one
# CPU thread, exported, and scored by `lm_eval --model hf` on "wikitext_order": 100 paragraphs of WikiText-2's test
# split, each cut after 20 words; the choices are the next 8 words and three other orders of the same 8 words
# (chance 25 %; the same words in each choice, so only what the model knows of word order counts). Writes its run to ${OUT:-/tmp/lm_eval_local}; lm-eval's results JSON goes to
# benchmarks/lm_eval_local.json, and the table it prints is in benchmarks/lm_eval_local.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lm_eval_local}
PY=${PY:-.venv/bin/python}
W=${W:-../shared/data/text/wikitext-2}
mkdir -p "$OUT/task"
[ -f "$OUT/tok.model" ] || $PY tools/train_tokenizer.py --input "$W/train.txt" --txt-docs wikitext --vocab-size 8192 \
    --out "$OUT/tok"
[ -f "$OUT/train/manifest.json" ] || $PY tools/make_shards.py text --input "$W/train.txt" --txt-docs wikitext \
    --tokenizer "$OUT/tok.model" --out "$OUT/train"
[ -f "$OUT/runs/inline/checkpoints/latest" ] || OMP_NUM_THREADS=1 $PY launch/pretrain.py \
    --config configs/lm/inline_tiny.yaml run.dir="$OUT/runs/inline" data.tokenizer="$OUT/tok.model" \
    data.train_shards="$OUT/train" data.val_shards=null data.num_workers=0 train.seq_len=256 train.max_steps=300 \
    checkpoint.every=300
$PY tools/export.py --run "$OUT/runs/inline" --out "$OUT/export"
$PY - "$W/test.txt" "$OUT/task" <<'PYEOF'
import json, random, sys
paragraphs = [line.strip().split() for line in open(sys.argv[1], encoding="utf-8")]
paragraphs = [words for words in paragraphs if len(words) >= 40 and words[0] != "="]
rng = random.Random(0)
chosen = rng.sample(range(len(paragraphs)), 100)
with open(f"{sys.argv[2]}/items.jsonl", "w", encoding="utf-8") as f:
    for i in chosen:
        words = paragraphs[i][20:28]
        choices = [" ".join(words)]
        while len(choices) < 4:  # the same words in three other orders: only word order tells them apart
            shuffled = " ".join(rng.sample(words, len(words)))
            if shuffled not in choices:
                choices.append(shuffled)
        order = rng.sample(range(4), 4)
        f.write(json.dumps({"context": " ".join(paragraphs[i][:20]), "choices": [choices[k] for k in order],
                            "answer": order.index(0)}) + "\n")
open(f"{sys.argv[2]}/wikitext_order.yaml", "w").write(f"""task: wikitext_order
dataset_path: json
dataset_kwargs:
  data_files:
    test: {sys.argv[2]}/items.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
PYEOF
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $PY -m lm_eval --model hf \
    --model_args "pretrained=$OUT/export,trust_remote_code=True,add_bos_token=True" \
    --tasks wikitext_order --include_path "$OUT/task" --device cpu --batch_size 8 --output_path "$OUT/lm_eval"
cp "$(ls -t "$OUT"/lm_eval/*/results_*.json | head -1)" benchmarks/lm_eval_local.json
