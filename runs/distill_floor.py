"""How much of a distillation's KL a student can remove (issue 40; docs/training.md, "Few-step samplers by
distillation"). The distillation loss against one teacher two-step draw p_k = p_T(x0 | x_s'^k) splits exactly:

    E_k KL(p_k || p_S) = E_k KL(p_k || m) + KL(m || p_S),     m = E_k p_k (the mean target)
         init/after          floor                learnable

The floor is the spread of the teacher's two-step outcomes, the same for every student; the learnable part is what
training can remove (train/distill.py, "Lower-variance targets"). On held-out windows of the data (the same windows,
levels, corruption and teacher draws for every student: paired), with K independent teacher half-steps per x_s:

    floor      mean_k KL(p_k || m_K) x K / (K - 1)         (m_K, the mean of the K draws, sits closer to them)
    learnable  KL(m_K || p_S)                              (biased up by the same ~floor / K for every student)

and, for each student after the first, its learnable KL minus the first's, with the SE over windows (per-window
means, paired). Each student is read at its own level s as the loss reads it: the clean-context forward, no
self-conditioning.

    python runs/distill_floor.py --teacher demo/diffusion --student demo/diffusion --student student-8 \
        --student-steps 8 --data demo/data --out floor-8.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from dgemma.data.shards import TokenDataset
from dgemma.diffusion.likelihood import posterior_logits
from dgemma.diffusion.noise import q_sample
from dgemma.io import fsio
from dgemma.model.attention import clean_context_masks
from dgemma.train.diffusion import sample_canvas_t, self_conditioned_hidden
from dgemma.train.distill import teacher_step
from dgemma.weights.checkpoint import resolve_model_dir
from dgemma.weights.loading import load_model


def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(exp a || exp b) per row of log-probabilities, float64."""
    return (a.exp() * (a - b)).sum(-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--teacher", required=True, help="the distillation's teacher (run or checkpoint)")
    p.add_argument("--student", action="append", required=True,
                   help="a student (run or checkpoint); repeat: the first is the reference of the paired differences")
    p.add_argument("--student-steps", type=int, required=True, help="the students' N (the teacher steps 1/(2N))")
    p.add_argument("--data", required=True, help="prepared data directory (its val split)")
    p.add_argument("--windows", type=int, default=32, help="held-out windows (default 32)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--draws", type=int, default=8, help="teacher half-steps per x_s, K (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON written here")
    a = p.parse_args(argv)
    if a.draws < 2:
        p.error("--draws must be >= 2 (the floor is the spread of the draws)")
    torch.manual_seed(a.seed)
    teacher = load_model(resolve_model_dir(a.teacher), dtype=torch.float32).eval()
    cfg = teacher.config
    L, W, V, N, S, B, K = cfg.canvas_length, cfg.sliding_window, cfg.vocab_size, a.student_steps, a.seq_len, \
        a.windows, a.draws
    if S % L:
        p.error(f"--seq-len {S} is not a whole number of canvases of {L}")
    val = TokenDataset(a.data, "val")
    if val.num_tokens <= S:
        p.error(f"--data {a.data}: the val split has {val.num_tokens} tokens, fewer than --seq-len {S}")
    g = torch.Generator().manual_seed(a.seed)
    starts = torch.randint(0, val.num_tokens - S, (B,), generator=g)
    x0 = torch.stack([torch.as_tensor(val.read(int(s), S).astype("int64")) for s in starts])
    t = sample_canvas_t(B, S // L, N, generator=g)
    xs = q_sample(x0, t, N, L, V, g, None)
    level = (t.double() / N).repeat_interleave(L, dim=1)
    half, lvf = level - 1.0 / (2 * N), level.reshape(-1)
    pos = torch.arange(S)
    positions, masks = torch.cat([pos, pos])[None], clean_context_masks(S, L, W, "cpu")
    clean = torch.zeros_like(level, dtype=torch.float32)

    def hidden(model: torch.nn.Module, noisy: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
        out = self_conditioned_hidden(model, torch.cat([x0, noisy], 1), positions, masks, num_clean=S,
                                      level=torch.cat([clean, lv.float()], 1), self_conditioned=False,
                                      chunk_rows=None)
        return out[:, S:].reshape(B * S, -1)

    def log_posterior(model: torch.nn.Module, noisy: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
        z = posterior_logits(model, hidden(model, noisy, lv), noisy.reshape(-1), lv.reshape(-1).float())
        return torch.log_softmax(z.double(), -1)

    with torch.no_grad():
        u = torch.stack([torch.rand(B * S, generator=g) for _ in range(K)], -1)  # (M, K)
        draws = teacher_step(teacher, hidden(teacher, xs, level), xs.reshape(-1), lvf, N, u, B * S)
        targets = torch.stack([log_posterior(teacher, x2.view(B, S), half) for x2 in draws.unbind(-1)])  # (K, M, V)
        mean = torch.logsumexp(targets, 0) - math.log(K)
        floor = torch.stack([kl(targets[k], mean) for k in range(K)]).mean(0) * K / (K - 1)
        rows = {}
        for name in a.student:
            st = load_model(resolve_model_dir(name), dtype=torch.float32).eval()
            if st.config != cfg:
                p.error(f"--student {name}: its architecture differs from the teacher's")
            logp = log_posterior(st, xs, level)
            rows[name] = (torch.stack([kl(targets[k], logp) for k in range(K)]).mean(0), kl(mean, logp))

    def stat(per_token: torch.Tensor) -> tuple[float, float]:
        w = per_token.view(B, S).mean(1)  # windows are the independent units
        return float(w.mean()), float(w.std() / math.sqrt(B))

    result: dict = {"teacher": a.teacher, "student_steps": N, "windows": B, "seq_len": S, "draws": K,
                    "floor": stat(floor), "students": {}}
    ref = a.student[0]
    print(f"N={N}, {B} windows of {S}, K={K}: floor {result['floor'][0]:.4f} ± {result['floor'][1]:.4f} nats/token")
    for name, (total, learnable) in rows.items():
        entry = {"kl": stat(total), "learnable": stat(learnable)}
        line = (f"  {name}: KL {entry['kl'][0]:.4f} ± {entry['kl'][1]:.4f}, learnable "
                f"{entry['learnable'][0]:.4f} ± {entry['learnable'][1]:.4f}")
        if name != ref:
            entry["learnable_minus_first"] = stat(learnable - rows[ref][1])
            d, se = entry["learnable_minus_first"]
            line += f", minus {ref}'s: {d:+.4f} ± {se:.4f}"
        result["students"][name] = entry
        print(line)
    fsio.write_text(a.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
