#!/usr/bin/env bash
# The README's "Results on this machine" (and docs/results/cpu-small/): learning curves of the diffusion model and its
# AR baseline on the default corpus, `cpu-small` with its preset recipe (train/loop.py:TRAIN_PRESETS: time conditioning),
# then `dgemma eval` with an independent judge, and `dgemma viz`.
#
#   * diffusion and AR share one schedule spanning 2 x STEPS steps (512 tokens each): the diffusion run stops at STEPS
#     (4,800 steps: about 67 CPU-minutes on one core of this machine), the AR run goes on to 2 x STEPS (about 69
#     CPU-minutes: an AR step costs about half a diffusion step). Both evaluate the held-out bound / cross-entropy
#     every STEPS / 12 steps with its SE, on the first 128 held-out windows: the windows of the final evaluation
#     (--eval-batches 32 of 4 windows, --max-windows 128), so the learning curves end where the report's likelihoods
#     are measured. Every training record carries the process's CPU seconds (`cpu_s`).
#   * the compared AR baseline is the AR run's checkpoint at step STEPS: the same tokens at the same point of the same
#     schedule as the diffusion model; the judge that scores both sides' samples is the same AR run at 2 x STEPS,
#     trained on twice the tokens and not one of the compared models.
#   * the two runs train at the same time, one thread each (OMP_NUM_THREADS=1): about 70 minutes on 2 cores, plus
#     about 10 for the evaluation. `--resume` throughout, so rerunning continues where it stopped (logs are appended).
#
#   bash runs/cpu_small_results.sh 4800            # what the README cites
#   bash runs/cpu_small_results.sh 4800 --smoke    # the same pipeline on a toy corpus with the tiny preset (seconds)
#
# Everything runs inside OUT (default runs/out/cpu-small) with relative paths, so the commands printed in the
# report and in the pictures' footers name paths relative to the run, not absolute temporary ones.
set -euo pipefail
STEPS=${1:-4800}
SMOKE=${2:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-runs/out/cpu-small}
PY=${PYTHON:-python3}
mkdir -p "$OUT" && cd "$OUT"
dgemma() { "$PY" -m dgemma "$@"; }

EVERY=$(( STEPS >= 12 ? STEPS / 12 : 1 ))
TRAIN=(--preset cpu-small --max-steps $((2 * STEPS)) --eval-every "$EVERY" --eval-batches 32 --save-every $((3 * EVERY))
       --keep-last 40)
EVAL=(--prompts 16 --max-denoising-steps-grid 8,16,32 --entropy-bounds 0.1,1 --ar-temperatures 0.7,0.85,1.0 --prompt-tokens 32
      --t-samples 8 --max-windows 128)
PREPARE=()
if [[ "$SMOKE" == --smoke ]]; then  # toy corpus, tiny model, two steps and a one-setting evaluation
  STEPS=2
  "$PY" -c "
from pathlib import Path
from dgemma.data.tokenizer import toy_corpus
s = toy_corpus(120); Path('toy').mkdir(exist_ok=True)
for i in range(150): Path(f'toy/d{i:03d}.txt').write_text(' '.join(s[(7 * i + j) % len(s)] for j in range(12)))"
  PREPARE=(--corpus toy --cache-dir .cache -q)
  EVERY=1
  TRAIN=(--preset tiny --vocab-size 1024 --batch-size 2 --eval-batches 1 --max-steps $((2 * STEPS)) --eval-every 1
         --save-every "$STEPS" --keep-last 40)
  EVAL=(--prompts 2 --max-denoising-steps-grid 16 --entropy-bounds 0.1 --ar-temperatures 1.0 --max-windows 2 --t-samples 1 --quiet)
fi

[[ -f data/meta.json ]] || dgemma data prepare --out data "${PREPARE[@]}"
export OMP_NUM_THREADS=1
dgemma train "${TRAIN[@]}" --data data --out diffusion --until-step "$STEPS" --resume \
    >> diffusion.log 2>&1 &
diffusion=$!
# The AR run stops at STEPS first, so that the compared checkpoint exists whatever STEPS and --save-every are, then
# goes on to 2 x STEPS (resuming is bit-exact: the same weights as one uninterrupted run).
{ dgemma train "${TRAIN[@]}" --objective ar --data data --out ar --until-step "$STEPS" --resume \
    && dgemma train "${TRAIN[@]}" --objective ar --data data --out ar --resume; } >> ar.log 2>&1 &
ar=$!
wait "$diffusion" || { tail -n 3 diffusion.log; exit 1; }
wait "$ar" || { tail -n 3 ar.log; exit 1; }
CKPT=$(printf 'step-%07d' "$STEPS")
OMP_NUM_THREADS=2 dgemma eval --model diffusion --baseline "ar/checkpoints/$CKPT" --judge ar --data data \
    --out report "${EVAL[@]}" --seed 0
dgemma viz report/traces/N16_eb0p1 --out report/viz --model diffusion

if [[ "$SMOKE" != --smoke ]]; then
  DEST="$ROOT/docs/results/cpu-small"
  mkdir -p "$DEST"
  cp report/report.md report/report.json report/frontier.png report/likelihood.png report/curves.png "$DEST/"
  cp report/viz/canvas_00_entropy.png report/viz/player.html "$DEST/"
  echo "copied the report and pictures to $DEST"
fi
