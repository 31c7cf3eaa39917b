#!/usr/bin/env bash
# The README's "Results on this machine" (and docs/results/cpu-small/): learning curves of the diffusion model and its
# AR baseline on the default corpus, `cpu-small`, then `dgemma eval` with an independent judge over every sampler
# (the frontier of docs/sampling.md), and `dgemma viz`.
#
#   * the recipe is the demo's (docs/training.md, "The demo"): the diffusion model starts from its AR baseline's
#     weights halfway (--init-from ar/checkpoints/step-STEPS/2) and trains STEPS/2 diffusion steps with time
#     conditioning, continuous time and the observed likelihood. The AR run spans one schedule of 2 x STEPS steps (512
#     tokens each). So at the end the diffusion model has seen STEPS x 512 tokens (half of them as AR training), the
#     tokens of the compared AR baseline, the AR run's checkpoint at step STEPS; its learning curve counts the
#     inherited tokens (eval/curves.py). The judge that scores both sides' samples is the same AR run at 2 x STEPS,
#     trained on twice the tokens and not one of the compared models.
#   * both evaluate the held-out bound / cross-entropy every STEPS / 12 tokens' worth of steps with its SE, on the
#     first 128 held-out windows: the windows of the final evaluation (--eval-batches 32 of 4 windows, --max-windows
#     128), so the learning curves end where the report's likelihoods are measured. Every training record carries
#     the process's CPU seconds (`cpu_s`).
#   * the AR run trains alone on 2 threads to STEPS/2, then it goes on to 2 x STEPS beside the diffusion run, one
#     thread each (OMP_NUM_THREADS=1): about 45 minutes on 2 cores, plus about 15 for the evaluation.
#     `--resume` throughout, so rerunning continues where it stopped (logs are appended).
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
# The frontier (docs/sampling.md): entropy-bound over N x entropy_bound, then every other sampler over its settings.
# The committing samplers' N is a cap, so they run at one; the corrector doubles the passes, so it runs at half the
# ancestral chain's N (the same passes). The NELBO takes the 4 t per canvas of the learning curves.
SAMPLERS=(--sampler-grid 'lite:max_denoising_steps=16/32' --sampler-grid 'ancestral:max_denoising_steps=16/32'
          --sampler-grid 'predictor-corrector:max_denoising_steps=8/16'
          --sampler-grid 'confidence:commit_threshold=0.9/0.7/0.5,max_denoising_steps=32'
          --sampler-grid 'block-refinement:commit_threshold=0.9/0.7,max_denoising_steps=16'
          --sampler-grid 'block-refinement:commit_threshold=0.7,edit_threshold=0.9,max_denoising_steps=16')
EVAL=(--prompts 16 --max-denoising-steps-grid 8,16,32 --entropy-bounds 0.1,1 --ar-temperatures 0.7,0.85,1.0 --prompt-tokens 32
      --t-samples 4 --max-windows 128 "${SAMPLERS[@]}")
COMMITTING=confidence_N_32_commit_threshold_0p7  # the trace drawn beside entropy-bound's: a committing sampler
PREPARE=()
AR_ONLY=()  # flags of the AR run that the diffusion run takes from its start checkpoint instead
if [[ "$SMOKE" == --smoke ]]; then  # toy corpus, tiny model, two steps and a one-setting evaluation
  STEPS=2
  "$PY" -c "from dgemma.data.tokenizer import write_toy_corpus; write_toy_corpus('toy')"
  PREPARE=(--corpus toy --cache-dir .cache -q)
  EVERY=1
  AR_ONLY=(--vocab-size 1024)
  TRAIN=(--preset tiny --batch-size 2 --eval-batches 1 --max-steps $((2 * STEPS)) --eval-every 1
         --save-every "$STEPS" --keep-last 40)
  EVAL=(--prompts 2 --max-denoising-steps-grid 16 --entropy-bounds 0.1 --ar-temperatures 1.0 --max-windows 2 --t-samples 1 --quiet
        --sampler-grid 'confidence:commit_threshold=0.7,max_denoising_steps=8')
  COMMITTING=confidence_N_8_commit_threshold_0p7
fi

[[ -f data/meta.json ]] || dgemma data prepare --out data "${PREPARE[@]}"
HALF=$(( STEPS / 2 > 0 ? STEPS / 2 : 1 ))
START=$(printf 'step-%07d' "$HALF")
# The AR run stops at STEPS/2 first (alone, 2 threads), so that the diffusion run's start exists, then at STEPS, so
# that the compared checkpoint exists whatever STEPS and --save-every are, then goes on to 2 x STEPS (resuming is
# bit-exact: the same weights as one uninterrupted run).
OMP_NUM_THREADS=2 dgemma train "${TRAIN[@]}" "${AR_ONLY[@]}" --objective ar --data data --out ar --until-step "$HALF" --resume \
    >> ar.log 2>&1 || { tail -n 3 ar.log; exit 1; }
export OMP_NUM_THREADS=1
dgemma train "${TRAIN[@]}" --max-steps "$HALF" --init-from "ar/checkpoints/$START" --time-embedding \
    --observed-likelihood --data data --out diffusion --resume >> diffusion.log 2>&1 &
diffusion=$!
{ dgemma train "${TRAIN[@]}" "${AR_ONLY[@]}" --objective ar --data data --out ar --until-step "$STEPS" --resume \
    && dgemma train "${TRAIN[@]}" "${AR_ONLY[@]}" --objective ar --data data --out ar --resume; } >> ar.log 2>&1 &
ar=$!
wait "$diffusion" || { tail -n 3 diffusion.log; exit 1; }
wait "$ar" || { tail -n 3 ar.log; exit 1; }
CKPT=$(printf 'step-%07d' "$STEPS")
OMP_NUM_THREADS=2 dgemma eval --model diffusion --baseline "ar/checkpoints/$CKPT" --judge ar --data data \
    --out report "${EVAL[@]}" --seed 0
dgemma viz report/traces/N16_eb0p1 --out report/viz --model diffusion
dgemma viz "report/traces/$COMMITTING" --out report/viz-committing --model diffusion
"$PY" "$ROOT/runs/frontier_table.py" report/report.json --out report/frontier.md > /dev/null

if [[ "$SMOKE" != --smoke ]]; then
  DEST="$ROOT/docs/results/cpu-small"
  mkdir -p "$DEST"
  cp report/report.md report/report.json report/frontier.md report/frontier.png report/likelihood.png report/curves.png "$DEST/"
  cp report/viz/canvas_00_entropy.png report/viz/player.html "$DEST/"
  cp report/viz-committing/player.html "$DEST/player-committing.html"
  echo "copied the report and pictures to $DEST"
fi
