"""The training loss's last layer, fused: the tied head, the softcap, the posterior's observation boost and the
cross-entropy, with the gradient computed in the forward pass a chunk of rows at a time.

    per chunk of rows h (n, D), targets y (n,):
        z = h W^T                          the head (fp32)
        u = c tanh(z / c)                  Gemma's softcap (dgemma/model/diffusiongemma.py:DiffusionGemma.logits)
        u[y_obs] += boost                  the observation's logit boost (dgemma/diffusion/noise.py:observe), if any
        loss += sum(logsumexp(u) - u[y])
        g = softmax(u) - onehot(y)         d loss / d u
        g *= 1 - tanh(z / c)^2             d loss / d z
        dh = g W,   dW += g^T h            kept for backward, which only scales them by the incoming gradient

Its readable twin is `train.diffusion.x0_cross_entropy`'s chunk loss (the model's own head, `F.cross_entropy`,
autograd, activation checkpointing over chunks), and `tests/train/test_head_loss.py` pins the two together (loss and
both gradients to rounding). What it saves on a CPU: the (n, V) passes of autograd's softcap and log-softmax backward
(tanh_backward, the division, _log_softmax_backward_data) and, for more rows than one chunk, the checkpoint's second
forward through the head (docs/benchmarks.md, "Training step"). The gradient of the hidden states and of the tied
embedding are exact sums over the chunks, computed where the chunk's probabilities are in memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class FusedHeadCrossEntropy(torch.autograd.Function):
    """sum over rows of -log softmax(softcap(h W^T) [+ boost at the observed tokens])[target]; see the module doc."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, targets: Tensor, softcap: float | None, chunk_rows: int,
                observed: Tensor | None, boost: Tensor | None) -> Tensor:
        N = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if h.requires_grad else None
        grad_w = torch.zeros_like(weight) if weight.requires_grad else None
        for lo in range(0, N, chunk_rows):
            rows, y = h[lo:lo + chunk_rows], targets[lo:lo + chunk_rows]
            z = torch.mm(rows, weight.t()).float()
            t = None
            if softcap is not None:
                t = z.div_(softcap).tanh_()  # z is not needed again: t = tanh(z / c) in its place
                u = t * softcap
            else:
                u = z
            if observed is not None:
                u.scatter_add_(1, observed[lo:lo + chunk_rows, None], boost[lo:lo + chunk_rows, None].to(u.dtype))
            top = u.amax(-1, keepdim=True)
            picked = u.gather(1, y[:, None])
            g = u.sub_(top).exp_()  # u - max is only needed through its exponential from here on
            s = g.sum(-1, keepdim=True)
            total += (s.log() + top - picked).sum()  # logsumexp(u) - u_y
            if grad_h is None and grad_w is None:
                continue
            g.div_(s)  # softmax(u)
            g.scatter_add_(1, y[:, None], torch.full_like(picked, -1.0))  # - onehot(y)
            if t is not None:
                g.mul_(t.mul_(t).neg_().add_(1))  # through the softcap: d u / d z = 1 - tanh(z / c)^2
            g = g.to(weight.dtype)
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[lo:lo + chunk_rows])
            if grad_w is not None:
                grad_w.addmm_(g.t(), rows)
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_out, None if grad_w is None else grad_w * grad_out,
                None, None, None, None, None)


def fused_head_loss(h: Tensor, weight: Tensor, targets: Tensor, softcap: float | None, chunk_rows: int | None,
                    observed: Tensor | None = None, boost: Tensor | None = None) -> Tensor:
    """The summed cross-entropy of the tied head on hidden states h (N, D) against `targets` (N,), with
    `observed` (N,) tokens whose logits get `boost` (N,) (the posterior's observation), fused (module doc)."""
    return FusedHeadCrossEntropy.apply(h, weight, targets, softcap, chunk_rows or h.shape[0], observed, boost)
