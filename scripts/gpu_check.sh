#!/usr/bin/env bash
# The GPU check (issue 12): trains baseline, cem-rec2, tmm and lime at ~25M parameters in bf16 with and without
# torch.compile (tokens/s, MFU against the measured bf16 matmul peak), runs sharpness and collapse-report on them in
# fp32, a 2-GPU torchrun when two GPUs exist, and a fused-vs-explicit attention check; prints one table and writes
# runs/gpu_check/gpu_check.md. On a CPU machine: `bash scripts/gpu_check.sh --device cpu --tiny` (the smoke test).
# All arguments go to benchmarks/gpu_check.py (--device, --tiny, --out, --steps, --no-compile).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
exec "$PY" benchmarks/gpu_check.py "$@"
