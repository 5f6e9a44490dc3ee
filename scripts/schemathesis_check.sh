#!/usr/bin/env bash
# Fuzz a local server from its own /openapi.json with schemathesis (not part of
# CI): starts `python -m mstar.http` on tiny-llama, sends a bounded number of
# generated requests per operation, and fails on any 5xx or crash.
#   scripts/schemathesis_check.sh [max examples per operation, default 25]
# Needs `pip install schemathesis` (4.x CLI flags); $SCHEMATHESIS and $PYTHON pick the
# binaries when schemathesis lives in its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
examples=${1:-25}
port=${PORT:-8765}
export PYTHONPATH=$PWD TRITON_INTERPRET=${TRITON_INTERPRET:-1}

"${PYTHON:-python}" -m mstar.http --model tiny-llama --host 127.0.0.1 --port "$port" --log-level warning &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 1
done

# Generated bodies may ask for long generations; the server's limits (max_tokens
# at most the context) keep each one bounded, the request timeout the rest.
"${SCHEMATHESIS:-schemathesis}" run "http://127.0.0.1:$port/openapi.json" \
  --checks not_a_server_error \
  --max-examples "$examples" \
  --request-timeout 60 \
  --workers 1
