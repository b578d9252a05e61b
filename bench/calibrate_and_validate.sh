#!/usr/bin/env bash
# Refit cpu-tiny and validate the twin against the real CPU engine in one hold of the engine lock,
# so both see the same machine. Usage: flock /tmp/engine.lock bench/calibrate_and_validate.sh OUT_DIR
# (about 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/calibrate-and-validate}
mkdir -p "$OUT"
bench/calibrate_cpu.sh "$OUT/cpu-tiny.toml"
cp "$OUT/cpu-tiny.toml" controller/sim/profiles/cpu-tiny.toml
.venv/bin/python bench/validate_sim.py --time-scale 4 8 --json "$OUT/validation.json" --keep "$OUT"
