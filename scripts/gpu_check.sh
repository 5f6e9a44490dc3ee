#!/usr/bin/env bash
# The GPU machine's one script: installs the carried wheels (.wheels/, made by
# scripts/fetch_gpu_wheels.sh), runs the GPU tests, then the benchmarks, and
# leaves logs and results under $OUT. Run through the device tool from the
# repo root with carry=[".wheels"]:
#   scripts/gpu_check.sh tests      GPU tests only
#   scripts/gpu_check.sh bench      decode + host benchmarks only
#   scripts/gpu_check.sh quick      attention + engine GPU tests, then the host benchmark
#   scripts/gpu_check.sh profile    kernels by time in a decode step
#   scripts/gpu_check.sh orpheus    Orpheus GPU tests, then where a speech step's time goes
#   scripts/gpu_check.sh tts        the speech benchmark (scripts/bench_tts.py; $TTS_ARGS adds flags,
#                                   $TTS_SERVER_ARGS the server's)
#   scripts/gpu_check.sh speech     orpheus, then tts at the documented configuration (one call, ~8 min)
#   scripts/gpu_check.sh loops      tts once per --event-loop ($LOOPS, default "auto asyncio"), with $TTS_ARGS
#                                   and $TTS_SERVER_ARGS (e.g. --concurrency 384 ... and --kv-cache-dtype fp8)
#   scripts/gpu_check.sh overload   twice the real-time capacity offered to a server that admits 64 streams,
#                                   then overload-lazy
#   scripts/gpu_check.sh overload-lazy  64 streams on a KV pool too small for them (--kv-reservation lazy)
#   scripts/gpu_check.sh realtime   /v1/realtime: first audio delta and cancel to silence at 1/16/64 sessions
#   scripts/gpu_check.sh multi      two GPUs (nvidia-h200-x2): multi-GPU tests, transport benchmark, Orpheus
#                                   speech on both as replicas and split, with /metrics (lag, host time) sampled
#   scripts/gpu_check.sh pagesize   the attention page-size measurement
#   scripts/gpu_check.sh moe        the fused MoE kernel's GPU tests, then its benchmark against the torch loop
#                                   (scripts/bench_moe.py; $MOE_ARGS adds flags); no FlashInfer build
#   scripts/gpu_check.sh omni       the fused MoE and code2wav GPU tests, then Qwen3-Omni's spoken-answer
#                                   benchmark (scripts/bench_omni.py; $OMNI_ARGS adds flags)
#   scripts/gpu_check.sh compare    the decode step and host time per step of this tree against an older one,
#                                   base then new, twice: $BASE is a copy of the older tree (carried; see
#                                   scripts/base_tree.sh), $BASE_COMMIT its commit
#   scripts/gpu_check.sh scheduler  mixed-step, prefix cache and chunked prefill GPU tests, then
#                                   scripts/bench_scheduler.py (64 Orpheus streams; arrivals every 100 ms; a
#                                   4,000-token prompt) labelled $SCHED_LABEL (default $MSTAR_COMMIT), plus
#                                   $SCHED_ARGS (e.g. --control-streams 76); with $SCHED_UNMIXED set, again
#                                   with --no-mixed-steps
#   scripts/gpu_check.sh scheduler-profile  bench_scheduler.py with --profile 2: the worker's ops (by Python
#                                   stack too) in its steady and arrivals phases, served over HTTP
#   scripts/gpu_check.sh sampler    the wide-vocabulary draw's, the penalty's, the sampler graphs' and the fp8 projections' GPU
#                                   tests, then scripts/bench_sampler.py (it against the torch form, batch 1 to 400 over
#                                   Orpheus's vocabulary)
#   scripts/gpu_check.sh fp8        the fp8 projections' GPU tests (GEMM and one-row kernel), then scripts/bench_fp8.py
#                                   (their GEMMs against bf16, and Orpheus-3B's greedy tokens with and without
#                                   --quantization fp8)
#   scripts/gpu_check.sh kvdtype    decode attention over bf16 and fp8 KV pages, CUDA and tensor cores, 64-400 rows
#                                   (scripts/bench_kv_dtype.py; $KV_ARGS replaces its flags)
#   scripts/gpu_check.sh fp8kv      --kv-cache-dtype fp8's GPU tests: FlashInfer prefill and XQA decode over float8
#                                   pages (eager, graph buckets, mixed buckets) against the torch reference, the
#                                   stores into float8 pages, a served model; then the row quantizer's
#   scripts/gpu_check.sh codec      SNAC's kernels' and Orpheus's GPU tests, then SNAC windows' time and kernels in
#                                   float16 (scripts/bench_snac.py --profile): whole windows and played frames with
#                                   the residual units as modules, then played frames with them fused
#   scripts/gpu_check.sh arrivals   where the worker's time goes with new requests arriving beside 64 Orpheus
#                                   streams (scripts/profile_tts.py --arrivals 0.1): Python's profiler, then torch's
#   scripts/gpu_check.sh omni-bench only that benchmark
#   scripts/gpu_check.sh omni-profile  where a spoken answer's step time goes, by component and by kernel
#                                   (scripts/profile_omni.py; $OMNI_PROFILE_ARGS replaces its flags)
#   scripts/gpu_check.sh qwen35     Qwen3.5's GPU tests, a profile of its decode step (QWEN35_PROFILE=0 skips it),
#                                   its decode against the bandwidth floor (qwen3.5-9b shape,
#                                   dummy weights: scripts/bench_decode.py; $QWEN35_ARGS replaces its batches;
#                                   QWEN35_PROBES=0 keeps only the bf16 probe with fla-core)
#   scripts/gpu_check.sh first-burst  what the first burst of streams after startup pays (scripts/probe_first_burst.sh),
#                                   then one stream's and 64 streams' first audio with and without early_audio
#   scripts/gpu_check.sh gemv       the few-row projection kernel's GPU tests and Llama's parity with it, then
#                                   scripts/bench_gemv.py (it against cuBLAS at Orpheus-3B's shapes; $GEMV_ARGS adds
#                                   flags, e.g. the sweep's grid: --block-n 2 4 --programs-per-sm 0 2 4
#                                   --prefetch 0 1), then the decode
#                                   step at 1 and 64 rows of this tree against $BASE's (as compare, $ROUNDS rounds, default 2)
#   scripts/gpu_check.sh multistep  --num-scheduler-steps 4 against one step a launch: first audio and RTF at
#                                   1/64/400 streams (compare_tts.sh; $TTS_ARGS replaces its levels), then the
#                                   decode step and host time at 1/64/256 rows for N = 1, 4, 8; all in
#                                   $OUT/multistep.tgz (the device tool brings back 8 files at most)
#   scripts/gpu_check.sh all        tests and bench (default)
# FlashInfer compiles its kernels on first use into ~/.cache/flashinfer; a
# second call on the same (still warm) machine reuses them. Commands run
# beside it in the same call (`scripts/gpu_check.sh none; python3 scripts/...`)
# need `export PYTHONPATH=$PWD:$PWD/scripts` first: this script's export is
# its own.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_NVCC_THREADS=${FLASHINFER_NVCC_THREADS:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

