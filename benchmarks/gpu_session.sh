#!/usr/bin/env bash
# Issue 48 in one device call: the step's profile (compiled, eager, at 4k and 16k), our Triton kernels on CUDA, the
# op table and launch sweep. Each stage runs under its own limit, cut to the time left of
# BUDGET_S, so a slow stage costs the later ones, not the whole call's output; ONLY="name ..." runs just those stages
# (a second call picks up where the first ran out). Needs `.whl/` and `.gpudata/` (bash benchmarks/gpu_prepare.sh,
# on CPU, about two minutes); `.gpucache/triton.tgz.*`, when carried, is Triton's compile cache (compiling, not
# running, spent the first two sessions' minutes): built on CPU by `WARM_CACHE=1 bash benchmarks/gpu_prepare.sh`
# (tools/warm_triton_cache.py: the kernel tests', op table's and eager steps' kernels for sm_90; the env stage's
# triton_key says whether the device reads it, each stage's "kernels compiled" how much it saved), or left by an
# earlier call. The call leaves an updated cache in
# $OUT as triton.tgz.a, .b, ...: copy them to .gpucache/ and carry it next time (mind the 64 MiB a call carries).
#   run(command="BUDGET_S=570 bash benchmarks/gpu_session.sh", carry=[".whl", ".gpudata", ".gpucache"], timeout_s=600)
# A session has 15 minutes of device time in all, the machine's start included (round 4 held it 807 s for 752 s of
# stages, two calls), and the stages' limits add up to far more: the first call reaches about kernel_tests_new
# (further if the kernel tests' eight workers cut their compiling as hoped: each stage prints what it compiled), a
# second on the still-warm machine the first profiles it did not reach, the GDN hybrid's 4k step compiled and eager
# first (ONLY="profile_gdn_compiled profile_gdn_eager", BUDGET_S=200); the rest waits for the next device session.
# Rehearse it on CPU before spending device minutes (tests/train/test_gpu_plan.py does, in CI): every stage runs its
# command checked, not run (the tools with --dry-run: arguments, op names, configs and overrides, the model built on
# the meta device; pytest collecting the tests named), so a misspelt flag, test, key or stage name fails here:
#   PATH=$PWD/.venv/bin:$PATH REHEARSE=1 bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-/tmp/gpu_out}
BUDGET_S=${BUDGET_S:-560}
ONLY=${ONLY:-}
REHEARSE=${REHEARSE:-}
GPUDATA=${GPUDATA:-.gpudata}  # benchmarks/gpu_prepare.sh's data
CACHE_S=25  # kept back at the end to pack the compile cache
RES=${RES:-/tmp/gpu_results}  # each stage's files; packed into $OUT/results.tgz after every stage (8 files come back)
for name in $ONLY; do  # a misspelt name would skip its stage silently
  grep -q "^stage $name " "$0" || { echo "ONLY: no stage named $name; the stages:" \
    $(sed -n 's/^stage \([a-z0-9_]*\) .*/\1/p' "$0"); exit 2; }
done
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$OUT/session.log") 2>&1

if [ -n "$REHEARSE" ]; then
  echo "rehearsal: every stage checked, nothing run"
  export PYTHONPATH=$PWD DRY=--dry-run LAUNCH=python3 WORKERS=
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD DRY= LAUNCH="python3 -m torch.distributed.run --standalone --nproc_per_node=1"
  # The kernel tests' time is Triton compiling each variant they launch (round 4: most of 130 s), one at a time in
  # one process: eight pytest-xdist workers (the image has it) compile side by side on the device's 16 cores
  export WORKERS="-n 8 --dist load"
fi
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1 \
    TORCHINDUCTOR_CACHE_DIR=/tmp/triton_cache/inductor
