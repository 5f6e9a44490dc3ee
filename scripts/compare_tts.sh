#!/usr/bin/env bash
# The speech benchmark against servers of two trees, alternated: $BASE (an
# older tree's copy, scripts/base_tree.sh) and this one, $ROUNDS rounds
# (default 2), each a fresh server (`--model orpheus-3b --load-format dummy`,
# $SERVER_ARGS) measured by this tree's bench_tts.py with $TTS_ARGS. On the
# GPU machine after scripts/gpu_check.sh's setup; results under $OUT.
#   BASE=.base TTS_ARGS="--concurrency 64 64 64" scripts/compare_tts.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
base=${BASE:?BASE: an older tree (scripts/base_tree.sh)}
port=18241
for round in $(seq "${ROUNDS:-2}"); do
  for tree in "$base" .; do
    label=$([[ $tree == . ]] && echo "new" || echo "base $(cat "$tree/COMMIT" 2>/dev/null)")
    (cd "$tree" && exec env PYTHONPATH="$PWD" python3 -m mstar.http --model orpheus-3b --load-format dummy --gpus 0 \
        --host 127.0.0.1 --port $port ${SERVER_ARGS:-}) > "$OUT/server_${round}_${label// /_}.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    echo "## round $round, $label"
    timeout 300 python3 scripts/bench_tts.py --url "http://127.0.0.1:$port" --skip-baseline ${TTS_ARGS:-} \
        --out "$OUT/tts_${round}_${label// /_}.json" 2>&1 | grep -E "^ +[0-9]+ |conc"
    kill $server; wait $server 2>/dev/null
  done
done
