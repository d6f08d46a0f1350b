#!/usr/bin/env bash
# A 65,536-token context trained on 2 CPU ranks with each row split in two (parallel.sequence_parallel=2):
# preempted with SIGTERM once past step 15 (the trainer saves and stops), then relaunched to step 40 (resume). Data: War and Peace (../shared/data/text), paragraphs as
# documents packed into 65,536-token rows. Writes its run to ${OUT:-/tmp/sp65k}; the figures go to
# benchmarks/sequence_parallel_65k_cpu.md by hand from metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sp65k}
TEXT=../shared/data/text/warandpeace.txt
PY=.venv/bin/python
mkdir -p "$OUT"
[ -f "$OUT/tok.model" ] || $PY tools/train_tokenizer.py --input "$TEXT" --vocab-size 2000 --out "$OUT/tok"
[ -f "$OUT/train/manifest.json" ] || $PY tools/make_shards.py text --input "$TEXT" --tokenizer "$OUT/tok.model" \
    --out "$OUT/train" --docs-per-shard 2000
run() {
  OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node=2 launch/pretrain.py \
    --config configs/lm/linear_tiny.yaml run.dir="$OUT/run" data.tokenizer="$OUT/tok.model" \
    data.train_shards="$OUT/train/shard-{000000..000099}.tar" data.val_shards=null data.num_workers=0 \
    model.dim=64 model.n_layers=2 model.n_heads=2 train.seq_len=65536 train.micro_batch_size=1 \
    parallel.sequence_parallel=2 optim.lr=3e-3 optim.min_lr=3e-4 schedule.warmup_steps=5 \
    log.every=1 checkpoint.every=10 checkpoint.keep_last=2 deepspeed.zero_stage=2 "$@"
}
setsid bash -c "$(declare -f run); OUT=$OUT PY=$PY; run train.max_steps=40" > "$OUT/first.log" 2>&1 &
leader=$!
until grep -q '"step": 16' "$OUT/run/metrics.jsonl" 2>/dev/null; do sleep 2; done
kill -TERM -- -"$leader"
wait "$leader" || true
grep -h "stopped by\|saved checkpoint" "$OUT/first.log"
run train.max_steps=40 > "$OUT/second.log" 2>&1
grep -h "resumed from" "$OUT/second.log"
