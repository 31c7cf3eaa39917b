"""Pictures of denoising, from a trace (`dgemma generate --trace FILE`, or the traces `dgemma eval` keeps).

    load_trace(path)            path.json (summary, with "format": "dgemma-trace-1") + path.npz (per-step arrays),
                                read and checked by dgemma/sampling/trace.py
    render_trace(trace, out)    per canvas: entropy in reading order over steps (seed 000's heatmaps), fraction of
                                positions accepted / finalized per step, acceptance transitions, finalization order,
                                an animated GIF; and player.html, a self-contained canvas player
    renoise_counts, renoised_fraction    acceptance transitions counted over a trace (the re-noised fraction)

matplotlib is optional (`pip install 'dgemma[viz]'`) and imported only when a figure is drawn. Every figure carries the
command that produced it in its footer (`figure`, also used by the plots of the eval report, dgemma/eval/report.py).
Figures have fixed pixel sizes (no tight bounding box), so they can be laid out and tested.
"""

from __future__ import annotations

import html
import json
import math
import textwrap
from collections import Counter
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dgemma.io import fsio
from dgemma.sampling.trace import TRACE_FORMAT, Trace, TraceData
from dgemma.train.heldout import EvalError

FIGURE_INCHES = (12.0, 8.0)  # every PNG: 1200 x 800 pixels at DPI
GIF_INCHES = (6.0, 6.0)  # every GIF frame: 480 x 480 pixels at GIF_DPI
DPI, GIF_DPI = 100, 80
GIF_FRAME_MS = 400
MAX_PANELS = 12  # steps shown as small multiples in the entropy figure


def pyplot() -> Any:
    try:
        import matplotlib
        import PIL  # noqa: F401  (the GIF writer; matplotlib depends on it too)
    except ImportError:
        raise ImportError("plots need matplotlib and pillow, which are not installed: pip install 'dgemma[viz]'"
                          ) from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def check_installed() -> None:
    """Raise ImportError (saying what to install) unless the plotting dependencies are importable."""
    pyplot()


def grid_width(L: int) -> int:
    """Cells per line when a canvas is laid out in reading order: a power of two near sqrt(L) (256 -> 16 x 16)."""
    return max(1, 2 ** math.ceil(math.log2(math.sqrt(L)))) if L > 1 else 1


