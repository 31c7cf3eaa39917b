"""Why diffusion samples repeat themselves (issue 40, item 2; docs/sampling.md "Repetition"), measured on the samples
of `dgemma eval` reports.

    python runs/repetition.py REPORT_DIR [REPORT_DIR ...] --data DIR [--out FILE.md] [--max-distance D]

The hypothesis: positions of one canvas that are finalised in the same step are drawn independently, each from its own
marginal, so two nearby positions that both favour a frequent token can both take it ("the the", ", ,"), which no
sequential sampler does; the next canvas is drawn given the committed one, so across a canvas boundary this cannot
happen. The test: for pairs of positions at distance 1..D, the share with the same token, for pairs inside one canvas
against pairs that straddle a canvas boundary, per sample, paired over samples. Independent draws predict
within > across, growing as the steps fall (more positions per step); the AR baseline's samples and held-out text (no
canvases: the "boundary" is a position like any other) are the controls and should show no difference. Also per
setting: adjacent repeats (x_i = x_(i+1)) and the share of repeated bigrams in a sample (1 - distinct-2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dgemma.data.shards import TokenDataset
from dgemma.eval.paired import mean_se, paired_difference


def pair_rates(sample: list[int], offset: int, canvas: int, max_d: int) -> tuple[float, float, float, float]:
    """(within-canvas same-token rate, across-boundary rate, adjacent-repeat rate, repeated-bigram share) of one
    sample whose first token sits at position `offset` of its canvas."""
    x = np.asarray(sample)
    pos = np.arange(len(x)) + offset
    same_w = n_w = same_a = n_a = 0
    for d in range(1, max_d + 1):
        eq = x[:-d] == x[d:]
        across = (pos[:-d] // canvas) != (pos[d:] // canvas)
        same_a, n_a = same_a + int(eq[across].sum()), n_a + int(across.sum())
        same_w, n_w = same_w + int(eq[~across].sum()), n_w + int((~across).sum())
    bigrams = list(zip(x[:-1].tolist(), x[1:].tolist(), strict=True))
    return (same_w / max(n_w, 1), same_a / max(n_a, 1), float((x[:-1] == x[1:]).mean()),
            1 - len(set(bigrams)) / max(len(bigrams), 1))


def setting_stats(samples: list[list[int]], offset: int, canvas: int, max_d: int) -> dict:
    rates = np.array([pair_rates(s, offset, canvas, max_d) for s in samples if len(s) > max_d])
    w, a, adj, rep = (rates[:, k].tolist() for k in range(4))
    return {"within": mean_se(w), "across": mean_se(a), "within_minus_across": paired_difference(w, a),
            "adjacent": mean_se(adj), "repeated_bigrams": mean_se(rep), "samples": len(rates)}


def heldout_samples(data: Path, n: int, length: int, seed: int = 0) -> list[list[int]]:
    val = TokenDataset(data, "val")
    starts = np.random.default_rng(seed).integers(0, val.num_tokens - length, n)
    return [val.read(int(s), length).tolist() for s in starts]


def analyse(report_dir: Path, data: Path, max_d: int) -> list[dict]:
    report = json.loads((report_dir / "report.json").read_text())
    canvas = json.loads((Path(report["model"]["checkpoint"]) if Path(report["model"]["checkpoint"]).is_absolute()
                         else report_dir.parent / report["model"]["checkpoint"]).joinpath("config.json")
                        .read_text())["canvas_length"]
    offset = report["prompts"]["tokens"] % canvas
    rows = []
    for row in report["frontier"]:
        rows.append({"report": report_dir.name, "setting": row["label"],
                     "tokens_per_forward": sum(row["per_prompt"]["generated"]) / sum(row["per_prompt"]["passes"]),
                     "nll": mean_se(row["per_prompt"]["nll_per_token"]),
                     **setting_stats(row["samples"], offset, canvas, max_d)})
    for row in report["ar_frontier"]:
        rows.append({"report": report_dir.name, "setting": row["name"], "tokens_per_forward": 1.0,
                     "nll": mean_se(row["per_prompt"]["nll_per_token"]),
                     **setting_stats(row["samples"], offset, canvas, max_d)})
    n, length = len(report["frontier"][0]["samples"]), len(report["frontier"][0]["samples"][0])
    rows.append({"report": report_dir.name, "setting": "held-out text", "tokens_per_forward": None, "nll": None,
                 **setting_stats(heldout_samples(data, n, length), offset, canvas, max_d)})
    return rows


def markdown(rows: list[dict], max_d: int) -> str:
    pm = lambda e, k=3: f"{e['mean']:.{k}f} ± {e['se']:.{k}f}"
    lines = [f"Same token at distance 1..{max_d}: pairs inside one canvas vs pairs across a canvas boundary (per "
             "sample, paired); adjacent repeats; repeated bigrams (1 - distinct-2).", "",
             "| report | setting | tokens/forward | judge NLL | within | across | within - across | adjacent | "
             "repeated bigrams | samples |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tpf = "–" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}"
        nll = "–" if r["nll"] is None else pm(r["nll"])
        d = r["within_minus_across"]
        lines.append(f"| {r['report']} | {r['setting']} | {tpf} | {nll} | {pm(r['within'])} | {pm(r['across'])} | "
                     f"{d['mean']:+.3f} ± {d['se']:.3f} | {pm(r['adjacent'])} | {pm(r['repeated_bigrams'])} | "
                     f"{r['samples']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", type=Path, nargs="+")
    ap.add_argument("--data", type=Path, required=True, help="the prepared data the reports were made on")
    ap.add_argument("--max-distance", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [r for d in args.reports for r in analyse(d, args.data, args.max_distance)]
    text = markdown(rows, args.max_distance)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