mkdir -p "$TRITON_CACHE_DIR"
ls .gpucache/triton.tgz.* >/dev/null 2>&1 && cat .gpucache/triton.tgz.* | tar -xzf - -C "$TRITON_CACHE_DIR" \
    && echo "compile cache restored: $(find "$TRITON_CACHE_DIR" -name "__grp__*" | wc -l) kernels"

cached_kernels() {  # Triton's and inductor's compiled kernels in the cache: a stage's rise is what it compiled
    find "$TRITON_CACHE_DIR" -name '__grp__*' | wc -l
}

stage() {  # stage NAME LIMIT_S COMMAND...: run it under min(LIMIT_S, time left), say how it ended
    local name=$1 limit=$2 left=$((BUDGET_S - CACHE_S - SECONDS))
    shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    ((left < limit)) && limit=$left
    if ((limit < 15)); then echo "=== $name: skipped, ${left}s left"; return; fi
    echo "=== $name (limit ${limit}s, at ${SECONDS}s)"
    local start=$SECONDS cached
    cached=$(cached_kernels)
    timeout -k 10 "$limit" bash -c "$(declare -f profile); \"\$@\"" _ "$@"  # a function runs too
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start))s, $(($(cached_kernels) - cached)) kernels compiled"
    tar -czf "$OUT/results.tgz" -C "$RES" .
}

PYTEST="python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short ${REHEARSE:+--collect-only -q}"
BENCH="python3 tools/bench_triton_gpu.py $DRY"
# The first session's ~308M LM at 4k context on one GPU, bf16, ZeRO 2 (configs/softmax_lm_1b.yaml's one-node settings)
LM="model.vocab_size=0 model.dim=1024 model.n_layers=24 model.n_heads=8 data.tokenizer=$GPUDATA/tok/stdlib.model
  data.train_shards=$GPUDATA/shards/train data.val_shards=$GPUDATA/shards/valid data.num_workers=1
  train.seq_len=4096 train.micro_batch_size=4 train.grad_accum_steps=1"
export LM RES
profile() {  # profile NAME CONFIG [k=v ...]: the trainer's tokens/s and MFU, and the step's time by category
    local name=$1 config=$2
    shift 2
    $LAUNCH tools/profile_step.py $DRY --config "$config" --steps 3 --warmup 3 --top 5 --out "/tmp/prof_$name" \
        --json "$RES/profile_$name.json" $LM "$@"
}

