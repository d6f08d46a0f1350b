#!/usr/bin/env bash
# Issue 30 in one device call (benchmarks/notes_triton.md, "Next session with a GPU"): correctness on CUDA, the
# device's ceilings, the op benchmark, a few dozen training steps of three ~350M LMs, the bf16 ZeRO test, then the
# launch-settings sweep with what time is left. Each stage runs under its own limit, cut to the time left of
# BUDGET_S, so a slow stage costs the later ones, not the whole call's output. Needs `.whl/` (carried; see the
# notes) and `.gpudata/` (a tokenizer and shards made on CPU: tools/train_tokenizer.py, tools/make_shards.py).
#   run: bash benchmarks/gpu_session.sh        (everything lands in $OUT: at most 8 files come back)
set -u
OUT=${OUT:-/tmp/gpu_out}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
LOG=$OUT/session.log
exec > >(tee -a "$LOG") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda

stage() {  # stage NAME LIMIT_S COMMAND...: run it under min(LIMIT_S, time left), say how it ended
    local name=$1 limit=$2 left=$((BUDGET_S - SECONDS))
    shift 2
    ((left < limit)) && limit=$left
    if ((limit < 15)); then echo "=== $name: skipped, ${left}s left"; return; fi
    echo "=== $name (limit ${limit}s, at ${SECONDS}s)"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@"
    echo "=== $name: rc=$? in $((SECONDS - start))s"
}

stage env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)";
  python3 -c "import fla, deepspeed; print(\"fla\", fla.__version__, \"deepspeed\", deepspeed.__version__)"'

# Item 1 and 2: the gpu-marked tests, and the Triton tests without the interpreter.
stage pytest_ops 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/ops/test_linear_attention.py \
    tests/ops/test_fla.py tests/engine/test_softmax.py
stage pytest_triton 120 python3 -m pytest -q -p no:cacheprovider -rfEs -x tests/ops/test_linear_attention_triton.py

stage check_ceilings 90 python3 tools/bench_triton_gpu.py --check --ceilings --out "$OUT/gpu.json"
# Item 3: B=8 H=32 D=128 bf16, ours / fla / SDPA's flash kernel side by side.
stage bench 170 python3 tools/bench_triton_gpu.py --bench 1024,2048,4096,8192,16384,32768 --out "$OUT/gpu_bench.json"

# Item 4: ~350M (dim 1024, 24 layers, head dim 128) at seq_len 4096, bf16, ZeRO 2, one GPU on nccl.
train() {  # train NAME CONFIG [OVERRIDES...]
    local name=$1 config=$2
    shift 2
    rm -rf "/tmp/train_$name"
    stage "train_$name" 90 python3 -m torch.distributed.run --standalone --nproc_per_node=1 launch/pretrain.py \
        --config "$config" "run.dir=/tmp/train_$name" model.vocab_size=0 model.dim=1024 model.n_layers=24 \
        model.n_heads=8 data.tokenizer=.gpudata/tok/stdlib.model data.train_shards=.gpudata/shards/train \
        data.val_shards=.gpudata/shards/valid data.num_workers=1 data.shuffle_buffer=100 train.seq_len=4096 \
        train.micro_batch_size=4 train.grad_accum_steps=1 train.max_steps=30 log.every=5 log.val_every=1000 \
        checkpoint.every=1000 schedule.warmup_steps=5 deepspeed.zero_stage=2 deepspeed.precision=bf16 "$@"
    cp "/tmp/train_$name/metrics.jsonl" "$OUT/train_$name.jsonl" 2>/dev/null
}
train softmax configs/softmax_lm_1b.yaml
train linear configs/lm/linear_1b.yaml
train gdn_hybrid configs/lm/gdn_hybrid_1b.yaml

stage pytest_bf16_zero 100 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/train/test_bf16_zero.py
stage sweep 120 python3 tools/bench_triton_gpu.py --sweep --out "$OUT/gpu_sweep.json"
echo "=== done at ${SECONDS}s"
