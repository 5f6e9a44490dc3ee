#!/usr/bin/env bash
# The measurements issues 14 and 15 still owe an H200, in three device calls of under ten minutes each on one warm
# machine (carry .wheels). Each part leaves one tarball, $OUT/refresh_<part>.tgz, with every file the commands
# wrote (the device tool brings back 8 files at most), plus the printed tails in $OUT/refresh_<part>.txt:
#   MSTAR_COMMIT=<sha> scripts/refresh_h200.sh 1   issue 14's arrivals beside 64 streams of 1,024 tokens
#                                                  (scheduler.json, label <sha>_1024), the decode step against its
#                                                  floor at 1/64/256 rows, then the one-row projection sweep
#   MSTAR_COMMIT=<sha> scripts/refresh_h200.sh 2   the speech benchmark at 1-512 streams, then the realtime
#                                                  websocket's first audio delta at 1 and 64 sessions
#   MSTAR_COMMIT=<sha> scripts/refresh_h200.sh 3   where a speech step's time goes at 1, 64 and 400 streams
#                                                  (torch's profiler over 1 s of each level, in-process)
# On any other GPU it prints the card and stops, unless ANY_GPU=1: the goals are the H200's, and an H100's
# numbers go to files named for it by hand.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1, 2 or 3}
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ $card != *H200* && ${ANY_GPU:-0} != 1 ]]; then
  exit 3
fi
commit=${MSTAR_COMMIT:?set MSTAR_COMMIT to the commit measured}
res=/tmp/refresh_$part
mkdir -p "$res"
OUT=$res scripts/gpu_check.sh none > "$res/gpu_check.txt" 2>&1
export PYTHONPATH=$PWD:$PWD/scripts PYTHONUNBUFFERED=1 MSTAR_COMMIT=$commit
speech_flags="--kv-cache-dtype fp8 --audio-logits-only"
{
  if [[ $part == 1 ]]; then
    cp docs/benchmarks/scheduler.json "$res/scheduler.json"
    timeout 300 python3 scripts/bench_scheduler.py --label "${commit}_1024" --stream-tokens 1024 --short-tokens 140 \
        --seconds 8 --alone 3 --long-speech --metrics-dir "$res/metrics" --server-args="$speech_flags" \
        --out "$res/scheduler.json" 2>&1 | tail -30
    sleep 5  # the driver takes back the last process's memory before the next sizes a KV pool
    timeout 150 python3 scripts/bench_decode.py --model orpheus-3b --load-format dummy --skip-hf --batches 1 64 256 \
        --contexts 512 --out "$res/decode.json" 2>&1 | grep -v "\[info" | tail -20
    timeout "${GEMV_S:-110}" python3 scripts/bench_gemv.py --rows 1 --block-n 2 4 8 --block-k 1024 4096 --warps 4 8 \
        --programs-per-sm 0 2 4 8 --prefetch 1 --stats-block 0 4096 --out "$res/gemv_sweep.json" 2>&1 | tail -20
  elif [[ $part == 2 ]]; then
    timeout 400 python3 scripts/bench_tts.py --concurrency 1 16 64 128 256 384 400 448 512 --requests-per-client 1 \
        --skip-baseline --server-args "--max-num-seqs 512 --cuda-graph-max-batch 512 $speech_flags" \
        --out "$res/tts.json" --server-log "$res/tts_server.log" 2>&1 | tail -30
    sleep 5
    timeout 150 python3 scripts/bench_realtime.py --sessions 1 64 --out "$res/realtime.json" \
        --server-log "$res/realtime_server.log" \
        --server-args "--max-num-seqs 512 --cuda-graph-max-batch 512 $speech_flags" 2>&1 | tail -12
  elif [[ $part == 3 ]]; then
    timeout 540 python3 scripts/profile_tts.py --concurrency 1 64 400 --tokens 1024 $speech_flags --trace 1 \
        --trace-after 1.5 > "$res/profile_tts.txt" 2>&1
    grep -v "\[info" "$res/profile_tts.txt" | tail -150
  else
    echo "unknown part $part"
  fi
} 2>&1 | tee "$OUT/refresh_$part.txt"
tar czf "$OUT/refresh_$part.tgz" -C /tmp "refresh_$part"
