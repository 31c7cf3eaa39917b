"""The held-out likelihoods of `dgemma eval`, with their Monte Carlo error (docs/evaluation.md sections 1 and 2).

What is scored is the same for every model: windows of seq_len + 1 held-out tokens, token 0 of each the context, and
tokens 1..seq_len scored (`scored_windows`, fingerprinted by `scored_digest`). The AR baseline predicts them from
token 0 on; the diffusion model bounds them canvas by canvas given token 0 committed as a clean prefix. The unigram
reference (`unigram_reference`, the training split's add-one unigram: `dgemma.data.shards.unigram_log_probs`) is
scored on the same tokens.

The diffusion figures are Monte Carlo estimates (t, x_t and whole trajectories are drawn), so each has two errors:

    se      between windows: the standard error of the mean over held-out windows (what more windows shrink)
    mc_se   Monte Carlo: from `replicates` independent passes over the same windows (what more t-samples or
            replicates shrink); None with one replicate

Every pass draws from its own seed (`mc_seed`): a hash of the model's weights, the estimator, T and the replicate, so
two models, two T and two replicates never share draws, and a comparison between them carries both models' Monte
Carlo error instead of hiding it behind common random numbers.

    NELBO          the bound at T (stratified t per canvas) or in continuous time (`heldout_nelbo`)
    IW bound       the K-trajectory importance-weighted bound at T on a few windows (`heldout_iw`, K = 1, 4, 16):
                   K = 1 has the NELBO's mean; how far it falls by K = 16 sizes the bound's gap to the NLL
    reference      an exact model (`unigram_posterior`: i.i.d. tokens from the training unigram, whose posterior
                   p(x0 | x_t) is closed-form) scored by the same code: its NELBO equals its exact NLL at every T in
                   expectation, so its figures show how large the Monte Carlo error of the others is
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dgemma.diffusion.likelihood import (
    LEVEL_BINS,
    Posterior,
    clean_context_posterior,
    iw_bound,
    posterior_of,
    prior_kl,
    window_log_weights,
    window_nelbo,
    window_nelbo_continuous,
)
from dgemma.diffusion.noise import alpha
from dgemma.io.console import Progress
from dgemma.train.heldout import Estimate, EvalError, ar_token_nll, estimate, x0_ce_per_canvas

SCORED_RULE = "tokens 1..seq_len of held-out windows of seq_len + 1 tokens; token 0 is every model's context"
IW_KS = (1, 4, 16)  # trajectories per importance-weighted bound

# context (B, P) -> the posterior of windows that follow it
PosteriorFor = Callable[[Tensor], Posterior]


def scored_windows(dataset: Any, seq_len: int, batch_size: int, max_windows: int | None
                   ) -> tuple[Iterator[Tensor], int]:
    """Held-out windows of seq_len + 1 tokens in order (B, seq_len + 1), at most `max_windows`, and how many."""
    available = len(dataset.windows(seq_len, 1))
    if available == 0:
        raise EvalError(f"{dataset.dir}: the {dataset.split} split has {dataset.num_tokens:,} tokens, fewer than one "
                        f"window of {seq_len + 1:,}; an empty validation set cannot be evaluated (prepare the data "
                        "with --val-fraction > 0, or pass a smaller --seq-len)")
    n = available if max_windows is None else min(available, max_windows)

    def stream() -> Iterator[Tensor]:
        done = 0
        for x in dataset.heldout_batches(batch_size, seq_len, shift=1):
            if done >= n:
                return
            yield x[: n - done]
            done += x.shape[0]

    return stream(), n


def scored_digest(dataset: Any, seq_len: int, max_windows: int | None) -> dict[str, Any]:
    """What every likelihood of a report scores: the rule, the count and a SHA-256 of the scored tokens (int64)."""
    stream, n = scored_windows(dataset, seq_len, 64, max_windows)
    h = hashlib.sha256()
    for x in stream:
        h.update(x[:, 1:].to(torch.int64).contiguous().numpy().tobytes())
    return {"rule": SCORED_RULE, "windows": n, "tokens": n * seq_len, "sha256": h.hexdigest()}


def mc_seed(model_sha: str, estimator: str, num_steps: int | None, replicate: int, seed: int = 0) -> int:
    """The seed of one Monte Carlo pass: distinct for every (model weights, estimator, T, replicate, --seed)."""
    key = f"{model_sha}|{estimator}|{num_steps}|{replicate}|{seed}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def model_sha(model: Any) -> str:
    """SHA-256 of a model's weights (every parameter and buffer, by name, as stored): what seeds its Monte Carlo
    draws, so two checkpoints never share them and one checkpoint always draws the same."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        try:
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # a quantized tensor subclass
            h.update(repr((tuple(t.shape), str(t.dtype), type(t).__name__, float(t.dequantize().double().sum())
                           if hasattr(t, "dequantize") else None)).encode())
    return h.hexdigest()


