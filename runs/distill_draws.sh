#!/usr/bin/env bash
# Does a lower-variance target help a distillation learn? (issue 40; docs/training.md, "Few-step samplers by
# distillation"). Round 1 of runs/distill_results.sh (the demo's diffusion model, 16 steps -> a student at 8) with one
# teacher draw per x_s (the recipe) and with the mean of K = 4 draws (--teacher-draws 4), each at two training seeds,
# STEPS steps; and one draw at the teacher's own peak rate (10x the recipe's: is the slow learning the rate?), both
# seeds; then runs/distill_floor.py puts the initialisation and the six students on the same held-out windows,
# levels, corruption and teacher draws: each one's learnable KL (the part of its KL above the floor) and its
# difference from the initialisation's, paired, with SEs over windows.
#
#   bash runs/distill_draws.sh           # ~40 min on 2 cores after runs/distill_results.sh's demo/ (which it makes)
#   bash runs/distill_draws.sh --smoke   # tiny models on a toy corpus, a minute
#
# Runs inside OUT (default runs/out/distill-demo, shared with distill_results.sh); every step resumes.
set -euo pipefail
SMOKE=${1:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-runs/out/distill-demo}
PY=${PYTHON:-python3}
STEPS=${STEPS:-200}
mkdir -p "$OUT" && cd "$OUT"
dgemma() { nice -n "${NICE:-0}" "$PY" -m dgemma "$@"; }
FLOOR=(--windows 32 --seq-len 128 --draws 8)
RUN=()
if [[ "$SMOKE" == --smoke ]]; then
  "$PY" -c "from dgemma.data.tokenizer import write_toy_corpus; write_toy_corpus('toy')"
  [[ -f demo/data/meta.json ]] || dgemma data prepare --out demo/data --corpus toy --cache-dir .cache -q
  dgemma train --preset tiny --max-steps 4 --batch-size 2 --eval-batches 1 --vocab-size 1024 \
      --data demo/data --out demo/diffusion --resume
  STEPS=2 FLOOR=(--windows 2 --seq-len 32 --draws 2) RUN=(--eval-batches 1 --warmup-steps 1 --batch-size 2)
else
  [[ -f demo/demo.json ]] || dgemma demo --out demo
fi
N=$(("$("$PY" -c "from dgemma.weights.checkpoint import read_model_config as r, resolve_model_dir as d
print(r(d('demo/diffusion')).canvas_length)")" / 2))
export OMP_NUM_THREADS=2
students=()
for K in 1 4; do
  for SEED in 0 1; do
    dgemma distill --data demo/data --out "draws/k$K-seed$SEED" --teacher demo/diffusion --student-steps "$N" \
        --teacher-draws "$K" --seed "$SEED" --max-steps "$STEPS" "${RUN[@]}" --resume
    students+=(--student "draws/k$K-seed$SEED")
  done
done
# Is the students' slow learning the rate? One draw at the teacher's own peak rate (10x the recipe's), both seeds.
RATE=$("$PY" -c "from dgemma.train.distill import teacher_recipe as r; print(r('demo/diffusion')['lr'])")
for SEED in 0 1; do
  dgemma distill --data demo/data --out "draws/k1-teacher-rate-seed$SEED" --teacher demo/diffusion \
      --student-steps "$N" --lr "$RATE" --seed "$SEED" --max-steps "$STEPS" "${RUN[@]}" --resume
  students+=(--student "draws/k1-teacher-rate-seed$SEED")
done
"$PY" "$ROOT/runs/distill_floor.py" --teacher demo/diffusion --student demo/diffusion "${students[@]}" \
    --student-steps "$N" --data demo/data --out draws/floor.json "${FLOOR[@]}"