# triton_key: what Triton's compile cache keys start from (its version, its sources and libtriton's bytes). If it is
# PyPI's triton 3.6.0 for cp312 (bd4757a49ddb4e61, computed on CPU), the cache could be compiled on CPU beforehand
stage env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c "import torch, triton, deepspeed; print(torch.__version__, triton.__version__, deepspeed.__version__)
import torch.nn.attention.varlen as v; print(\"varlen_attn\", hasattr(v, \"varlen_attn\"))
import hashlib; from triton.runtime.cache import triton_key
print(\"triton_key\", hashlib.sha256(triton_key().encode()).hexdigest()[:16])"'

# Round 5 (benchmarks/gpu_h200_round4.md says what the last session found and why these come first).
# 1. Our kernels first: the delta rule's forward and backward were rebuilt on CPU since they last ran on a device
#    (one autograd Function of kernels per block; no spills by the sm_90 report), and a miscompile there would void
#    every figure after it. Then where each op's fwd+bwd spends its time at 16k, and the op table at 4k-32k with the
#    copy ceiling (issue 45: the delta rule <= 1.5x the linear kernel at 16k; linear >= 50 % of the ceiling at 32k)
stage kernel_tests 150 $PYTEST $WORKERS --timeout=100 tests/ops/test_delta_rule_triton.py tests/ops/test_linear_attention_triton*.py
stage op_profile 90 $BENCH \
    --profile gated_delta_triton,kda_triton,dplr_triton,decay_triton,linear_triton --out "$RES/gpu_op_profile.json"
stage bench_ops 150 $BENCH --ceilings --bench 4096,16384,32768 \
    --only linear_triton,decay_triton,gated_delta_triton,kda_triton,dplr_triton,sdpa_flash,short_conv_naive,short_conv_triton \
    --out "$RES/gpu_bench_ops.json"
# The DPLR kernels (KDA's and the general rule's) and the decayed kernels' segments, all new and interpreter-only so
# far, after the table: a miscompile there voids their rows of it, not the others'; and the norm on torch's fused
# kernels (the eager profiles below run it); the short convolution's kernels (the loop's launches are a third of a
# Gated DeltaNet block's)
stage kernel_tests_new 150 $PYTEST $WORKERS --timeout=100 tests/ops/test_kda_triton.py tests/ops/test_dplr_triton.py \
    tests/ops/test_decayed_linear_attention_triton.py tests/ops/test_short_conv_triton.py \
    tests/engine/test_model.py::test_rms_norm_on_cuda_runs_torchs_fused_kernels_and_agrees_with_ours

# 2. The compiled step, now that it compiles once per kind of block and grad mode: 4k, then 16k against softmax
stage profile_linear_compiled 150 profile linear_compiled configs/lm/linear_1b.yaml train.compile=true
stage profile_gdn_compiled 180 profile gdn_compiled configs/lm/gdn_hybrid_1b.yaml train.compile=true
# the same eager: its kernels per step against the compiled one's, now that the norms run on torch's fused kernels
# and the short convolutions on ours (about a third of an eager GDN block's launches were the convolutions' loops)
stage profile_gdn_eager 150 profile gdn_eager configs/lm/gdn_hybrid_1b.yaml train.compile=false
stage profile_softmax_compiled 150 profile softmax_compiled configs/softmax_lm_1b.yaml train.compile=true
stage profile_gdn_16k 150 profile gdn_16k configs/lm/gdn_hybrid_1b.yaml train.compile=true train.seq_len=16384 \
    train.micro_batch_size=1
stage profile_softmax_16k 150 profile softmax_16k configs/softmax_lm_1b.yaml train.compile=true \
    train.seq_len=16384 train.micro_batch_size=1
# 3. Eager softmax through varlen (what varlen gives without compiling), and an eager step 4x as large (how much
#    of the device's idle time is the host issuing kernels: the last session's eager steps idled 65-79 %)
stage profile_softmax_varlen 120 profile softmax_varlen configs/softmax_lm_1b.yaml train.compile=false
stage profile_linear_mb16 150 profile linear_mb16 configs/lm/linear_1b.yaml train.compile=false \
    train.micro_batch_size=16

# 4. Launch settings. Segmented linear-attention kernels at 32k, few sequences x heads (B=1, H=16) against whole
#    ones, the rule's other side (B=8, H=32 forced into segments), and packed rows (B=1, H=16: 20 documents with one
#    of 8k; a 30k document among 100 of 20 tokens) whole and cut by the table, linear and decayed (notes_triton.md
#    "Segments"); the linear and decayed kernels' sweep; the delta rule's (value block, warps, stages of its scans)
stage segments 150 $BENCH --segments --out "$RES/gpu_segments.json"
stage sweep 150 $BENCH --sweep --out "$RES/gpu_sweep.json"
stage sweep_delta 150 $BENCH --sweep-delta --out "$RES/gpu_sweep_delta.json"

# Triton's and inductor's caches, in parts under the 16 MiB a returned file may have (the last one was 49 MB)
tar -czf - -C "$TRITON_CACHE_DIR" . | split -b 15m -a 1 - "$OUT/triton.tgz." && ls -la "$OUT"/triton.tgz.*
echo "=== done at ${SECONDS}s"
for f in "$RES"/profile_*.json; do  # the short table the reply carries: tokens/s and MFU per run
  if [ -f "$f" ]; then python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/', 1)[-1],
  {k: d['throughput'].get(k) for k in ('train/tokens_per_s', 'train/mfu')}, round(d['step_ms'], 1), 'ms')" "$f"; fi
done