python3 -m pip install -q --no-deps --no-index .wheels/*.whl 2>&1 | grep -v "root user" | tail -3
if [[ -d .wheels/hf ]]; then  # the transformers CI tests against (scripts/fetch_gpu_wheels.sh)
  python3 -m pip install -q --no-index --find-links .wheels/hf "$(ls .wheels/hf/transformers-*.whl)" 2>&1 \
      | grep -v "root user" | tail -3
fi
{
  nvidia-smi -L
  python3 -c 'import torch, triton, flashinfer, transformers; print("torch", torch.__version__, "triton", triton.__version__, "flashinfer", flashinfer.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$OUT/env.txt"

# FlashInfer's prefill and decode kernels in one parallel build, before anything needs them
if [[ $what != moe ]]; then
  t0=$SECONDS
  fp8=$([[ $what == gemv ]] && echo "" || echo "build_kernels(torch.bfloat16, 128, torch.float8_e4m3fn)")
  python3 -c "import torch; from mstar.engine.memory.flashinfer_attention import build_kernels; build_kernels(torch.bfloat16, 128); $fp8" \
    2>&1 | tail -20 | tee "$OUT/jit.txt"
  echo "FlashInfer JIT build: $((SECONDS - t0)) s" | tee -a "$OUT/jit.txt"
fi

if [[ $what == speech ]]; then  # the measured configuration of docs/benchmarks/tts.md, unless told otherwise
  : "${PROFILE_ARGS:=--concurrency 1 256 --tokens 256}"
  : "${TTS_ARGS:=--concurrency 1 16 64 256 384 --requests-per-client 1}"
  : "${TTS_SERVER_ARGS:=--max-num-seqs 512 --cuda-graph-max-batch 512}"
  : "${TTS_TIMEOUT:=420}"
fi

rc=0
if [[ $what == tests || $what == all ]]; then
  tests=$(ls tests/test_kernels_gpu.py tests/test_flashinfer_attention.py tests/test_paged_layout.py \
            tests/test_gpu_engine.py tests/test_llama_parity_model.py tests/test_paged_attention.py \
            tests/test_orpheus_gpu.py tests/test_logprobs_gpu.py tests/test_decode_graphs_gpu.py tests/test_sampler_graphs_gpu.py tests/test_prefix_cache.py \
            tests/test_mixed_graphs_gpu.py tests/test_mixed_steps.py tests/test_qwen35_gpu.py tests/test_qwen35_kernels.py \
            tests/test_gemv.py tests/test_gemv_fp8.py \
            2>/dev/null)
  # ~150 s on a machine that served before; a fresh one also compiles every Triton kernel the tests use (~420 s
  # on a fresh H200). Past $TESTS_S pytest is interrupted (SIGINT), so it still prints what failed so far, and
  # -v names every test that ran
  timeout -s INT -k 30 "${TESTS_S:-420}" python3 -m pytest -v -rfE -p no:cacheprovider -o timeout=250 $tests \
      > "$OUT/gpu_tests.txt" 2>&1
  rc=$?
  [[ $rc == 124 || $rc == 2 ]] && echo "the GPU tests ran past ${TESTS_S:-420} s: interrupted; $(grep -c ' PASSED' \
      "$OUT/gpu_tests.txt") passed before that" >> "$OUT/gpu_tests.txt"
  # the toys' runtime paths on CUDA (their CPU cases run in CI)
  timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider -k cuda tests/test_toy_omni.py tests/test_cfg_preemption.py \
      tests/test_toy_hybrid.py >> "$OUT/gpu_tests.txt" 2>&1 || rc=1
  tail -25 "$OUT/gpu_tests.txt"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 420 python3 scripts/bench_decode.py --model orpheus-3b --load-format dummy \
      --out "$OUT/decode.json" 2>&1 | grep -v "\[info" | tail -40 | tee "$OUT/bench_decode.txt"
  cp docs/benchmarks/decode.md "$OUT/" 2>/dev/null || true
  sleep 5  # let the driver take back the last process's memory before sizing a KV pool again
  timeout 240 python3 scripts/bench_host.py --model orpheus-3b --load-format dummy --devices cuda:0 \
      --batches 1 64 256 --tokens 64 2>&1 | grep -v "\[info" | tail -10 | tee "$OUT/bench_host.txt"
fi
if [[ $what == multistep ]]; then
  ms=/tmp/multistep
  mkdir -p $ms
  OUT=$ms ROUNDS=1 A_ARGS="" B_ARGS="--num-scheduler-steps 4" \
      SERVER_ARGS="--max-num-seqs 448 --kv-cache-dtype fp8 --audio-logits-only" \
      TTS_ARGS="${TTS_ARGS:---concurrency 1 64 400 --requests-per-client 1 --audio-tokens 512}" \
      timeout 300 scripts/compare_tts.sh
  for n in 1 4 8; do
    timeout 120 python3 scripts/bench_decode.py --model orpheus-3b --load-format dummy --skip-hf --batches 1 64 256 \
        --contexts 512 --new-tokens 24 --num-scheduler-steps $n --out $ms/decode_n$n.json 2>&1 \
        | grep -A4 "step ms" | head -5
  done
  tar czf "$OUT/multistep.tgz" -C /tmp multistep
fi
if [[ $what == compare ]]; then
  [[ -d ${BASE:-} ]] || { echo "compare needs BASE, a folder holding the older tree"; exit 2; }
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in "$BASE" "$PWD"; do
      name=$([[ $tree == "$PWD" ]] && echo new || echo base)
      commit=$([[ $tree == "$PWD" ]] && echo "${MSTAR_COMMIT:-}" || echo "${BASE_COMMIT:-}")
      echo "== $name ($commit), round $round" | tee -a "$OUT/compare.txt"
      (cd "$tree" && MSTAR_COMMIT=$commit PYTHONPATH=$PWD timeout 150 python3 scripts/bench_decode.py \
          --model orpheus-3b --load-format dummy --batches 1 64 --contexts 512 --skip-hf \
          --out "$OUT/decode_${name}_$round.json" 2>&1 | grep -v "\[info\|capturing" | tail -12) | tee -a "$OUT/compare.txt"
      (cd "$tree" && MSTAR_COMMIT=$commit PYTHONPATH=$PWD timeout 100 python3 scripts/bench_host.py \
          --model orpheus-3b --load-format dummy --devices cuda:0 --batches 1 64 256 --tokens 64 2>&1 \
          | grep -v "\[info\|capturing" | tail -8) | tee -a "$OUT/compare.txt"
    done
  done
fi
if [[ $what == quick ]]; then
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -o timeout=180 tests/test_flashinfer_attention.py \
      tests/test_gpu_engine.py > "$OUT/gpu_tests.txt" 2>&1
  rc=$?
  tail -5 "$OUT/gpu_tests.txt"
  timeout 100 python3 scripts/bench_host.py --model orpheus-3b --load-format dummy --devices cuda:0 \
      --batches 1 64 256 --tokens 64 2>&1 | grep -v "\[info\|capturing" | tail -8 | tee "$OUT/bench_host.txt"
fi
if [[ $what == profile || $what == bench || $what == all ]]; then
  timeout 240 python3 scripts/profile_decode.py --batch 1 64 256 --context 512 2>&1 | grep -v "\[info" \
      | tail -70 > "$OUT/profile.txt"
  tail -25 "$OUT/profile.txt"
fi
if [[ $what == orpheus || $what == speech ]]; then
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -o timeout=180 tests/test_orpheus_gpu.py \
      tests/test_kernels_gpu.py > "$OUT/gpu_tests.txt" 2>&1
  rc=$?
  tail -5 "$OUT/gpu_tests.txt"
  timeout 240 python3 scripts/profile_tts.py --concurrency 1 64 256 --tokens 512 --trace 2 ${PROFILE_ARGS:-} \
      2>&1 | grep -v "\[info\|capturing" > "$OUT/profile_tts.txt"
  head -40 "$OUT/profile_tts.txt"
fi
if [[ $what == tts || $what == speech ]]; then
  # Orpheus-3B (dummy weights) over loopback HTTP at 1/16/64/256 streams, plus transformers + snac baseline
  timeout ${TTS_TIMEOUT:-540} python3 scripts/bench_tts.py ${TTS_ARGS:-} --server-args "${TTS_SERVER_ARGS:-}" --out "$OUT/tts.json" --server-log "$OUT/tts_server.log" \
      2>&1 | tail -40 | tee "$OUT/bench_tts.txt"
fi
if [[ $what == loops ]]; then  # the speech benchmark once per event loop, same flags (uvloop's GIL against the standard loop's)
  for loop in ${LOOPS:-auto asyncio}; do
    timeout ${TTS_TIMEOUT:-270} python3 scripts/bench_tts.py ${TTS_ARGS:-} --server-args "${TTS_SERVER_ARGS:-} --event-loop $loop" \
        --out "$OUT/tts_$loop.json" --server-log "$OUT/tts_server_$loop.log" 2>&1 | tail -12 | tee "$OUT/bench_tts_$loop.txt"
  done
fi
if [[ $what == overload ]]; then
  # issue 7's overload goal: 128 closed-loop clients against 64 running + 16 waiting; the rest get 429 with
  # Retry-After and retry. Admitted streams must stay real time (SV), with no 5xx and no crash.
  timeout ${TTS_TIMEOUT:-480} python3 scripts/bench_tts.py --concurrency ${OVERLOAD_CLIENTS:-128} \
      --requests-per-client 2 --skip-baseline --out "$OUT/overload.json" --server-log "$OUT/overload_server.log" \
      --server-args "--max-num-seqs ${OVERLOAD_RUNNING:-64} --max-waiting-requests 16 --queue-timeout 2" \
      2>&1 | tail -20 | tee "$OUT/overload.txt"
fi
if [[ $what == overload || $what == overload-lazy ]]; then
  # --kv-reservation lazy with a pool too small for 64 streams (~70 pages of 16 each): rows get preempted
  # (swapped out) on the GPU; /metrics' preemption counter, polled while it runs, goes to lazy.txt
  (while sleep 5; do curl -s 127.0.0.1:18123/metrics | grep '^mstar_preempt' | sed "s/^/$SECONDS s /"; done) \
      > "$OUT/lazy_metrics.txt" 2>/dev/null & poll=$!
  timeout ${LAZY_TIMEOUT:-240} python3 scripts/bench_tts.py --concurrency 64 --requests-per-client 1 --skip-baseline \
      --port 18123 --out "$OUT/lazy.json" --server-log "$OUT/lazy_server.log" \
      --server-args "--kv-reservation lazy --num-pages 2500 --max-num-seqs 64" 2>&1 | tail -12 | tee "$OUT/lazy.txt"
  kill $poll; tail -2 "$OUT/lazy_metrics.txt" | tee -a "$OUT/lazy.txt"; rm -f "$OUT/lazy_metrics.txt"
fi
if [[ $what == realtime ]]; then
  timeout ${REALTIME_TIMEOUT:-300} python3 scripts/bench_realtime.py --sessions ${REALTIME_SESSIONS:-1 16 64} \
      --out "$OUT/realtime.json" --server-log "$OUT/realtime_server.log" \
      --server-args "${REALTIME_SERVER_ARGS:-}" 2>&1 | tail -12 | tee "$OUT/realtime.txt"
fi
if [[ $what == multi ]]; then
  parts=${MULTI_PARTS:-tests transport tts}
  if [[ $parts == *tests* ]]; then
    timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider -o timeout=200 tests/test_multi_gpu.py \
        tests/test_transport_gpu.py tests/test_arena.py ${MULTI_TESTS:-} > "$OUT/multi_tests.txt" 2>&1
    rc=$?
    tail -6 "$OUT/multi_tests.txt"
  fi
  if [[ $parts == *transport* ]]; then
    timeout 120 python3 scripts/bench_transport.py --out "$OUT/transport.json" 2>&1 | tail -24 | tee "$OUT/transport.txt"
  fi
  [[ $parts == *tts* ]] || MULTI_RUNS=none
  for run in ${MULTI_RUNS:-replicas:128 split:64}; do  # placement:concurrency
    [[ $run == none ]] && break
    placement=${run%%:*} conc=${run##*:}
    (while sleep 3; do curl -s 127.0.0.1:18124/metrics | grep -E '^mstar_(event_loop_lag|worker_)' \
        > "$OUT/metrics_$placement.tmp" && mv "$OUT/metrics_$placement.tmp" "$OUT/metrics_$placement.txt"; done) &
    poll=$!
    timeout ${MULTI_TIMEOUT:-200} python3 scripts/bench_tts.py --gpus 0,1 --concurrency $conc --requests-per-client 1 \
        --skip-baseline --port 18124 --out "$OUT/tts_$placement.json" --server-log "$OUT/server_$placement.log" \
        --server-args "--placement $placement --max-num-seqs 512 --cuda-graph-max-batch 512" 2>&1 | tail -4 \
        | tee -a "$OUT/multi_tts.txt"
    kill $poll 2>/dev/null; rm -f "$OUT/metrics_$placement.tmp"
  done
fi
if [[ $what == moe ]]; then
  timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider -o timeout=250 -k "moe or cuda_tensors_take_triton" \
      tests/test_kernels_gpu.py > "$OUT/moe_tests.txt" 2>&1
  rc=$?
  tail -8 "$OUT/moe_tests.txt"
  timeout 240 python3 scripts/bench_moe.py ${MOE_ARGS:-} --out "$OUT/moe.json" 2>&1 | tee "$OUT/bench_moe.txt" | tail -16
fi
if [[ $what == omni ]]; then
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -o timeout=150 -k "moe or route or cuda_tensors_take_triton or head_norm or qkv_norm or noise or draw_tokens or burst or snake_beta" \
      tests/test_kernels_gpu.py > "$OUT/omni_tests.txt" 2>&1
  rc=$?
  timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider -o timeout=250 -k "cuda or gpu or graph or padded" \
      tests/test_qwen3_omni_code2wav_gpu.py tests/test_qwen3_omni_gpu.py tests/test_qwen3_omni_speech.py tests/test_linear.py \
      tests/test_qwen3_omni_audio.py tests/test_qwen3_omni_talker.py tests/test_host_copy.py \
      tests/test_kv_mode_graphs_gpu.py tests/test_qwen3_omni_speak_group.py \
      >> "$OUT/omni_tests.txt" 2>&1 || rc=1
  tail -8 "$OUT/omni_tests.txt"
  timeout ${OMNI_TIMEOUT:-420} python3 scripts/bench_omni.py ${OMNI_ARGS:-} --out "$OUT/omni.json" 2>&1 \
      | grep -v "\[info" | tee "$OUT/bench_omni.txt" | tail -20
fi
if [[ $what == scheduler ]]; then  # mixed steps, prefix cache and chunked prefill on CUDA, then what admissions cost
  timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_mixed_graphs_gpu.py > "$OUT/scheduler_tests.txt" 2>&1
  rc=$?
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -k cuda tests/test_prefix_cache.py \
      tests/test_chunked_prefill.py tests/test_mixed_steps.py >> "$OUT/scheduler_tests.txt" 2>&1 || rc=1
  tail -8 "$OUT/scheduler_tests.txt"
  label=${SCHED_LABEL:-${MSTAR_COMMIT:-local}}
  timeout 300 python3 scripts/bench_scheduler.py --label "$label" --short-tokens 140 --metrics-dir "$OUT" \
      ${SCHED_ARGS:-} --out "$OUT/scheduler.json" 2>&1 | tail -30
  if [[ -n ${SCHED_UNMIXED:-} ]]; then  # the same without mixed steps, in the same call
    timeout 300 python3 scripts/bench_scheduler.py --label "${label}_unmixed" --short-tokens 140 \
        --server-args=--no-mixed-steps --out "$OUT/scheduler.json" 2>&1 | tail -30
  fi
fi
if [[ $what == scheduler-profile ]]; then  # where the worker's time goes in bench_scheduler's phases, over HTTP
  timeout 300 python3 scripts/bench_scheduler.py --label "${SCHED_LABEL:-${MSTAR_COMMIT:-local}}_profiled" \
      --short-tokens 140 --profile 2 --metrics-dir "$OUT" 2>&1 | grep -v "\[info" | tail -12
fi
if [[ $what == gemv ]]; then
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gemv.py tests/test_llama_parity_model.py \
      > "$OUT/gemv_tests.txt" 2>&1 || rc=1
  tail -8 "$OUT/gemv_tests.txt"
  PYTHONPATH=$PWD:$PWD/scripts timeout 240 python3 scripts/bench_gemv.py --rows 1 ${GEMV_ARGS:-} \
      --out "$OUT/gemv.json" 2>&1 | tee "$OUT/bench_gemv.txt" | grep -v "^  rows"
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in ${BASE:+"$BASE"} "$PWD"; do
      name=$([[ $tree == "$PWD" ]] && echo new || echo base)
      echo "== $name, round $round" | tee -a "$OUT/compare.txt"
      (cd "$tree" && PYTHONPATH=$PWD timeout 100 python3 scripts/bench_decode.py --model orpheus-3b \
          --load-format dummy --batches 1 64 --contexts 512 --skip-hf --out "$OUT/decode_${name}_$round.json" 2>&1 \
          | grep -v "\[info\|capturing" | tail -4) | tee -a "$OUT/compare.txt"
    done
  done
fi
if [[ $what == sampler ]]; then  # the wide-vocabulary draw against the torch form: equal draws, then their times
  timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider -k "wide_draw or wide_descent or draw_tokens or penalty" tests/test_kernels_gpu.py \
      > "$OUT/sampler_tests.txt" 2>&1
  rc=$?
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_sampler_graphs_gpu.py tests/test_fp8_gpu.py \
      >> "$OUT/sampler_tests.txt" 2>&1 || rc=1
  tail -5 "$OUT/sampler_tests.txt"
  timeout 200 python3 scripts/bench_sampler.py --batches 1 16 64 128 256 400 --profile 2>&1 | tee "$OUT/bench_sampler.txt"
fi
if [[ $what == fp8 ]]; then
  timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fp8_gpu.py tests/test_gemv_fp8.py \
      > "$OUT/fp8_tests.txt" 2>&1
  rc=$?
  tail -4 "$OUT/fp8_tests.txt"
  timeout 360 python3 scripts/bench_fp8.py ${FP8_ARGS:-} 2>&1 | grep -v "\[info\|capturing" | tee "$OUT/bench_fp8.txt"
fi
if [[ $what == fp8kv ]]; then
  timeout 420 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_flashinfer_attention.py tests/test_fp8_gpu.py \
      tests/test_mixed_graphs_gpu.py -k "not engine_outputs and not fp8_matches and not fp8_projections" \
      > "$OUT/fp8kv_tests.txt" 2>&1
  rc=$?
  timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -k "quantize or qkv_norm_rope_store or rope_and_store" \
      tests/test_kernels_gpu.py >> "$OUT/fp8kv_tests.txt" 2>&1 || rc=1
  grep -E "passed|failed|Error|FAILED" "$OUT/fp8kv_tests.txt" | tail -30
fi
if [[ $what == kvdtype ]]; then
  timeout 300 python3 scripts/bench_kv_dtype.py ${KV_ARGS:---batches 64 256 400 --context 560} --out "$OUT/kv_dtype.json" 2>&1 \
      | tee "$OUT/bench_kv_dtype.txt" | tail -14
fi
if [[ $what == codec ]]; then
  timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -k "snake or noise" tests/test_kernels_gpu.py \
      > "$OUT/codec_tests.txt" 2>&1
  rc=$?
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_orpheus_gpu.py >> "$OUT/codec_tests.txt" 2>&1 || rc=1
  tail -6 "$OUT/codec_tests.txt"
  for how in "--modules" "--modules --play" "--play"; do  # the whole window, its played frame, then fused units
    timeout 200 python3 scripts/bench_snac.py --device cuda --dtype float16 --batches 1 16 64 --graphs --profile $how \
        2>&1 | grep -v "Warning\|_warn_once" | tee -a "$OUT/bench_snac.txt" | tail -30
  done
fi
if [[ $what == arrivals ]]; then
  for how in "--cprofile 45" ""; do
    timeout 240 python3 scripts/profile_tts.py --concurrency 64 --tokens 900 --trace 2 --trace-after 3 \
        --arrivals 0.1 $how 2>&1 | grep -v "\[info\|capturing\|USDT" >> "$OUT/profile_arrivals.txt"
  done
  head -150 "$OUT/profile_arrivals.txt"
fi
if [[ $what == omni-bench ]]; then
  timeout ${OMNI_TIMEOUT:-420} python3 scripts/bench_omni.py ${OMNI_ARGS:-} --out "$OUT/omni.json" 2>&1 \
      | grep -v "\[info" | tee "$OUT/bench_omni.txt" | tail -20
fi
if [[ $what == omni-profile ]]; then
  : "${OMNI_PROFILE_ARGS:=--concurrency 8 32 --frames 125 --kernels 2}"
  timeout ${OMNI_TIMEOUT:-420} python3 scripts/profile_omni.py $OMNI_PROFILE_ARGS 2>&1 \
      | grep -v "\[info\|capturing" | tee "$OUT/profile_omni.txt" | tail -150
fi
if [[ $what == qwen35 ]]; then
  timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_qwen35_kernels.py tests/test_qwen35_gpu.py \
      tests/test_kernels_gpu.py::test_rms_norm \
      > "$OUT/qwen35_tests.txt" 2>&1
  rc=$?
  tail -5 "$OUT/qwen35_tests.txt"
  if [[ ${QWEN35_PROFILE:-1} == 1 ]]; then
    timeout 200 python3 scripts/profile_decode.py --model qwen3.5-9b --batch 1 64 --top 25 2>&1 \
        | grep -v "\[info\|capturing\|USDT" | tee "$OUT/qwen35_profile.txt" | tail -60
  fi
  timeout 420 python3 scripts/bench_decode.py --model qwen3.5-9b --contexts 512 --new-tokens 32 \
      ${QWEN35_ARGS:---batches 1 64 256} --hf-batches 1 16 --out "$OUT/qwen35.json" 2>&1 | grep -v "\[info" | tail -14
  if [[ ${QWEN35_PROBES:-1} == 1 ]]; then
    timeout 300 python3 scripts/probe_qwen35_bf16.py 2>&1 | grep -v "\[info\|capturing\|tokenizer" \
        | tee "$OUT/qwen35_bf16.txt" | tail -8
    timeout 120 python3 scripts/probe_delta_decode.py 2>&1 | tee "$OUT/delta_decode.txt" | tail -30
  fi
  # fla-core only now, so transformers' baseline above ran as a plain install runs it (torch fallbacks)
  python3 -m pip install -q --no-deps --no-index .wheels/fla/*.whl 2>&1 | grep -v "root user" | tail -2
  timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_qwen35_kernels.py -k fla \
      >> "$OUT/qwen35_tests.txt" 2>&1 || rc=1
  tail -2 "$OUT/qwen35_tests.txt"
  if [[ ${QWEN35_PROBES:-1} == 1 ]]; then
    timeout 200 python3 scripts/probe_delta_prefill.py 2>&1 | tee "$OUT/delta_prefill.txt" | tail -12
  fi
  # again with fla-core installed: both transformers and mstar take its chunked kernel for prompts
  timeout 300 python3 scripts/probe_qwen35_bf16.py 2>&1 | grep -v "\[info\|capturing\|tokenizer" \
      | tee "$OUT/qwen35_bf16_fla.txt" | tail -8
fi
if [[ $what == first-burst ]]; then
  timeout ${FB_TIMEOUT:-480} scripts/probe_first_burst.sh 2>&1 | grep -v "\[info" | tee "$OUT/first_burst.txt" | tail -120
fi
if [[ $what == pagesize ]]; then
  timeout 240 python3 scripts/bench_page_size.py --out "$OUT/page_size.json" 2>&1 | tail -30 | tee "$OUT/page_size.txt"
fi
exit $rc
