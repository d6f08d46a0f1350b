#!/usr/bin/env bash
# Tokens per GiB (issue 29): the longest row one rank trains within 2 GiB, the base commit's code against this one's
# defaults and its mini-sequence blocks (model.mini_sequence, with and without activation checkpointing), one
# after the other in one run, the machine's load beside every figure. Writes benchmarks/tokens_per_gib_cpu/*.md, *.json.
#   BASE=ae986c2 bash benchmarks/tokens_per_gib_cpu.sh      (BASE: the commit measured as "today"; ~25 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=2 MALLOC_MMAP_THRESHOLD_=1048576  # glibc hands buffers over 1 MiB back when freed
PYTHON=${PYTHON:-python}
BASE=${BASE:-ae986c2}
today=$(mktemp -d)
trap 'rm -rf "$today"' EXIT
git archive "$BASE" | tar -x -C "$today"  # a plain copy of the base commit: its tool, its model code
out=benchmarks/tokens_per_gib_cpu  # one .json and .md per part
mkdir -p "$out"
common=(--budget-gb 2 --timeout 600)
sliced=sliced=model.mini_sequence=4096
both=sliced+ckpt=model.mini_sequence=4096,deepspeed.activation_checkpointing=true
uptime
# 1. N=1, today's code (its own tool, which knows no variants): the row it fits, and its tokens/s at 65,536
PYTHONPATH="$today" "$PYTHON" "$today/tools/bench_sequence_parallel.py" --sizes 1 --seq-lens 65536,98304 --steps 2 \
    "${common[@]}" --json "$out/today_n1.json" --markdown "$out/today_n1.md"
# 2. N=1, this code: defaults and the new options side by side at 65,536 and 131,072
PYTHONPATH=$PWD "$PYTHON" tools/bench_sequence_parallel.py --sizes 1 --seq-lens 65536,131072 --steps 2 "${common[@]}" \
    --variant defaults= --variant "$sliced" --variant "$both" --json "$out/n1.json" --markdown "$out/n1.md"
# 3. N=1, the new options past 131,072
PYTHONPATH=$PWD "$PYTHON" tools/bench_sequence_parallel.py --sizes 1 --seq-lens 196608,262144 --steps 1 "${common[@]}" \
    --variant "$sliced" --variant "$both" --json "$out/n1_long.json" --markdown "$out/n1_long.md"
# 4. N=2: today's code at 131,072 (a rank holds 65,536), the new option at 262,144 (131,072 each)
PYTHONPATH="$today" "$PYTHON" "$today/tools/bench_sequence_parallel.py" --sizes 2 --seq-lens 131072 --steps 1 \
    "${common[@]}" --json "$out/today_n2.json" --markdown "$out/today_n2.md"
PYTHONPATH=$PWD "$PYTHON" tools/bench_sequence_parallel.py --sizes 2 --seq-lens 262144 --steps 1 "${common[@]}" \
    --variant "$sliced" --json "$out/n2.json" --markdown "$out/n2.md"
# 5. tokens/s: the variants stepped in turn in one process at 32,768 tokens, so the machine's load slows them alike
PYTHONPATH=$PWD "$PYTHON" tools/bench_sequence_parallel.py --no-memory --speed-rounds 6 --seq-lens 32768 \
    --variant defaults= --variant "$sliced" --variant "$both" --json "$out/speed.json" --markdown "$out/speed.md"
uptime
