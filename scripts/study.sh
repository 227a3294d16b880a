#!/usr/bin/env bash
# The study behind docs/findings.md, on the grammar corpus, every run 4 layers x 64 wide trained on the same
# 1,024,000 tokens, five seeds, every analysis (sharpness, collapse, forgetting on grammar-b), compared and plotted;
# then the saturation sweep. About 1 h 20 min on 2 CPU cores (measured) (two sweeps at a time, one core each).
#
#   a, b: baseline, hb, nesterov | tmm, adam, lime, with parameter-matched streams (model.momentum.stream_init=zero)
#   c:    tmm with the paper's default "embed" streams (+15% parameters: learned stream embeddings)
#   d:    the baseline widened to tmm-embed's parameter count (model.mlp_hidden=224: 269,056 vs 267,744)
#
#   scripts/study.sh [OUT]          (default runs/study, and OUT-saturation; rerunning continues where it stopped)
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
        --analyses sharpness,collapse,forgetting --quiet)
ZERO=(--set model.momentum.stream_init=zero)

OMP_NUM_THREADS=1 $CEMTOOL sweep --archs baseline,hb,nesterov "${COMMON[@]}" "${ZERO[@]}" --out "$OUT/a" \
  > "$OUT/a.log" 2>&1 &
A=$!
OMP_NUM_THREADS=1 $CEMTOOL sweep --archs tmm,adam,lime "${COMMON[@]}" "${ZERO[@]}" --out "$OUT/b" > "$OUT/b.log" 2>&1 &
B=$!
wait $A $B
OMP_NUM_THREADS=1 $CEMTOOL sweep --archs tmm "${COMMON[@]}" --out "$OUT/c" > "$OUT/c.log" 2>&1 &
C=$!
OMP_NUM_THREADS=1 $CEMTOOL sweep --archs baseline "${COMMON[@]}" --set model.mlp_hidden=224 --out "$OUT/d" \
  > "$OUT/d.log" 2>&1 &
D=$!
wait $C $D

$CEMTOOL compare "$OUT/a" "$OUT/b" "$OUT/c" "$OUT/d" --out "$OUT"
$CEMTOOL plot "$OUT" --no-each-run --quiet

# beside the study, not in it (its 45 small models are not part of the architecture comparison)
$CEMTOOL saturation sweep --head-dims 2,4,8,16,32 --budget 32 --seq-lens 16,64,256 --seeds 0,1,2 \
  --steps 300 --out "$OUT-saturation" --quiet
$CEMTOOL plot "$OUT-saturation" --no-each-run --quiet
