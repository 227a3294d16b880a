#!/usr/bin/env bash
# The study behind docs/findings.md: six architectures x five seeds at matched tokens, every analysis, compared and
# plotted; then the saturation sweep. About 70 minutes on 2 CPU cores (each half of the sweep on one core).
#
#   scripts/study.sh [OUT]          (default runs/study; rerunning continues an interrupted study)
#
# The two halves are ordinary `cemtool sweep` studies run side by side (one torch thread each); one sweep with all
# six architectures gives the same runs (batches are a pure function of seed and step), only slower on 2 cores.
set -euo pipefail

cd "$(dirname "$0")/.."
CEMTOOL=${CEMTOOL:-cemtool}
OUT=${1:-runs/study}
mkdir -p "$OUT"

COMMON=(--seeds 0,1,2,3,4 --tokens 1024000
        --set model.d_model=64 --set model.n_layer=4 --set model.n_head=4
        --set data.seq_len=64 --set train.batch_size=32
        --set model.momentum.stream_init=zero
        --analyses sharpness,collapse,forgetting --quiet)

OMP_NUM_THREADS=1 $CEMTOOL sweep --archs baseline,hb,nesterov "${COMMON[@]}" --out "$OUT/a" > "$OUT/a.log" 2>&1 &
A=$!
OMP_NUM_THREADS=1 $CEMTOOL sweep --archs tmm,adam,lime "${COMMON[@]}" --out "$OUT/b" > "$OUT/b.log" 2>&1 &
B=$!
wait $A $B

$CEMTOOL compare "$OUT/a" "$OUT/b" --out "$OUT"
$CEMTOOL plot "$OUT" --no-each-run --quiet

$CEMTOOL saturation sweep --head-dims 2,4,8,16,32 --budget 32 --seq-lens 16,64,256 --seeds 0,1,2 \
  --steps 300 --out "$OUT/saturation" --quiet
$CEMTOOL plot "$OUT/saturation" --no-each-run --quiet
