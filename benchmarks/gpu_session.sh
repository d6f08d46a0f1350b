#!/usr/bin/env bash
# Issue 48 (round 4) in one device call: the step's profile before and after this round's changes, the new Triton
# kernels on CUDA, then what the first session left. Each stage runs under its own limit, cut to the time left of
# BUDGET_S, so a slow stage costs the later ones, not the whole call's output; ONLY="name ..." runs just those stages
# (a second call picks up where the first ran out). Needs `.whl/` and `.gpudata/` (bash benchmarks/gpu_prepare.sh,
# on CPU, about two minutes); `.gpucache/triton.tgz`, when carried, is Triton's compile cache from an earlier call
# (compiling and autotuning, not running, spent the first session's minutes). The call leaves an updated cache in
# $OUT: copy it to .gpucache/ and carry it next time.
#   run(command="BUDGET_S=570 bash benchmarks/gpu_session.sh", carry=[".whl", ".gpudata", ".gpucache"], timeout_s=600)
set -u
OUT=${OUT:-/tmp/gpu_out}
BUDGET_S=${BUDGET_S:-560}
ONLY=${ONLY:-}
CACHE_S=25  # kept back at the end to pack the compile cache
RES=/tmp/gpu_results  # each stage's files; packed into $OUT/results.tgz after every stage (8 files come back at most)
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$OUT/session.log") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TRITON_CACHE_DIR=/tmp/triton_cache \
    TRITON_CACHE_AUTOTUNING=1 TORCHINDUCTOR_CACHE_DIR=/tmp/triton_cache/inductor
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpucache/triton.tgz ] && tar -xzf .gpucache/triton.tgz -C "$TRITON_CACHE_DIR" && echo "compile cache restored"

stage() {  # stage NAME LIMIT_S COMMAND...: run it under min(LIMIT_S, time left), say how it ended
    local name=$1 limit=$2 left=$((BUDGET_S - CACHE_S - SECONDS))
    shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    ((left < limit)) && limit=$left
    if ((limit < 15)); then echo "=== $name: skipped, ${left}s left"; return; fi
    echo "=== $name (limit ${limit}s, at ${SECONDS}s)"
    local start=$SECONDS
    timeout -k 10 "$limit" bash -c "$(declare -f profile); \"\$@\"" _ "$@"  # a function runs too
    echo "=== $name: rc=$? in $((SECONDS - start))s"
    tar -czf "$OUT/results.tgz" -C "$RES" .
}

PYTEST="python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short"
# The first session's ~308M LM at 4k context on one GPU, bf16, ZeRO 2 (configs/softmax_lm_1b.yaml's one-node settings)
LM="model.vocab_size=0 model.dim=1024 model.n_layers=24 model.n_heads=8 data.tokenizer=.gpudata/tok/stdlib.model
  data.train_shards=.gpudata/shards/train data.val_shards=.gpudata/shards/valid data.num_workers=1
  train.seq_len=4096 train.micro_batch_size=4 train.grad_accum_steps=1"
export LM RES
profile() {  # profile NAME CONFIG [k=v ...]: the trainer's tokens/s and MFU, and the step's time by category
    local name=$1 config=$2
    shift 2
    python3 -m torch.distributed.run --standalone --nproc_per_node=1 tools/profile_step.py --config "$config" \
        --steps 3 --warmup 3 --top 5 --out "/tmp/prof_$name" --json "$RES/profile_$name.json" $LM "$@"
}

stage env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c "import torch, triton, deepspeed; print(torch.__version__, triton.__version__, deepspeed.__version__)
import torch.nn.attention.varlen as v; print(\"varlen_attn\", hasattr(v, \"varlen_attn\"))"'

# 1. Before: the step as the first session measured it (softmax once per document, no compiled blocks)
stage profile_linear_before 120 profile linear_before configs/lm/linear_1b.yaml train.compile=false
stage profile_softmax_before 120 profile softmax_before configs/softmax_lm_1b.yaml train.compile=false \
    model.mixer_options.softmax.impl=sdpa

# 3. The new kernels on CUDA, without the interpreter (their CPU tests ran them under TRITON_INTERPRET=1), and
#    softmax's one-call forms against SDPA per document in bf16, with no host sync in a step
stage kernel_tests 150 $PYTEST --timeout=120 tests/ops/test_decayed_linear_attention_triton.py \
    tests/ops/test_delta_rule_triton.py
stage softmax_tests 60 $PYTEST --timeout=60 -m gpu tests/engine/test_softmax.py

# 2. After: softmax through varlen_attn, every block compiled, our Triton kernels under the GDN hybrid
stage profile_softmax_after 150 profile softmax_after configs/softmax_lm_1b.yaml train.compile=true
stage profile_linear_after 150 profile linear_after configs/lm/linear_1b.yaml train.compile=true
stage profile_gdn_after 180 profile gdn_after configs/lm/gdn_hybrid_1b.yaml train.compile=true

# 3. The op table: ours against our chunk forms, fla where it runs on this image, and SDPA's flash kernel
stage bench_ops 150 python3 tools/bench_triton_gpu.py --bench 1024,4096,16384 \
    --only linear_triton,decay_triton,gated_delta_triton,sdpa_flash,decay_chunk,gated_delta_chunk \
    --out "$RES/gpu_bench_ops.json"
# issue 45: segmented linear-attention kernels at 32k, few sequences × heads (B=1, H=16) against whole ones, and the
# rule's other side (B=8, H=32 forced into segments); notes_triton.md "Segments" has the predictions
stage segments 90 python3 tools/bench_triton_gpu.py --segments --out "$RES/gpu_segments.json"
stage bench_softmax 60 python3 tools/bench_softmax_packed.py --device cuda --dtype bf16 --batch 8 \
    --seq-len 4096 --heads 16 --head-dim 64 --impls sdpa,varlen,masked

# 2. at 16k: linear-time mixers against softmax (the goal: more tokens/s than softmax at 16k)
stage profile_gdn_16k 150 profile gdn_16k configs/lm/gdn_hybrid_1b.yaml train.compile=true train.seq_len=16384 \
    train.micro_batch_size=1
stage profile_softmax_16k 150 profile softmax_16k configs/softmax_lm_1b.yaml train.compile=true \
    train.seq_len=16384 train.micro_batch_size=1

# 4. What the first session left: the launch-settings sweep, the bf16 ZeRO test on CUDA
stage sweep 90 python3 tools/bench_triton_gpu.py --sweep --out "$RES/gpu_sweep.json"
stage bf16_zero 100 $PYTEST -m gpu tests/train/test_bf16_zero.py

tar -czf "$OUT/triton.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "$OUT/triton.tgz"  # over 16 MiB it does not come back
echo "=== done at ${SECONDS}s"
for f in "$RES"/profile_*.json; do  # the short table the reply carries: tokens/s and MFU per run
  [ -f "$f" ] && python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/', 1)[-1],
  {k: d['throughput'].get(k) for k in ('train/tokens_per_s', 'train/mfu')}, round(d['step_ms'], 1), 'ms')" "$f"
done