def reading_order(values: np.ndarray, width: int, fill: float = np.nan) -> np.ndarray:
    """(L,) -> (ceil(L / width), width), row-major like text; cells past the end are `fill`."""
    rows = -(-len(values) // width)
    out = np.full(rows * width, fill, dtype=np.float64)
    out[: len(values)] = values
    return out.reshape(rows, width)


def finalized_step(argmax: np.ndarray) -> np.ndarray:
    """(steps, L) argmax of one canvas -> (L,) the first step index from which each position's argmax never changes
    again: when the canvas 'knew' that token."""
    same = argmax == argmax[-1][None]
    # position p is final from step s if same[s:, p] is all True: reverse cumulative AND
    tail = np.flip(np.logical_and.accumulate(np.flip(same, 0), 0), 0)
    return np.argmax(tail, axis=0)  # tail[-1] is all True, so every position has one


def token_texts(ids: np.ndarray, tokenizer: Any | None) -> dict[int, str]:
    """Display text per id: the decoded token with whitespace made visible, or the id itself."""
    out = {}
    for i in sorted(set(int(x) for x in np.unique(ids))):
        if tokenizer is None:
            out[i] = str(i)
            continue
        text = tokenizer.decode([i]).replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·")
        # other control characters in caret notation (^[ for ESC): every font has those glyphs
        out[i] = "".join("^" + chr(ord(ch) + 64) if ord(ch) < 32 else "^?" if ord(ch) == 127 else ch
                         for ch in text) or f"#{i}"
    return out


# --- figures of a trace ---------------------------------------------------------------------------------------------

def figure(plt: Any, title: str, command: str, inches: tuple[float, float] = FIGURE_INCHES, dpi: int = DPI) -> Any:
    """A figure of fixed size with `title` and, in its footer, the command that produced it (wrapped to fit)."""
    fig = plt.figure(figsize=inches, dpi=dpi)
    fig.suptitle(title, fontsize=12 if inches[0] >= 8 else 9)
    size = 7 if inches[0] >= 8 else 5
    per_line = int(inches[0] * 72 / (0.62 * size)) - 2  # monospace glyphs are about 0.6 em wide
    fig.text(0.005, 0.005, "\n".join(textwrap.wrap(command, per_line)), fontsize=size, color="0.35",
             family="monospace", ha="left", va="bottom")
    return fig


def save_figure(fig: Any, path: Path) -> Path:
    # no bbox_inches="tight": the pixel size stays the figure size; the format follows the name, not the temp file's
    fsio.atomic_write(path, lambda _tmp, f: fig.savefig(f, dpi=fig.dpi, format=path.suffix.lstrip(".") or "png"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_entropy(trace: TraceData, canvas: int, row: int, path: Path, command: str) -> Path:
    """Seed 000's heatmaps: the canvas in reading order at several steps, colour = entropy (nats), dots = accepted;
    and below, entropy by position (reading order) against step."""
    plt = pyplot()
    a, steps = trace.arrays, trace.steps(canvas, row)
    L, W = trace.canvas_length, grid_width(trace.canvas_length)
    ent = a["entropy"][steps, row].astype(np.float64)
    vmax = max(float(ent.max()), 1e-6)
    shown = np.unique(np.linspace(0, len(steps) - 1, min(MAX_PANELS, len(steps))).round().astype(int))
    fig = figure(plt, f"Entropy per canvas position over steps (canvas {canvas}, row {row}; reading order, "
                  f"{W} per line)", command)
    cols = min(len(shown), 6)
    rows = -(-len(shown) // cols)
    grid = fig.add_gridspec(rows + 2, cols, height_ratios=[1] * rows + [0.02, 1.4], left=0.05, right=0.93,
                            top=0.9, bottom=0.08, hspace=0.3)
    image = None
    for n, k in enumerate(shown):
        ax = fig.add_subplot(grid[n // cols, n % cols])
        image = ax.imshow(reading_order(ent[k], W), vmin=0, vmax=vmax, cmap="magma", aspect="auto")
        acc = reading_order(a["accepted"][steps[k], row].astype(float), W, fill=0)
        yy, xx = np.nonzero(acc > 0)
        ax.scatter(xx, yy, s=4, c="cyan", marker="o", linewidths=0)
        ax.set_title(f"step {int(a['step'][steps[k]])}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    ax = fig.add_subplot(grid[rows + 1, :])
    image = ax.imshow(ent.T, aspect="auto", cmap="magma", vmin=0, vmax=vmax, origin="upper",
                      extent=(0.5, len(steps) + 0.5, L - 0.5, -0.5))
    ax.set_xlabel("denoising step")
    ax.set_ylabel("position (reading order)")
    cax = fig.add_axes((0.945, 0.08, 0.012, 0.8))
    fig.colorbar(image, cax=cax, label="entropy (nats); dots: accepted")
    return save_figure(fig, path)


def plot_finalized(trace: TraceData, canvas: int, row: int, path: Path, command: str) -> Path:
    """Fraction of positions accepted by the sampler and fraction finalized (argmax already at its final value for
    good) at each step, with the mean entropy."""
    plt = pyplot()
    a, steps = trace.arrays, trace.steps(canvas, row)
    x = a["step"][steps]
    accepted = a["accepted"][steps, row].mean(-1)
    final = finalized_step(a["argmax"][steps, row])
    finalized = [(final <= k).mean() for k in range(len(steps))]
    fig = figure(plt, f"Positions finalized per step (canvas {canvas}, row {row})", command)
    ax = fig.add_axes((0.08, 0.1, 0.82, 0.78))
    ax.plot(x, accepted, "o-", label="accepted by the sampler")
    ax.plot(x, finalized, "s-", label="finalized (argmax never changes again)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("denoising step")
    ax.set_ylabel("fraction of canvas positions")
    ax2 = ax.twinx()
    ax2.plot(x, a["mean_entropy"][steps, row], "--", color="0.5", label="mean entropy (right)")
    ax2.set_ylabel("mean entropy (nats)")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="center right")
    return save_figure(fig, path)


def transitions(trace: TraceData, canvas: int, row: int) -> dict[str, np.ndarray]:
    """Per consecutive pair of steps: positions kept accepted, re-noised (accepted -> not), newly accepted, and left
    as noise."""
    a, steps = trace.arrays, trace.steps(canvas, row)
    acc = a["accepted"][steps, row]
    prev, nxt = acc[:-1], acc[1:]
    return {"kept": (prev & nxt).sum(-1), "renoised": (prev & ~nxt).sum(-1), "accepted": (~prev & nxt).sum(-1),
            "stayed noise": (~prev & ~nxt).sum(-1)}


def renoise_counts(arrays: dict[str, np.ndarray], row: int | None = None) -> dict[str, int]:
    """Acceptance transitions between consecutive steps of the same canvas, for the steps a row spent (`active`):
    accepted -> accepted, accepted -> renoised, renoised -> accepted, renoised -> renoised."""
    canvas, accepted, active = arrays["canvas"], arrays["accepted"], arrays["active"]  # (S,), (S, B, L), (S, B)
    rows = range(accepted.shape[1]) if row is None else [row]
    counts = {"kept": 0, "renoised": 0, "accepted": 0, "stayed_noise": 0}
    for s in range(len(canvas) - 1):
        if canvas[s + 1] != canvas[s]:
            continue
        for b in rows:
            if not (active[s, b] and active[s + 1, b]):
                continue
            a, nxt = accepted[s, b], accepted[s + 1, b]
            counts["kept"] += int((a & nxt).sum())
            counts["renoised"] += int((a & ~nxt).sum())
            counts["accepted"] += int((~a & nxt).sum())
            counts["stayed_noise"] += int((~a & ~nxt).sum())
    return counts


def renoised_fraction(traces: Sequence[Trace]) -> dict[str, Any]:
    """Of the tokens accepted at step s that have a step s+1 in the same canvas, the fraction not accepted at s+1
    (re-noised): seed 000's open question."""
    total = Counter[str]()
    for tr in traces:
        total.update(renoise_counts(tr.arrays()))
    base = total["kept"] + total["renoised"]
    return {**dict(total), "fraction": total["renoised"] / base if base else math.nan}


def plot_transitions(trace: TraceData, canvas: int, row: int, path: Path, command: str) -> Path:
    """Acceptance transitions between consecutive steps, one panel per kind (re-noising is rare: its own axis)."""
    plt = pyplot()
    tr = transitions(trace, canvas, row)
    steps = trace.steps(canvas, row)
    x = [f"{int(trace.arrays['step'][s])}→{int(trace.arrays['step'][s]) + 1}" for s in steps[:-1]]
    counts = renoise_counts({k: trace.arrays[k] for k in ("canvas", "accepted", "active")}, row)
    base = counts["kept"] + counts["renoised"]
    frac = counts["renoised"] / base if base else float("nan")
    fig = figure(plt, f"Acceptance transitions (canvas {canvas}, row {row}): {frac:.1%} of accepted tokens "
                  "re-noised at the next step (all canvases of this row)", command)
    for n, (name, values) in enumerate(tr.items()):
        ax = fig.add_subplot(2, 2, n + 1)
        ax.bar(range(len(values)), values, color=("tab:green", "tab:red", "tab:blue", "0.6")[n])
        ax.set_title({"kept": "accepted → accepted", "renoised": "accepted → re-noised",
                      "accepted": "re-noised → accepted", "stayed noise": "re-noised → re-noised"}[name], fontsize=10)
        ax.set_xticks(range(len(x)), x, fontsize=7, rotation=45 if len(x) > 10 else 0)
        ax.set_ylabel("positions")
        ax.set_ylim(0, max(1, trace.canvas_length))
    fig.subplots_adjust(left=0.07, right=0.97, top=0.88, bottom=0.1, hspace=0.45)
    return save_figure(fig, path)


def plot_order(trace: TraceData, canvas: int, row: int, path: Path, command: str) -> Path:
    """The step at which each position was finalized, in reading order, and against position: left to right is the
    'thinks causally' pattern seed 000 reports for prose."""
    plt = pyplot()
    a, steps = trace.arrays, trace.steps(canvas, row)
    L, W = trace.canvas_length, grid_width(trace.canvas_length)
    final = a["step"][steps][finalized_step(a["argmax"][steps, row])]
    rho = _spearman(np.arange(L), final)
    fig = figure(plt, f"Order of finalization (canvas {canvas}, row {row}): Spearman(position, step) = {rho:.2f}",
                  command)
    ax = fig.add_axes((0.05, 0.12, 0.5, 0.75))
    grid = reading_order(final.astype(float), W)
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    if L <= 256:
        for (r, c), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(c, r, str(int(v)), ha="center", va="center", fontsize=6 if W > 8 else 9, color="w")
    ax.set_xticks([])
    ax.set_yticks([])
    fig.colorbar(image, ax=ax, label="step at which the position was finalized")
    ax = fig.add_axes((0.66, 0.12, 0.31, 0.75))
    ax.scatter(np.arange(L), final, s=10)
    ax.set_xlabel("position in the canvas")
    ax.set_ylabel("finalized at step")
    return save_figure(fig, path)


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v), dtype=np.float64)
    ranks[order] = np.arange(len(v))
    for value in np.unique(v):  # ties share their mean rank
        tie = v == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def write_gif(trace: TraceData, canvas: int, row: int, path: Path, command: str, tokenizer: Any = None) -> Path:
    """One frame per step: the canvas in reading order, colour = entropy (dark = certain), text = the argmax token,
    a cyan frame around accepted positions."""
    plt = pyplot()
    from PIL import Image

    a, steps = trace.arrays, trace.steps(canvas, row)
    L, W = trace.canvas_length, grid_width(trace.canvas_length)
    vmax = max(float(a["entropy"][steps, row].max()), 1e-6)
    texts = token_texts(a["argmax"][steps, row], tokenizer)
    frames = []
    for s in steps:
        fig = figure(plt, f"canvas {canvas}, step {int(a['step'][s])}/{len(steps)}, T={float(a['temperature'][s]):.2f}"
                      f", mean H={float(a['mean_entropy'][s, row]):.2f}", command, GIF_INCHES, GIF_DPI)
        ax = fig.add_axes((0.02, 0.1, 0.96, 0.8))
        ax.imshow(reading_order(a["entropy"][s, row].astype(float), W), cmap="magma", vmin=0, vmax=vmax,
                  aspect="auto")
        for p in range(L):
            r, c = divmod(p, W)
            ax.text(c, r, texts[int(a["argmax"][s, row, p])][:6], ha="center", va="center",
                    fontsize=max(4, 11 - W // 4), color="k" if a["entropy"][s, row, p] > vmax / 2 else "w")
            if a["accepted"][s, row, p]:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="tab:cyan", linewidth=2))
        ax.set_xticks([])
        ax.set_yticks([])
        fig.canvas.draw()
        frames.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()))
        plt.close(fig)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=GIF_FRAME_MS, loop=0)
    return path


# --- the HTML player ------------------------------------------------------------------------------------------------

# The player's page (package data beside this module): __TITLE__, __COMMAND__ and __DATA__ are filled in.
PLAYER_TEMPLATE = resources.files("dgemma.eval") / "player.html"


CHANGES = ("", "newly accepted", "re-noised", "changed while accepted")  # step_changes' codes 0..3


def step_changes(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """What each step did to each position (S, B, L), against the row's previous step of the same canvas: 1 newly
    accepted, 2 re-noised (accepted before, not now), 3 accepted before and now with another token out of this step
    (an edit of a committing sampler; for entropy-bound, whose accepted tokens are drawn again each step, a redraw),
    else 0. A step's output is the next step's input canvas, so the last step of a canvas shows no change of token."""
    canvas, acc, x, active = arrays["canvas"], arrays["accepted"].astype(bool), arrays["input_canvas"], arrays["active"]
    out = np.zeros(acc.shape, dtype=np.int8)
    for b in range(acc.shape[1]):
        steps = [s for s in range(len(canvas)) if active[s, b]]
        for k in range(1, len(steps)):
            prev, s, nxt = steps[k - 1], steps[k], steps[k + 1] if k + 1 < len(steps) else None
            if canvas[prev] != canvas[s]:
                continue
            was, now = acc[prev, b], acc[s, b]
            out[s, b][~was & now] = 1
            out[s, b][was & ~now] = 2
            if nxt is not None and canvas[nxt] == canvas[s]:  # the token this step leaves at each position
                out[s, b][was & now & (x[nxt, b] != x[s, b])] = 3
    return out


def player_data(trace: TraceData, tokenizer: Any = None) -> dict[str, Any]:
    """What the player embeds: per step the ids, acceptance, what the step changed (`step_changes`), noise level,
    entropy and (with a constraint) what the grammar did (pinned, closed) of every row, the text of every id, and the
    trace's summary (its sampler settings)."""
    a = trace.arrays
    changes = step_changes(a)
    level = a.get("level")
    steps = [{"canvas": int(a["canvas"][s]), "step": int(a["step"][s]), "temperature": float(a["temperature"][s]),
              "argmax": a["argmax"][s].tolist(), "input": a["input_canvas"][s].tolist(),
              "accepted": a["accepted"][s].astype(int).tolist(), "change": changes[s].tolist(),
              "level": None if level is None else np.round(level[s].astype(np.float64), 4).tolist(),
              "entropy": np.round(a["entropy"][s].astype(np.float64), 3).tolist(),
              "mean_entropy": np.round(a["mean_entropy"][s].astype(np.float64), 4).tolist(),
              "active": a["active"][s].astype(bool).tolist(),
              "grammar": a["grammar"][s].tolist() if "grammar" in a else None} for s in range(len(a["canvas"]))]
    ids = np.concatenate([a["argmax"].ravel(), a["input_canvas"].ravel()])
    return {"format": TRACE_FORMAT, "canvas_length": trace.canvas_length, "grid_width": grid_width(trace.canvas_length),
            "batch_size": trace.batch_size, "canvases": trace.canvases(),
            "max_entropy": max(float(a["entropy"].max()), 1e-6), "steps": steps,
            "vocab": {str(k): v for k, v in token_texts(ids, tokenizer).items()}, "summary": trace.summary,
            "changes": list(CHANGES),
            "sampler": (trace.summary.get("generation_config") or {}).get("sampler", "entropy-bound")}


def write_player(trace: TraceData, path: Path, command: str, tokenizer: Any = None) -> Path:
    """One self-contained HTML file (inline CSS and JS, the data as embedded JSON): play / pause / step / slider."""
    # "<" and ">" escaped inside the JSON so no token text can close the <script> element
    data = json.dumps(player_data(trace, tokenizer), separators=(",", ":"), ensure_ascii=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = (PLAYER_TEMPLATE.read_text(encoding="utf-8").replace("__TITLE__", html.escape(trace.path.name))
            .replace("__COMMAND__", html.escape(command)).replace("__DATA__", data))
    fsio.write_text(path, page)
    return path


def render_trace(trace: TraceData, out: str | Path, *, command: str, tokenizer: Any = None, row: int = 0,
                 canvases: list[int] | None = None, gif_canvas: int | None = None) -> list[Path]:
    """Every picture of `trace` into `out`: four PNGs per canvas, one GIF, player.html. Returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not 0 <= row < trace.batch_size:
        raise EvalError(f"--row {row}: the trace has rows 0..{trace.batch_size - 1}")
    have = trace.canvases()
    canvases = have if canvases is None else canvases
    bad = [c for c in canvases if c not in have]
    if bad:
        raise EvalError(f"--canvas {bad}: the trace has canvases {have}")
    canvases = [c for c in canvases if len(trace.steps(c, row))]  # canvases the row spent steps on
    if not canvases:
        raise EvalError(f"row {row} spent no denoising step in the selected canvases (its sequence had ended)")
    written = []
    for c in canvases:
        for name, plot in (("entropy", plot_entropy), ("finalized", plot_finalized),
                           ("acceptance_transitions", plot_transitions), ("order", plot_order)):
            written.append(plot(trace, c, row, out / f"canvas_{c:02d}_{name}.png", command))
    g = canvases[0] if gif_canvas is None else gif_canvas
    if g not in canvases:
        raise EvalError(f"--gif-canvas {g}: not among the canvases drawn ({canvases})")
    written.append(write_gif(trace, g, row, out / f"canvas_{g:02d}.gif", command, tokenizer))
    written.append(write_player(trace, out / "player.html", command, tokenizer))
    return written


__all__ = [
    "CHANGES",
    "check_installed",
    "figure",
    "grid_width",
    "player_data",
    "plot_entropy",
    "plot_finalized",
    "plot_order",
    "plot_transitions",
    "pyplot",
    "reading_order",
    "render_trace",
    "renoise_counts",
    "renoised_fraction",
    "save_figure",
    "step_changes",
    "token_texts",
    "transitions",
    "write_gif",
    "write_player",
]