def mc_error(per_replicate: np.ndarray) -> float | None:
    """The Monte Carlo SE of the mean over windows of per-window figures averaged over replicates, from `per_replicate`
    (R, W) per-token figures on the same windows: sqrt(sum_w var_r / R) / W. None for R = 1."""
    r, w = per_replicate.shape
    if r < 2:
        return None
    return float(math.sqrt(per_replicate.var(axis=0, ddof=1).sum() / r) / w)


def _text_bytes(tokenizer: Any, rows: Tensor) -> int:
    if tokenizer is None:
        return 0
    return sum(len(tokenizer.decode(r, skip_special_tokens=True).encode("utf-8")) for r in rows.tolist())


def _by_t(sums: Tensor, counts: Tensor) -> list[float]:
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan)).tolist()


def _replicated(per_replicate_nats: list[list[float]], toks: list[int], nbytes: int, seeds: list[int]
                ) -> dict[str, Any]:
    nats = np.asarray(per_replicate_nats, dtype=np.float64)  # (R, W)
    per_token = nats / np.asarray(toks, dtype=np.float64)
    est = estimate(nats.mean(0).tolist(), toks, nbytes or None)
    return {"estimate": est, "mc_se": mc_error(per_token), "replicates": len(seeds), "seeds": seeds,
            "replicate_means": [float(n.sum() / sum(toks)) for n in nats],
            "per_window": per_token.mean(0).tolist()}


@torch.no_grad()
def heldout_x0_ce(model: Any, dataset: Any, *, seq_len: int, num_steps: int, time: str = "discrete",
                  objective: str = "clean-context", batch_size: int = 8, max_windows: int | None = None,
                  seed: int = 0, tokenizer: Any = None, progress: bool = True) -> dict[str, Any]:
    """Held-out x0 cross-entropy at one level per canvas (seed 003 section 7): t / T with t ~ U{1..T}, or s ~ U(0, 1]
    for a continuous-time run (`time`), the training objective without self-conditioning, drawing levels and x_t
    exactly as `training_loss` does from the same generator. By level: T bins (LEVEL_BINS in continuous time)."""
    posterior_of(objective)  # a diffusion objective, before anything runs
    L = model.config.canvas_length
    g = torch.Generator(device=model.device).manual_seed(seed)
    stream, n = scored_windows(dataset, seq_len, batch_size, max_windows)
    nats, toks, nbytes = [], [], 0
    bins = LEVEL_BINS if time == "continuous" else num_steps
    t_sums = torch.zeros(bins, dtype=torch.float64)
    t_counts = torch.zeros(bins, dtype=torch.float64)
    with Progress("x0 CE", n, "windows", enabled=progress) as bar:
        for x in stream:
            x0 = x[:, 1:].to(model.device)  # the scored tokens, without their context (x0 CE has none)
            B, S = x0.shape
            ce, level = x0_ce_per_canvas(model, x0, objective=objective, num_steps=num_steps, time=time, generator=g)
            per_canvas = ce.double().cpu()
            nats += per_canvas.sum(-1).tolist()
            toks += [S] * B
            nbytes += _text_bytes(tokenizer, x0)
            which = (level.double().cpu() * bins).round_() if time != "continuous" else \
                (level.double().cpu() * bins).ceil_()
            which = which.long().clamp_(1, bins).reshape(-1) - 1
            t_sums.index_add_(0, which, per_canvas.reshape(-1))
            t_counts.index_add_(0, which, torch.full((which.numel(),), float(L), dtype=torch.float64))
            bar.update(B)
    drawn = "one level per canvas, uniform on (0, 1]" if time == "continuous" else \
        "one t per canvas, uniform on {1..T}"
    return {"estimate": estimate(nats, toks, nbytes or None), "num_steps": num_steps, "objective": objective,
            "time": time, "t_sampling": drawn, "seq_len": seq_len,
            "ce_by_t": _by_t(t_sums, t_counts), "tokens_by_t": t_counts.tolist()}


