#!/usr/bin/env bash
# Everything a device call carries, made on CPU before it (about two minutes): `.whl/` holds the packages the
# H200 image lacks (its python3 is 3.12: KINDS.md of the device tool lists what it has), `.gpudata/` the training
# data of benchmarks/gpu_session.sh (the corpus of tools/demo.py, a 4,096-piece tokenizer, shards). Both ignored.
#   bash benchmarks/gpu_prepare.sh        then: run(command="BUDGET_S=570 bash benchmarks/gpu_session.sh",
#                                              carry=[".whl", ".gpudata", ".gpucache"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

if [ ! -d .whl ]; then
  mkdir -p .whl
  # pure Python, or built for cp312 on manylinux: the image's interpreter; one version of each (two stop the install)
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      fla-core==0.6.0 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
      typing-inspection==0.4.5 typing_extensions==4.16.0 omegaconf==2.4.0 webdataset==1.0.2 braceexpand==0.1.7
  # DeepSpeed has no wheel on PyPI: built here, pure Python (its accelerator is found at run time)
  $PY -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
fi
for wheel in .whl/*.whl; do  # what each needs beyond the image, for a reader to check against KINDS.md's list
  unzip -p "$wheel" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|$(basename "$wheel"): |" || true
done > .whl/requires.txt
echo "wheels: $(ls .whl/*.whl | wc -l) in .whl ($(du -sh .whl | cut -f1)); their needs in .whl/requires.txt"

if [ ! -f .gpudata/shards/valid/manifest.json ]; then
  $PY -c "from pathlib import Path; import sys; sys.path.insert(0, 'tools'); from demo import write_corpus
write_corpus(Path('.gpudata/corpus'), 3_000_000, 50_000)"
  $PY tools/train_tokenizer.py --input .gpudata/corpus/train.jsonl --vocab-size 4096 --out .gpudata/tok/stdlib
  for split in train valid; do
    $PY tools/make_shards.py text --input .gpudata/corpus/$split.jsonl --tokenizer .gpudata/tok/stdlib.model \
        --out .gpudata/shards/$split --docs-per-shard 64
  done
fi
echo "data: $(du -sh .gpudata | cut -f1) in .gpudata"

# With WARM_CACHE=1, also Triton's compile cache for the device, built here (tools/warm_triton_cache.py: the plan's
# kernel tests, op table, eager steps and launch sweeps compiled for sm_90 under the device image's Python, torch
# and Triton, in a 5 GB venv .py312 of their versions; about 45 minutes on two busy cores), packed into
# .gpucache/triton.tgz.a
if [ -n "${WARM_CACHE:-}" ]; then
  PY312=${PY312:-$(command -v python3.12 || echo "$HOME/.pyenv/versions/3.12.1/bin/python3.12")}
  if [ ! -x .py312/bin/python ]; then
    "$PY312" -m venv .py312
    .py312/bin/pip install -q torch==2.11.0 triton==3.6.0 numpy pytest pytest-timeout omegaconf sentencepiece \
        tqdm webdataset braceexpand safetensors pillow tensorboard
  fi
  .py312/bin/python -O tools/warm_triton_cache.py --cache .tritoncache
fi
