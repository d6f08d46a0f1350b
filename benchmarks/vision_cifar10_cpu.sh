#!/usr/bin/env bash
# CIFAR-10 on CPU, one backbone per mixer, the same budget each: half an epoch (STEPS=391 steps × 64 = 25 024 images,
# the cosine schedule decaying over them), one process with one thread (on a shared, oversubscribed 2-core machine two OpenMP threads ran 17× slower than one),
# one run after another; then tools/eval_cls.py on the 10 000 test images. Writes OUT/results.jsonl.
#   benchmarks/vision_cifar10_cpu.sh [OUT=/tmp/cifar]      (shards in OUT/train and OUT/test, made as in README)
set -euo pipefail
OUT=${1:-/tmp/cifar}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-391}
export OMP_NUM_THREADS=1
: > "$OUT/results.jsonl"
for mixer in softmax linear inline soft aft_conv; do
  run="$OUT/runs/$mixer"
  rm -rf "$run"
  config="configs/vision/cifar10_$mixer.yaml"
  params=$($PY launch/pretrain.py --config "$config" --dry-run data.train_shards="$OUT/train" 2>/dev/null | tail -1)
  start=$(date +%s.%N)
  $PY launch/pretrain.py --config "$config" run.dir="$run" data.train_shards="$OUT/train" data.val_shards=null \
      train.max_steps="$STEPS" >  "$OUT/$mixer.train.log" 2>&1
  end=$(date +%s.%N)
  scores=$($PY tools/eval_cls.py --run "$run" --data "$OUT/test" --batch-size 250 --json 2> "$OUT/$mixer.eval.log" | tail -1)
  $PY - "$mixer" "$config" "$start" "$end" "$params" "$scores" "$run" >> "$OUT/results.jsonl" <<'PYEOF'
import json, sys
mixer, config, start, end, params, scores, run = sys.argv[1:]
metrics = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
last = max((m for m in metrics if "train/images_seen" in m), key=lambda m: m["step"])
wall = float(end) - float(start)
print(json.dumps({"mixer": mixer, "config": config, "parameters": json.loads(params)["parameters"],
                  "train_flops_per_image": json.loads(params)["flops_per_image"],
                  "images_seen": last["train/images_seen"], "steps": last["step"], "wall_s": round(wall, 1),
                  "images_per_s": round(last["train/images_seen"] / wall, 1),
                  "final_train_loss": last["train/loss"], **json.loads(scores)}))
PYEOF
  tail -1 "$OUT/results.jsonl"
done
