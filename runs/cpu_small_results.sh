#!/usr/bin/env bash
# The cpu-small comparison of docs/results.md and the frontier of docs/sampling.md, under the evaluation rules of
# docs/evaluation.md ("What a reviewer can check"): comparators trained for their budget, two training seeds on each
# side, a separately trained judge, independent Monte Carlo draws per model, >= 200 prompts with several sampling
# seeds.
#
#   runs (inside OUT, one core each, in three lanes; every command --resume, so rerunning continues where it stopped):
#     ar-s0, ar-s1           the AR comparators: one cosine schedule of STEPS steps of 512 tokens, annealed at STEPS
#                            (the compared budget), training seeds 0 and 1 (the seed also sets the data order)
#     diffusion-s0, -s1      diffusion from ar-sN's checkpoint at STEPS/2 (--init-from: the demo's recipe, time
#                            conditioning, continuous time, the observed likelihood), STEPS/2 diffusion steps of
#                            their own annealed schedule: STEPS x 512 tokens in all, the AR comparator's, the start's
#                            counted (eval/curves.py); its compute is more than the comparator's (below)
#     judge                  an AR run of 2 x STEPS steps with training seed 100 (another initialisation and data
#                            order), never a checkpoint of a compared run; it scores both sides' samples in float64
#     ar-compute-s0          an AR run of 3 x STEPS / 2 steps, seed 0: about the diffusion run's training compute with
#                            its AR start's (a diffusion step costs about twice an AR step: the clean and the noisy
#                            copy; the CPU seconds of both are in the runs' metrics and in summary.md)
#   evaluation: `dgemma eval` of diffusion-sN against ar-sN for N = 0, 1 (report-s0, report-s1), the same judge and
#   prompts, then runs/cpu_small_summary.py writes summary.md/json (both seeds side by side, their mean, and the
#   compute-matched comparator's held-out figure).
#
#   bash runs/cpu_small_results.sh 4800            # what docs/results.md cites: ~3 h of training on 2 cores, then
#                                                  # 3-4 h of evaluation per seed (not yet measured: a count
#                                                  # of its ~14k quality decodes and 256 timed rotations)
#   bash runs/cpu_small_results.sh 4800 --smoke    # the same pipeline on a toy corpus with the tiny preset (seconds)
#
# Everything runs inside OUT (default runs/out/cpu-small) with relative paths, so the commands printed in the
# reports and in the pictures' footers name paths relative to the run.
set -euo pipefail
STEPS=${1:-4800}
SMOKE=${2:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-runs/out/cpu-small}
PY=${PYTHON:-python3}
mkdir -p "$OUT" && cd "$OUT"
dgemma() { nice -n "${NICE:-0}" "$PY" -m dgemma "$@"; }

EVERY=$(( STEPS >= 12 ? STEPS / 12 : 1 ))
COMMON=(--preset cpu-small --eval-every "$EVERY" --eval-batches 32 --save-every $((3 * EVERY)) --keep-last 40)
AR_ONLY=()  # flags of the AR runs that the diffusion runs take from their start checkpoints instead
PREPARE=()
# The frontier (docs/sampling.md): entropy-bound at N = L, L/2, L/4 (and the bounded chain, the committing samplers
# and Lite beside it), the AR comparator over a fine temperature grid, >= 200 prompts, 3 sampling seeds.
EVAL=(--prompts 256 --sample-seeds 3 --prompt-tokens 32 --max-denoising-steps-grid 8,16,32 --entropy-bounds 0.1
      --ar-temperatures 0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1.0 --max-windows 128
      --sampler-grid 'ancestral:t_min=1,t_max=1,self_conditioning=off,max_denoising_steps=32'
      --sampler-grid 'lite:max_denoising_steps=32'
      --sampler-grid 'confidence:commit_threshold=0.9,max_denoising_steps=32'
      --sampler-grid 'block-refinement:commit_threshold=0.9,max_denoising_steps=16')
