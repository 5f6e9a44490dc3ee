#!/usr/bin/env bash
# FlashInfer attention on the GPU machine: installs the carried wheels
# (.wheels/), compiles FlashInfer's prefill and decode kernels in one parallel
# build, runs tests/test_flashinfer_attention.py (and the layout tests), then
# the page-size benchmark (scripts/bench_page_size.py); logs land in $OUT.
# Through the device tool, from the repo root:
#   run(command="bash scripts/gpu_flashinfer_check.sh", carry=[".wheels"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export FLASHINFER_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_NVCC_THREADS=${FLASHINFER_NVCC_THREADS:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

python3 -m pip install -q --no-deps --no-index .wheels/*.whl 2>&1 | grep -v "root user" | tail -3
{
  nvidia-smi -L
  python3 -c 'import torch, triton, flashinfer; print("torch", torch.__version__, "triton", triton.__version__, "flashinfer", flashinfer.__version__)'
} 2>&1 | tee "$OUT/env.txt"

t0=$SECONDS
python3 -c 'import torch; from mstar.engine.flashinfer_attention import build_kernels; build_kernels(torch.bfloat16, 128)' \
  2>&1 | tail -40 | tee "$OUT/jit.txt"
echo "FlashInfer JIT build: $((SECONDS - t0)) s" | tee -a "$OUT/jit.txt"

t0=$SECONDS
# --noconftest: the shared conftest needs the HTTP test stack, which this machine lacks
timeout 300 python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=280 \
  tests/test_flashinfer_attention.py tests/test_paged_layout.py 2>&1 | tee "$OUT/tests.txt" | tail -60
rc=${PIPESTATUS[0]}
echo "tests: $((SECONDS - t0)) s, exit $rc"

t0=$SECONDS
timeout 240 python3 scripts/bench_page_size.py --out "$OUT/page_size.json" 2>&1 | tee "$OUT/page_size.txt" | tail -30
echo "benchmark: $((SECONDS - t0)) s"
exit $rc
