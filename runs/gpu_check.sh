#!/usr/bin/env bash
# Everything docs/benchmarks.md still lacks from a GPU, in one command sized for one H200 (under 10 minutes):
#   1. the tests marked `gpu` (grouped-mm bf16 experts, CUDA graphs, sync_every, int4 and CUDA expert offload);
#   2. the 26B-A4B geometry with random weights, bf16 / int8 / int4 weights and bf16 with offloaded experts: ms per
#      denoise step against the weight-bandwidth bound, and peak memory (`dgemma bench`);
#   3. lite-380m training throughput and MFU (bf16 autocast) (`dgemma bench`).
# Each writes its figure to a file under $OUT (default runs/out/gpu-check; the device runner collects $OUT), and the
# script ends with a markdown summary (also $OUT/summary.md) to paste into docs/benchmarks.md. A step that fails is
# recorded as failed and the others still run; the exit status is 1 if any failed.
#
#   bash runs/gpu_check.sh              # on a CUDA machine
#   bash runs/gpu_check.sh --dry-run    # the same steps on the CPU with the tiny preset (seconds; what the tests run)
set -uo pipefail
MODE=${1:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-runs/out/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [[ "$MODE" == --dry-run ]]; then
  DEVICE=cpu; BIG=tiny; TRAIN=tiny; DTYPE=float32; STEPS=2; TRAIN_STEPS=1; TEST_TIMEOUT=120; REPEATS=1
  EXTRA=(--threads 1)
else
  [[ -z "$MODE" ]] || { echo "usage: bash runs/gpu_check.sh [--dry-run]" >&2; exit 2; }
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "runs/gpu_check.sh: no CUDA device (use --dry-run to check the script on a CPU)" >&2; exit 2; }
  DEVICE=cuda; BIG=diffusiongemma-26b-a4b; TRAIN=lite-380m; DTYPE=bfloat16; STEPS=8; TRAIN_STEPS=5; TEST_TIMEOUT=240
  REPEATS=2; EXTRA=()
fi
FAILED=()
step() {  # step NAME COMMAND...: run it with its output in $OUT/NAME.log, note a failure, go on
  local name=$1; shift
  local start=$SECONDS
  echo "== $name: $*" >&2
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "   done in $((SECONDS - start)) s" >&2
  else
    echo "   FAILED (exit $?) after $((SECONDS - start)) s; see $OUT/$name.log" >&2
    FAILED+=("$name")
  fi
}

"$PY" -c "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': torch.cuda.is_available() and \
torch.cuda.get_device_name(0)}))" > "$OUT/machine.json"

# 1. the gpu-marked tests (they skip without CUDA)
step gpu_tests timeout "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -q -p no:cacheprovider "$ROOT/tests/sampling/test_fast_sampler.py" \
  "$ROOT/tests/weights/test_quantize.py" --junitxml "$OUT/gpu_tests.xml"

# 2. the 26B-A4B geometry, random weights: one canvas of STEPS fixed steps, fast path, after a warm-up
BENCH=(bench --preset "$BIG" --device "$DEVICE" --dtype "$DTYPE" --impl fast --denoising-steps "$STEPS" --canvases 1
       --repeats "$REPEATS" --no-train --json "${EXTRA[@]}")
for q in none int8 int4; do
  flags=(); [[ $q == none ]] || flags=(--quantize "$q")
  step "bench_${q}" bash -c "$(printf '%q ' "$PY" -m dgemma "${BENCH[@]}" "${flags[@]}") > $(printf %q "$OUT/bench_$q.json")"
done
if [[ $DEVICE == cpu && " ${FAILED[*]} " == *" bench_int4 "* ]] && grep -q "no int4 weight-only kernel" \
    "$OUT/bench_int4.log"; then  # the CPU refuses int4 (torchao has no CPU kernel): the refusal is the expected result
  FAILED=("${FAILED[@]/bench_int4}")
  FAILED=(${FAILED[@]})
fi
step bench_offload bash -c "$(printf '%q ' "$PY" -m dgemma "${BENCH[@]}" --offload-experts) > \
$(printf %q "$OUT/bench_offload.json")"

# 3. training throughput and MFU (the generation part on tiny is only what `dgemma bench` always runs)
step train bash -c "$(printf '%q ' "$PY" -m dgemma bench --preset tiny --device "$DEVICE" --impl fast --denoising-steps 2 \
  --canvases 1 --repeats 1 --train-preset "$TRAIN" --train-steps "$TRAIN_STEPS" --json "${EXTRA[@]}") > \
$(printf %q "$OUT/train.json")"

"$PY" - "$OUT" "${FAILED[@]}" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path

out, failed = Path(sys.argv[1]), sys.argv[2:]
machine = json.loads((out / "machine.json").read_text())
print(f"### runs/gpu_check.sh: {machine['cuda'] or 'CPU (dry run)'}, torch {machine['torch']}\n")
print("| 26B-A4B geometry, random weights | ms / denoise step | weight-bandwidth bound (ms) | step / bound "
      "| peak memory (GB) |")
print("|---|---|---|---|---|")
for q, label in (("none", "bf16"), ("int8", "int8 weights"), ("int4", "int4 weights"), ("offload", "bf16, offloaded experts")):
    path = out / f"bench_{q}.json"
    if not path.is_file() or not path.read_text().strip():
        log = (out / f"bench_{q}.log").read_text().strip().splitlines() if (out / f"bench_{q}.log").exists() else []
        refused = bool(log) and "error: --quantize" in log[-1]
        print(f"| {label} | {'refused' if refused else 'failed'}: {log[-1][:160] if log else 'no output'} | | | |")
        continue
    g = json.loads(path.read_text())["generation"]
    r, b = g["results"]["fast"], g["bounds"]["denoise_step"]
    peak = r["peak_memory_bytes"] / 1e9 if r["peak_memory_bytes"] else float("nan")
    print(f"| {label} ({g['model']}, {g['dtype']}) | {r['ms_per_denoise_step']:.1f} | {b['ms_memory_bound']:.2f} | "
          f"{r['ms_per_denoise_step'] / b['ms_memory_bound']:.1f}x | {peak:.1f} |")
if "train" not in failed and (out / "train.json").is_file():
    t = json.loads((out / "train.json").read_text())["training"]
    for obj in ("clean-context", "ar"):
        x = t["results"]["fast"][obj]
        print(f"\ntraining {t['preset']} {obj} ({t['precision']}, batch {t['batch']} x {t['seq_len']}): "
              f"{x['ms_per_step']:.1f} ms/step, {x['tokens_per_second']:.0f} tok/s, MFU {100 * x['mfu']:.1f}%")
else:
    print("\ntraining: failed (see train.log)")
tests = out / "gpu_tests.log"
print(f"\ngpu-marked tests: {tests.read_text().strip().splitlines()[-1] if tests.exists() else 'no output'}")
print(f"\nfailed steps: {', '.join(failed) if failed else 'none'}")
EOF
[[ ${#FAILED[@]} -eq 0 ]]
