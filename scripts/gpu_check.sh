#!/usr/bin/env bash
# The GPU check (issue 25): the measured matmul peak; the baseline and one architecture of each family at ~25M and
# the 124M shape, trained with cemtool's CUDA defaults for --budget S seconds in all (tokens/s, MFU against the
# measured peak with flop_counter FLOPs and with 6N+12LdT); sharpness and collapse-report times; --profile: where
# the step time goes. Writes OUT/gpu_check.md and .json after every step. On a CPU machine:
# `bash scripts/gpu_check.sh --device cpu --tiny --budget 2` (the smoke test). All arguments go to
# benchmarks/gpu_check.py (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
exec "$PY" benchmarks/gpu_check.py "$@"