@torch.no_grad()
def heldout_nelbo(posterior_for: PosteriorFor, dataset: Any, *, canvas_length: int, vocab_size: int, seq_len: int,
                  num_steps: int | None, num_t_samples: int, replicates: int, model_sha: str, seed: int = 0,
                  batch_size: int = 8, max_windows: int | None = None, tokenizer: Any = None,
                  device: torch.device | str = "cpu", progress: bool = True) -> dict[str, Any]:
    """The NELBO (nats/token) of the scored tokens, each window's tokens 1..seq_len bounded canvas by canvas given
    token 0 and the clean canvases before: at T = `num_steps` with `num_t_samples` stratified t per canvas, or
    (`num_steps` None) in continuous time with `num_t_samples` stratified levels; `replicates` independent passes
    (`mc_seed`), averaged per window, their spread the Monte Carlo SE."""
    if seq_len % canvas_length:
        raise EvalError(f"--seq-len {seq_len} is not a whole number of canvases of {canvas_length}")
    bins = LEVEL_BINS if num_steps is None else num_steps
    t_sums = torch.zeros(bins, dtype=torch.float64)
    t_counts = torch.zeros(bins, dtype=torch.float64)
    estimator = "nelbo" if num_steps is not None else "nelbo-continuous"
    seeds = [mc_seed(model_sha, estimator, num_steps, r, seed) for r in range(replicates)]
    per_replicate, toks, nbytes = [], [], 0
    _, n = scored_windows(dataset, seq_len, batch_size, max_windows)  # the count (and an error for too few tokens)
    desc = f"NELBO T={num_steps}" if num_steps is not None else "NELBO (continuous)"
    with Progress(desc, n * replicates, "windows", enabled=progress) as bar:
        for r, s in enumerate(seeds):
            g = torch.Generator(device=device).manual_seed(s)
            nats: list[float] = []
            stream, _ = scored_windows(dataset, seq_len, batch_size, max_windows)
            for x in stream:
                x = x.to(device)
                posterior, x0 = posterior_for(x[:, :1]), x[:, 1:]
                common = dict(canvas_length=canvas_length, vocab_size=vocab_size, num_t_samples=num_t_samples,
                              generator=g)
                terms = (window_nelbo_continuous(posterior, x0, **common) if num_steps is None
                         else window_nelbo(posterior, x0, num_steps=num_steps, **common))
                nats += terms.nelbo.sum(-1).tolist()
                if r == 0:
                    toks += [x0.shape[1]] * x0.shape[0]
                    nbytes += _text_bytes(tokenizer, x0)
                t_sums += terms.t_sums
                t_counts += terms.t_counts
                bar.update(x0.shape[0])
            per_replicate.append(nats)
    return _replicated(per_replicate, toks, nbytes, seeds) | {
        "num_steps": num_steps, "num_t_samples": num_t_samples, "seq_len": seq_len,
        "prior_kl_per_token": prior_kl(num_steps or 1, vocab_size),
        "kl_by_t": _by_t(t_sums, t_counts), "tokens_by_t": t_counts.tolist()}


def model_nelbo(model: Any, dataset: Any, *, seq_len: int, num_steps: int | None, num_t_samples: int = 4,
                replicates: int = 2, seed: int = 0, batch_size: int = 8, max_windows: int | None = None,
                tokenizer: Any = None, progress: bool = True) -> dict[str, Any]:
    """`heldout_nelbo` of a diffusion model: its clean-context posterior, draws seeded by its weights (`model_sha`)."""
    cfg = model.config
    return heldout_nelbo(model_posterior(model), dataset, canvas_length=cfg.canvas_length, vocab_size=cfg.vocab_size,
                         seq_len=seq_len, num_steps=num_steps, num_t_samples=num_t_samples, replicates=replicates,
                         model_sha=model_sha(model), seed=seed, batch_size=batch_size, max_windows=max_windows,
                         tokenizer=tokenizer, device=model.device, progress=progress)


