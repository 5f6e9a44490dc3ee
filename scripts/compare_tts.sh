#!/usr/bin/env bash
# The speech benchmark against two servers, alternated, $ROUNDS rounds
# (default 2), each server fresh (`--model $MODEL --load-format dummy --gpus
# $GPUS`, default orpheus-3b on GPU 0, then $SERVER_ARGS), measured by this
# tree's bench_tts.py with $TTS_ARGS. The two are either $BASE (an older
# tree's copy, scripts/base_tree.sh) and this tree, or, without $BASE, this
# tree with $A_ARGS and with $B_ARGS added to the server's flags. On the GPU
# machine after scripts/gpu_check.sh's setup; results under $OUT.
#   BASE=.base TTS_ARGS="--concurrency 64 64 64" scripts/compare_tts.sh
#   A_ARGS="" B_ARGS="--gil-switch-interval-ms 1" TTS_ARGS="--concurrency 64 400" scripts/compare_tts.sh
# A CPU smoke test: MODEL=orpheus-tiny GPUS=cpu ROUNDS=1 B_ARGS=... TTS_ARGS="--concurrency 2 --audio-tokens 70"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
port=18241
if [[ -n ${BASE:-} ]]; then
  sides=("$BASE|" ".|")
  labels=("base $(cat "$BASE/COMMIT" 2>/dev/null)" "new")
else
  sides=(".|${A_ARGS:-}" ".|${B_ARGS:?without BASE, B_ARGS (and A_ARGS) name the flags of the two servers}")
  labels=("A ${A_ARGS:-(none)}" "B $B_ARGS")
fi
for round in $(seq "${ROUNDS:-2}"); do
  for i in 0 1; do
    tree=${sides[$i]%%|*} extra=${sides[$i]#*|} label=${labels[$i]}
    name=$(echo "${round}_$label" | tr -c 'A-Za-z0-9_.\n-' '_')
    log="$OUT/server_$name.log"
    (cd "$tree" && exec env PYTHONPATH="$PWD" python3 -m mstar.http --model "${MODEL:-orpheus-3b}" \
        --load-format dummy --gpus "${GPUS:-0}" --host 127.0.0.1 --port $port ${SERVER_ARGS:-} $extra) > "$log" 2>&1 &
    server=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    echo "## round $round, $label"
    timeout 300 python3 scripts/bench_tts.py --url "http://127.0.0.1:$port" --skip-baseline ${TTS_ARGS:-} \
        --out "$OUT/tts_$name.json" 2>&1 | grep -E "^ +[0-9]+ |conc"
    kill $server; wait $server 2>/dev/null
  done
done
