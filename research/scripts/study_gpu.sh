#!/usr/bin/env bash
# The findings study (research/scripts/study.sh's grammar and muon groups) at GPU scale on a corpus of token files, with a
# time estimate measured on the device before it starts. Usage and choices: research/docs/study_gpu.md, or --help.
#
#   research/scripts/study_gpu.sh --data PATH --to PATH [--size 25m|125m] [--gpus K] [--out DIR] [--tokens N] [--set k=v]
#                        [--device auto|cpu|cuda] [--yes] [--estimate-only]
#   research/scripts/study_gpu.sh --tiny --device cpu --yes [--out DIR]      the whole pipeline in minutes on a CPU
#
# Paths are relative to the current directory. Set CEMTOOL to run another cemtool executable (default: this
# Python's `python -m cemtool`).
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python "$(dirname "$0")/study_gpu.py" "$@"
