#!/usr/bin/env bash
# What the first burst of streams after startup pays that a later one does not
# (on the GPU machine, after scripts/gpu_check.sh's setup; writes under $OUT).
#
# One Orpheus-3B server (dummy weights, $FB_SERVER_ARGS added) with
# --enable-profiling; once /health answers, marks the time, then: one warm-up
# request, a burst of $FB_BURST streams with torch's profiler over the worker
# for its first seconds (`POST /debug/profile`, Python stacks), the kernels
# Triton and FlashInfer compiled since the mark, the same burst again, then
# bench_tts's levels $FB_LEVELS with and without `early_audio` ($FB_EARLY=0: without
# only). The server's /metrics after each level go to $OUT/fb_metrics_<n>_<label>.txt,
# numbered in order: their differences say how each level was admitted (mixed
# steps, prefill steps) and the server's own first-audio times.
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
curl -s "$url/metrics" > "$OUT/fb_metrics_0_start.txt"
compiled() {  # kernels built since the server was healthy
  find "$TRITON_CACHE_DIR" "$HOME/.cache/flashinfer" -newer "$marker" -type f \( -name '*.json' -o -name '*.so' \) \
      2>/dev/null | grep -v '__grp__' | sed "s|$HOME/||"
}
runs=$(mktemp -d)
snapshots=0
level() {  # bench_tts against this server: a label, then its flags; its JSON goes into $OUT/fb.tgz
  local label=$1; shift
  timeout 200 python3 scripts/bench_tts.py --url "$url" --requests-per-client 1 --skip-baseline --warmup 0 \
      --out "$runs/$label.json" "$@" 2>&1 | grep -E "^ +[0-9]+ " | sed "s/^/$label: /"
  snapshots=$((snapshots + 1))
  curl -s "$url/metrics" > "$OUT/fb_metrics_${snapshots}_$label.txt"
}
profiled() {  # a level with the worker profiled from just before it (bench_tts takes ~2 s to send)
  local label=$1; shift
  [[ ${FB_PROFILE:-1} == 0 ]] && { level "$label" "$@"; return; }
  curl -s -X POST "$url/debug/profile" -d '{"seconds": 8, "stacks": true, "rows": 40}' \
      > "$OUT/fb_profile_$label.txt" &
  local prof=$!
  level "$label" "$@"
  wait $prof
}
echo "  conc  reqs  errs  refd  ttfa p50  ttfa p99  rtf p50  rtf tot     sv  audio/s audio/req  wall s"
level warmup --concurrency 1
echo "compiled after the warm-up request:"; compiled; touch "$marker"
profiled burst1 --concurrency "$burst"
echo "compiled during the first burst of $burst:"; compiled; touch "$marker"
level burst2 --concurrency "$burst"
echo "compiled during the second burst:"; compiled
for c in ${FB_LEVELS:-1 64}; do
  level "c$c" --concurrency "$c"
  [[ ${FB_EARLY:-1} == 0 ]] || profiled "c${c}_early" --concurrency "$c" --early-audio
done
[[ -n ${FB_AGAIN:-1} ]] && level "again${burst}" --concurrency "$burst"
tar czf "$OUT/fb.tgz" -C "$runs" .
grep -i -E "warn|error|eager" "$OUT/fb_server.log" | head -20
