#!/usr/bin/env bash
# What the first burst of streams after startup pays that a later one does not
# (on the GPU machine, after scripts/gpu_check.sh's setup; writes under $OUT).
#
# One Orpheus-3B server (dummy weights, $FB_SERVER_ARGS added) with
# --enable-profiling; once /health answers, marks the time, then: one warm-up
# request, a burst of $FB_BURST streams with torch's profiler over the worker
# for its first seconds (`POST /debug/profile`, Python stacks), the kernels
# Triton and FlashInfer compiled since the mark, the same burst again, then
# bench_tts's levels $FB_LEVELS with and without `early_audio`.
#
#   OUT=/tmp/out scripts/probe_first_burst.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
port=${FB_PORT:-18231}
url=http://127.0.0.1:$port
burst=${FB_BURST:-64}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
python3 -m mstar.http --model orpheus-3b --load-format dummy --gpus 0 --host 127.0.0.1 --port "$port" --enable-profiling \
    ${FB_SERVER_ARGS:-} > "$OUT/fb_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 300); do
  curl -sf "$url/health" > /dev/null && break
  kill -0 $server 2>/dev/null || { tail -20 "$OUT/fb_server.log"; exit 1; }
  sleep 1
done
marker=$(mktemp) && touch "$marker"
compiled() {  # kernels built since the server was healthy
  find "$TRITON_CACHE_DIR" "$HOME/.cache/flashinfer" -newer "$marker" -type f \( -name '*.json' -o -name '*.so' \) \
      2>/dev/null | grep -v '__grp__' | sed "s|$HOME/||"
}
level() {  # bench_tts against this server: a label, then its flags
  local label=$1; shift
  timeout 200 python3 scripts/bench_tts.py --url "$url" --requests-per-client 1 --skip-baseline \
      --out "$OUT/fb_$label.json" "$@" 2>&1 | grep -E "^\s*[0-9]+ |conc|TTFA" | tail -6 | sed "s/^/$label: /"
}
level warmup --concurrency 1 --warmup 0
echo "compiled after the warm-up request:"; compiled; touch "$marker"
curl -s -X POST "$url/debug/profile" -d '{"seconds": 4, "stacks": true, "rows": 40}' > "$OUT/fb_profile.txt" &
prof=$!
level burst1 --concurrency "$burst" --warmup 0
wait $prof
echo "compiled during the first burst of $burst:"; compiled; touch "$marker"
level burst2 --concurrency "$burst" --warmup 0
echo "compiled during the second burst:"; compiled
for c in ${FB_LEVELS:-1 64}; do
  level "c$c" --concurrency "$c" --warmup 0
  level "c${c}_early" --concurrency "$c" --warmup 0 --early-audio
done
head -60 "$OUT/fb_profile.txt"
