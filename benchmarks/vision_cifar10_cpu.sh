#!/usr/bin/env bash
# CIFAR-10 on CPU, one backbone per mixer, the same budget each: half an epoch (STEPS=391 steps × 64 = 25 024 images,
# the cosine schedule decaying over them), one process with one thread (on the shared, oversubscribed 2-core machine
# two OpenMP threads ran 17× slower than one), one run after another; then tools/eval_cls.py on the 10 000 test
# images. Appends one JSON line per mixer to OUT/results_seedSEED.jsonl.
#   SEED=0 benchmarks/vision_cifar10_cpu.sh [OUT=/tmp/cifar]   (shards in OUT/train and OUT/test, made as in README)
set -euo pipefail
OUT=${1:-/tmp/cifar}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-391}
SEED=${SEED:-0}
export OMP_NUM_THREADS=1
results="$OUT/results_seed$SEED.jsonl"
: > "$results"
for mixer in softmax linear inline soft aft_conv; do
  run="$OUT/runs/seed$SEED/$mixer"
  rm -rf "$run" && mkdir -p "$(dirname "$run")"
  config="configs/vision/cifar10_$mixer.yaml"
  params=$($PY launch/pretrain.py --config "$config" --dry-run data.train_shards="$OUT/train" 2>/dev/null | tail -1)
  start=$(date +%s.%N)
  $PY launch/pretrain.py --config "$config" run.dir="$run" run.seed="$SEED" data.train_shards="$OUT/train" \
      data.val_shards=null train.max_steps="$STEPS" log.every=1 > "$run.train.log" 2>&1
  end=$(date +%s.%N)
  scores=$($PY tools/eval_cls.py --run "$run" --data "$OUT/test" --batch-size 250 --json 2> "$run.eval.log" | tail -1)
  $PY - "$mixer" "$config" "$SEED" "$start" "$end" "$params" "$scores" "$run" >> "$results" <<'PYEOF'
import json, sys
mixer, config, seed, start, end, params, scores, run = sys.argv[1:]
metrics = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
train = [m for m in metrics if "train/loss" in m]
last, wall = train[-1], float(end) - float(start)
print(json.dumps({"mixer": mixer, "config": config, "seed": int(seed), "parameters": json.loads(params)["parameters"],
                  "train_flops_per_image": json.loads(params)["flops_per_image"], "steps": last["step"],
                  "images_seen": last["train/images_seen"], "wall_s": round(wall, 1),
                  "images_per_s": round(last["train/images_seen"] / wall, 1),
                  "train_loss_last_20_steps": sum(m["train/loss"] for m in train[-20:]) / len(train[-20:]),
                  **json.loads(scores)}))
PYEOF
  tail -n 1 "$results"
done