@torch.no_grad()
def heldout_iw(posterior_for: PosteriorFor, dataset: Any, *, canvas_length: int, vocab_size: int, seq_len: int,
               num_steps: int, windows: int, model_sha: str, ks: Sequence[int] = IW_KS, seed: int = 0,
               batch_size: int = 8, device: torch.device | str = "cpu", progress: bool = True) -> dict[str, Any]:
    """The K-trajectory importance-weighted bounds at T on the first `windows` scored windows, for each K of `ks`
    from the same max(ks) trajectories per canvas (`iw_bound`), and how far the bound falls from the smallest K to
    the largest (paired over windows: the same trajectories): a lower estimate of the NELBO's gap to the NLL."""
    k_max = max(ks)
    g = torch.Generator(device=device).manual_seed(mc_seed(model_sha, "iw", num_steps, 0, seed))
    stream, n = scored_windows(dataset, seq_len, batch_size, windows)
    per_k: dict[int, list[float]] = {k: [] for k in ks}
    toks: list[int] = []
    with Progress(f"IW bound T={num_steps} K<={k_max}", n, "windows", enabled=progress) as bar:
        for x in stream:
            x = x.to(device)
            lw = window_log_weights(posterior_for(x[:, :1]), x[:, 1:], canvas_length=canvas_length,
                                    vocab_size=vocab_size, num_steps=num_steps, num_samples=k_max, generator=g)
            for k in ks:
                per_k[k] += iw_bound(lw, k).sum(-1).tolist()
            toks += [seq_len] * x.shape[0]
            bar.update(x.shape[0])
    lo, hi = min(ks), max(ks)
    gap = (np.asarray(per_k[lo]) - np.asarray(per_k[hi])) / seq_len
    return {"num_steps": num_steps, "trajectories": k_max, "windows": n,
            "by_k": {str(k): estimate(v, toks).to_dict() for k, v in per_k.items()},
            "gap": {"from_k": lo, "to_k": hi, "mean": float(gap.mean()),
                    "se": float(gap.std(ddof=1) / math.sqrt(len(gap))) if len(gap) > 1 else None}}


@torch.no_grad()
def heldout_ar_ce(model: Any, dataset: Any, *, seq_len: int, batch_size: int = 8, max_windows: int | None = None,
                  tokenizer: Any = None, progress: bool = True) -> dict[str, Any]:
    """Next-token cross-entropy of an autoregressive run (objective 'ar') on the scored tokens: the causal forward
    it was trained with over each window of seq_len + 1, the loss on tokens 1..seq_len. Exact: no Monte Carlo."""
    stream, n = scored_windows(dataset, seq_len, batch_size, max_windows)
    nats, toks, nbytes = [], [], 0
    with Progress("AR CE", n, "windows", enabled=progress) as bar:
        for x in stream:
            x = x.to(model.device)
            ce = ar_token_nll(model, x)  # (B, seq_len)
            nats += ce.double().sum(-1).tolist()
            toks += [ce.shape[1]] * ce.shape[0]
            nbytes += _text_bytes(tokenizer, x[:, 1:])
            bar.update(x.shape[0])
    return {"estimate": estimate(nats, toks, nbytes or None), "seq_len": seq_len,
            "per_window": [a / b for a, b in zip(nats, toks, strict=True)]}


# --- the unigram model: a reference line and an exact model ----------------------------------------------------------

def unigram_reference(log_p: np.ndarray, dataset: Any, *, seq_len: int, max_windows: int | None) -> Estimate:
    """The unigram's cross-entropy on the scored tokens (what a model ignoring every context scores there); `log_p`:
    `dgemma.data.shards.unigram_log_probs`."""
    stream, _ = scored_windows(dataset, seq_len, 64, max_windows)
    nats = []
    for x in stream:
        nats += (-log_p[x[:, 1:].numpy()]).sum(-1).tolist()
    return estimate(nats, [seq_len] * len(nats))


def unigram_posterior(log_p: Tensor, canvas_length: int) -> Posterior:
    """The exact posterior p(x0 | x_t) of i.i.d. tokens drawn from exp(log_p) (V,) under the uniform-state forward
    process: log p(j) + log q(x_t | x0 = j), per position. A model that knows the data is this unigram: its NELBO is
    its exact NLL, -sum log p(x0), in expectation at every T and in continuous time, and each whole trajectory's
    importance weight is exactly p(x0)."""
    V = log_p.shape[0]

    def posterior(x0: Tensor, xt: Tensor, level: Tensor) -> Tensor:
        a = alpha(level.double().repeat_interleave(canvas_length, dim=1), torch.float64)[..., None]  # (B, S, 1)
        hit = torch.nn.functional.one_hot(xt, V).bool()
        return log_p.to(xt.device, torch.float64) + torch.log(a * hit + (1 - a) / V)

    return posterior


def model_posterior(model: Any) -> PosteriorFor:
    """The diffusion model's posterior given each window's context token(s): the clean-context forward."""
    return lambda context: clean_context_posterior(model, context)


__all__ = ["IW_KS", "SCORED_RULE", "heldout_ar_ce", "heldout_iw", "heldout_nelbo", "heldout_x0_ce", "mc_error",
           "mc_seed", "model_nelbo", "model_posterior", "model_sha", "scored_digest", "scored_windows",
           "unigram_posterior", "unigram_reference"]
