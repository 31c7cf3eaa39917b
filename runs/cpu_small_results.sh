#!/usr/bin/env bash
# The README's "Results on this machine" (and docs/results/cpu-small/): the default corpus, `cpu-small` trained for
# STEPS steps (default 400) as a diffusion model (clean-context, self-conditioning 0.5) and as the AR baseline on the
# same data, then `dgemma eval` and `dgemma viz`; the report and the README's pictures are copied to
# docs/results/cpu-small/. About 15 minutes on 2 CPU cores.
#
#   bash runs/cpu_small_results.sh 400            # what the README cites
#   bash runs/cpu_small_results.sh 400 --smoke    # the same pipeline on a toy corpus with the tiny preset (seconds)
#
# Everything runs inside OUT (default runs/out/cpu-small) with relative paths, so the commands printed in the
# report and in the pictures' footers name paths relative to the run, not absolute temporary ones.
set -euo pipefail
STEPS=${1:-400}
SMOKE=${2:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-runs/out/cpu-small}
PY=${PYTHON:-python3}
mkdir -p "$OUT" && cd "$OUT"
dgemma() { "$PY" -m dgemma "$@"; }

TRAIN=(--preset cpu-small --max-steps "$STEPS")
EVAL=(--prompts 8 --steps 4,8,16,32 --entropy-bounds 0.1,1 --prompt-tokens 32 --t-samples 4 --max-windows 64)
PREPARE=()
if [[ "$SMOKE" == --smoke ]]; then  # toy corpus, tiny model, a two-step training and a one-setting evaluation
  "$PY" -c "
from pathlib import Path
from dgemma.tokenizer import toy_corpus
s = toy_corpus(120); Path('toy').mkdir(exist_ok=True)
for i in range(150): Path(f'toy/d{i:03d}.txt').write_text(' '.join(s[(7 * i + j) % len(s)] for j in range(12)))"
  PREPARE=(--corpus toy --cache-dir .cache -q)
  TRAIN=(--preset tiny --vocab-size 1024 --batch-size 2 --eval-batches 1 --max-steps 2)
  EVAL=(--prompts 2 --steps 16 --entropy-bounds 0.1 --max-windows 2 --t-samples 1 --quiet)
fi

[[ -f data/meta.json ]] || dgemma data prepare --out data "${PREPARE[@]}"
dgemma train "${TRAIN[@]}" --data data --out cpu-small-clean-context
dgemma train "${TRAIN[@]}" --objective ar --data data --out cpu-small-ar
OMP_NUM_THREADS=2 dgemma eval --model cpu-small-clean-context --baseline cpu-small-ar --data data --out report \
    "${EVAL[@]}" --seed 0
dgemma viz report/traces/N16_eb0p1 --out report/viz --model cpu-small-clean-context

if [[ "$SMOKE" != --smoke ]]; then
  DEST="$ROOT/docs/results/cpu-small"
  mkdir -p "$DEST"
  cp report/report.md report/report.json report/frontier.png report/likelihood.png "$DEST/"
  cp report/viz/canvas_00_entropy.png report/viz/player.html "$DEST/"
  echo "copied the report and pictures to $DEST"
fi
