#!/usr/bin/env bash
# Downloads, on the CPU box, the wheels the GPU machine lacks (it has no
# network): FlashInfer and what its import and JIT need, plus the runtime and
# test packages its image does not ship. They land in .wheels/ (gitignored),
# which scripts/gpu_check.sh installs; pass it to the device tool with carry.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .wheels
pip download --no-deps --only-binary=:all: -d .wheels \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 \
  flashinfer-python==0.6.4 apache-tvm-ffi nvidia-ml-py ninja structlog orjson pytest-asyncio snac einops pillow \
  soundfile cffi pycparser
# The parity tests' reference is transformers: the GPU machine gets the version
# this box (and so CI) runs, with what it needs beyond the image's packages
# (numpy, which the image has, is left out to stay under the carry limit).
tf=$(python -c 'import transformers; print(transformers.__version__)')
mkdir -p .wheels/hf
pip download -q --only-binary=:all: -d .wheels/hf \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 "transformers==$tf"
rm -f .wheels/hf/numpy-*.whl
# fla-core's Triton kernels, which scripts/probe_delta_prefill.py judges against
# mstar's own delta rule; installed only for that probe (gpu_check.sh qwen35)
mkdir -p .wheels/fla
pip download -q --no-deps -d .wheels/fla fla-core==0.6.0
du -sh .wheels