if [[ "$SMOKE" == --smoke ]]; then  # toy corpus, tiny model, two steps and a one-setting evaluation
  STEPS=2
  "$PY" -c "from dgemma.data.tokenizer import write_toy_corpus; write_toy_corpus('toy')"
  PREPARE=(--corpus toy --cache-dir .cache -q)
  EVERY=1
  AR_ONLY=(--vocab-size 1024)
  COMMON=(--preset tiny --batch-size 2 --eval-batches 1 --eval-every 1 --save-every 1 --keep-last 40)
  EVAL=(--prompts 2 --sample-seeds 1 --max-denoising-steps-grid 16 --entropy-bounds 0.1 --ar-temperatures 1.0
        --max-windows 2 --t-samples 1 --quiet --sampler-grid 'confidence:commit_threshold=0.7,max_denoising_steps=8')
fi
HALF=$(( STEPS / 2 > 0 ? STEPS / 2 : 1 ))
START=$(printf 'step-%07d' "$HALF")

[[ -f data/meta.json ]] || dgemma data prepare --out data "${PREPARE[@]}"
export OMP_NUM_THREADS=1
ar() {  # ar NAME SEED STEPS: an AR run whose schedule ends at STEPS
  dgemma train "${COMMON[@]}" "${AR_ONLY[@]}" --objective ar --max-steps "$3" --seed "$2" --data data --out "$1" --resume
}
lane() {  # the AR comparator of one seed (stopping at STEPS/2 first, so that the start checkpoint exists), then the
          # diffusion run from it (resuming is bit-exact: the same weights as one uninterrupted run)
  local s=$1
  dgemma train "${COMMON[@]}" "${AR_ONLY[@]}" --objective ar --max-steps "$STEPS" --seed "$s" --data data \
      --out "ar-s$s" --until-step "$HALF" --resume
  ar "ar-s$s" "$s" "$STEPS"
  dgemma train "${COMMON[@]}" --max-steps "$HALF" --seed "$s" --init-from "ar-s$s/checkpoints/$START" \
      --time-embedding --observed-likelihood --data data --out "diffusion-s$s" --resume
}
lane 0 >> lane0.log 2>&1 & l0=$!
lane 1 >> lane1.log 2>&1 & l1=$!
ar judge 100 $((2 * STEPS)) >> judge.log 2>&1 & lj=$!
wait "$l0" || { tail -n 3 lane0.log; exit 1; }
wait "$l1" || { tail -n 3 lane1.log; exit 1; }
ar ar-compute-s0 0 $((3 * STEPS / 2)) >> compute.log 2>&1 || { tail -n 3 compute.log; exit 1; }
wait "$lj" || { tail -n 3 judge.log; exit 1; }
unset OMP_NUM_THREADS

for s in 0 1; do
  [[ -f "report-s$s/report.json" ]] || dgemma eval --model "diffusion-s$s" --baseline "ar-s$s" --judge judge \
      --data data --out "report-s$s" --threads 2 --seed "$s" "${EVAL[@]}"
done
"$PY" "$ROOT/runs/cpu_small_summary.py" report-s0 report-s1 --compute-matched ar-compute-s0 --out summary
dgemma viz report-s0/traces/N16_eb0p1 --out report-s0/viz --model diffusion-s0
"$PY" "$ROOT/runs/frontier_table.py" report-s0/report.json --out report-s0/frontier.md > /dev/null

if [[ "$SMOKE" != --smoke ]]; then
  DEST="$ROOT/docs/results/cpu-small"
  mkdir -p "$DEST"
  cp summary/summary.md summary/summary.json "$DEST/"
  for s in 0 1; do
    mkdir -p "$DEST/seed-$s"
    cp "report-s$s"/report.{md,json} "report-s$s"/{frontier,likelihood,curves}.png "$DEST/seed-$s/"
  done
  cp report-s0/frontier.md "$DEST/"
  cp report-s0/viz/canvas_00_entropy.png report-s0/viz/player.html "$DEST/"
  echo "copied the reports and pictures to $DEST"
fi
