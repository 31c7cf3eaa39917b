"""Fast paths. Each computes what a readable twin computes, and tests/test_kernels.py pins the two together.

    fast path                         readable twin
    attention, commit_masks,          model.reference_attention with the boolean masks of KVCache.mask
      denoise_masks
    moe_experts                       model.Experts.forward (a torch.where per expert)
    DenoiseStep                       DiffusionGemma.denoise up to the final hidden state; `static=True` gives it
                                      fixed shapes for torch.compile(fullgraph=True) and CUDA graphs
    tempered_stats, draw_cdf,         sampling.token_entropy, torch.argmax, sampling.draw_tokens (multinomial) and
      draw_race, head_and_sample      DiffusionGemma.soft_embedding, fused and row-chunked
    denoise_canvas                    generate.denoise_canvas for the entropy-bound sampler, without host syncs

Selected with `DiffusionGemma(impl="fast")` (attention, masks, experts) or `generate(..., impl="fast")` (all of it).
The fast path agrees with the readable one to rounding (1e-4 on fp32 logits), not bit for bit, and its random draws
differ: inverse-CDF or exponential-race sampling instead of torch.multinomial, which is slow on CPU and synchronises
on CUDA. Its accept, renoise and stop decisions are the reference's, computed on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma import sampling
from dgemma.config import FULL, SLIDING, GenerationConfig
from dgemma.kv_cache import KVCache

if TYPE_CHECKING:  # model.py imports this module; these are for annotations only
    from dgemma.generate import StagedCanvas, StepInfo
    from dgemma.model import DiffusionGemma

Mask = Tensor | Literal["causal"] | None  # boolean (True = may attend), additive float, "causal", or None (all)
Draw = Literal["cdf", "race"]


# --- attention ---------------------------------------------------------------------------------------------------

def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """Twin of `model.reference_attention`: q (B, H, S, Dh), k, v (B, K, T, Dh) -> (B, S, H, Dh).

    `mask`: None (every key), "causal" (query i sees keys <= i: only valid when the queries start at key 0), a
    boolean mask (B or 1, 1, S or 1, T) with no fully masked row, or an additive float mask where rows may be fully
    masked (padding queries): SDPA gives such a row under a boolean mask zeros or NaN depending on the backend,
    the reference a uniform average, and the additive form reproduces the latter."""
    gqa = q.shape[1] != k.shape[1]  # SDPA repeats kv heads itself; no (B, H, T, Dh) copy
    if isinstance(mask, str):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=gqa)
    else:  # Gemma: scale 1.0 (q_norm/k_norm set the temperature)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def _causal_rule(start: int, num_new: int, lo: int, window: int | None, device: torch.device) -> Tensor:
    """(1, 1, S, T) boolean: query p in [start, start + S) sees key k in [lo, start + S) iff k <= p (and p - k <
    window); the same rule as KVCache.mask, without the batch dimension when nothing is padding."""
    q = torch.arange(start, start + num_new, device=device)[:, None]
    k = torch.arange(lo, start + num_new, device=device)[None, :]
    rule = k <= q
    if window is not None:
        rule = rule & (q - k < window)
    return rule[None, None]


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def commit_masks(cache: KVCache, start: int, num_new: int, window: int, dtype: torch.dtype,
                 new_keep: Tensor) -> dict[str, Mask]:
    """Fast twin of the encoder masks in `DiffusionGemma.commit` (KVCache.mask with causal=True).

    No padding ever committed: "causal" when the queries start at key 0 and no window cuts in (a prefill), else a
    (1, 1, S, T) boolean rule; nothing is read back from the device. Padding in the cache: KVCache.mask's boolean
    masks, made additive only when this span itself holds padding, since a padded query is the only one that can
    see no key at all (a real token always sees itself)."""
    if not cache.has_padding:
        device = cache.key_padding.device
        full: Mask = "causal" if start == 0 else _causal_rule(start, num_new, 0, None, device)
        lo = cache.visible_start(start, window - 1)
        sliding: Mask = ("causal" if start == 0 and num_new <= window
                         else _causal_rule(start, num_new, lo, window, device))
        return {FULL: full, SLIDING: sliding}
    masks = {FULL: cache.mask(start, num_new, prefix=None, causal=True, new_keep=new_keep),
             SLIDING: cache.mask(start, num_new, prefix=window - 1, causal=True, window=window, new_keep=new_keep)}
    if bool(new_keep.all()):
        return dict(masks)
    return {kind: _additive(m, dtype) for kind, m in masks.items()}


def denoise_masks(cache: KVCache, end: int, num_new: int, prefixes: dict[str, int | None]) -> dict[str, Mask]:
    """Fast twin of the decoder masks in `DiffusionGemma.denoise` (KVCache.mask with causal=False): None unless the
    cache ever held padding, then (B, 1, 1, T) boolean over [visible prefix ; canvas], broadcast over the queries.
    A canvas query always sees the canvas, so no row is empty."""
    if not cache.has_padding:
        return dict.fromkeys(prefixes)
    canvas = cache.key_padding.new_ones(cache.batch_size, num_new)
    return {kind: torch.cat([cache.key_padding[:, cache.visible_start(end, p):end], canvas], 1)[:, None, None]
            for kind, p in prefixes.items()}


# --- routed experts -------------------------------------------------------------------------------------------------

def _grouped_mm_available(x: Tensor, *weights: Tensor) -> bool:
    """Whether one grouped matmul can run every expert: `torch.nn.functional.grouped_mm` (torch >= 2.10, CPU and CUDA)
    or `torch._grouped_mm`, bf16 on CUDA (compute capability >= 8.0), inference only (its CPU backward is
    incomplete), and 16-byte aligned rows and pointers, which the kernel requires."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))):
        return False
    if x.device.type == "cuda":
        capability = torch.cuda.get_device_capability(x.device)
        if x.dtype != torch.bfloat16 or capability < (8, 0):
            return False
        version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if version < (2, 9) and capability[0] != 9:
            return False  # before torch 2.9, torch._grouped_mm runs on Hopper only
    elif x.device.type != "cpu" or not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # inductor lowers grouped_mm for bf16 only
        return False
    size = x.element_size()
    dims = [x.shape[-1]] + [w.shape[-1] for w in weights] + [w.shape[-2] for w in weights]
    if torch.compiler.is_compiling():  # no pointers to check while tracing; inductor allocates aligned buffers
        return all(d * size % 16 == 0 for d in dims)
    return all(d * size % 16 == 0 for d in dims) and all(t.data_ptr() % 16 == 0 for t in (x, *weights))


def _grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w.transpose(1, 2), offs=offsets)  # rows [offsets[e-1], offsets[e]) @ w[e].T


def _expert_loop(xs: Tensor, counts: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """One gated-GELU matmul pair per expert on its contiguous block of rows xs (N*k, D); counts (E,)."""
    y = torch.empty_like(xs)
    lo = 0
    for e, n in enumerate(counts.tolist()):  # the one host read per layer (free on CPU)
        if n:
            gate, up = F.linear(xs[lo:lo + n], gate_up_proj[e]).chunk(2, dim=-1)
            y[lo:lo + n] = F.linear(F.gelu(gate, approximate="tanh") * up, down_proj[e])
        lo += n
    return y


_EXPERT_LOOP_OP: list[Callable[..., Tensor]] = []


def register_expert_loop_op() -> None:
    """Register `_expert_loop` as the custom op `dgemma::expert_loop` (once; at the compile call site, not at
    import), so torch.compile(fullgraph=True) sees the loop as one call with a known output shape (inference)."""
    if not _EXPERT_LOOP_OP:
        op = torch.library.custom_op("dgemma::expert_loop", mutates_args=())(_expert_loop)
        op.register_fake(lambda xs, counts, gate_up_proj, down_proj: torch.empty_like(xs))
        _EXPERT_LOOP_OP.append(op)


def moe_experts(x: Tensor, weights: Tensor, experts: Tensor, gate_up_proj: Tensor, down_proj: Tensor, *,
                backend: Literal["auto", "loop", "grouped"] = "auto") -> Tensor:
    """Twin of `model.Experts.forward`: x (N, D), weights, experts (N, k) -> (N, D).

    Sorts the N*k token slots by expert once (a stable argsort plus a bincount) so each expert's tokens are one
    contiguous block, then runs one matmul per expert on its block ("loop"), or all of them as one grouped matmul
    ("grouped", no host sync, capturable by CUDA graphs). The weighted expert outputs are summed over the k slots in
    fp32 (the reference rounds each slot to the model dtype before adding); "auto" picks grouped where it runs."""
    N, k = experts.shape
    E = gate_up_proj.shape[0]
    flat = experts.reshape(-1)  # slot s = token * k + j
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept inside a group
    counts = flat.new_zeros(E).scatter_add_(0, flat, torch.ones_like(flat))  # a bincount of static length E
    xs = x[order // k]  # (N*k, D) in expert order
    if backend == "grouped" or (backend == "auto" and _grouped_mm_available(x, gate_up_proj, down_proj)):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = _grouped_mm(xs, gate_up_proj, offsets).chunk(2, dim=-1)
        y = _grouped_mm((F.gelu(gate, approximate="tanh") * up).contiguous(), down_proj, offsets)
    elif torch.compiler.is_compiling():  # the loop's sizes are data: the tracer sees it as one opaque op
        y = _EXPERT_LOOP_OP[0](xs, counts, gate_up_proj, down_proj)  # registered by compiled_static_hidden
    else:
        y = _expert_loop(xs, counts, gate_up_proj, down_proj)
    weighted = y.float() * weights.reshape(-1)[order, None]  # (N*k, D) fp32
    slots = torch.empty_like(weighted).index_copy_(0, order, weighted)  # back to slot order: a permutation, no race
    return slots.view(N, k, -1).sum(1).to(x.dtype)


# --- the denoise step ------------------------------------------------------------------------------------------------

_COMPILED: dict[str, Callable[..., Tensor]] = {}  # compiled `_static_hidden` per mode, made on first use (not import)


class DenoiseStep:
    """Twin of `DiffusionGemma.denoise` up to the final hidden state (B, L, D) that the head reads. The
    self-conditioning signal comes in as the soft embedding (B, L, D), which the fast sampler computes from the
    probabilities it already holds instead of a second softmax over (B, L, V) logits.

    static=False reads the visible slice of the cache, as `denoise` does (shapes follow the context length).
    static=True keeps every shape fixed for the life of the cache, so the step can be captured whole: full layers
    read all preallocated slots and mask those at or past the committed length, which enters as a device scalar (no
    recompilation per canvas); sliding layers gather a fixed window of `sliding_prefix` slots. compile=True wraps the
    static step in torch.compile(fullgraph=True), with CUDA graphs ("reduce-overhead") on CUDA; a string names the
    torch.compile backend instead of inductor."""

    def __init__(self, model: DiffusionGemma, cache: KVCache, *, sliding_prefix: int | None = None,
                 static: bool = False, compile: bool | str = False):
        self.model, self.cache = model, cache
        self.prefixes: dict[str, int | None] = {
            FULL: None, SLIDING: model.config.sliding_window - 1 if sliding_prefix is None else sliding_prefix}
        self.static = static or compile
        self._fn: Callable[..., Tensor] = _static_hidden if self.static else _dynamic_hidden
        if compile:
            self._fn = compiled_static_hidden(model.device, cache, compile if isinstance(compile, str) else "inductor")
        self._end = torch.zeros((), dtype=torch.long, device=model.device)

    @torch.no_grad()
    def __call__(self, canvas: Tensor, soft: Tensor | None = None, t: Tensor | float | None = None) -> Tensor:
        self.cache.check_batch(canvas, "canvas")
        if t is not None:
            t = torch.as_tensor(t, dtype=torch.float32, device=canvas.device).reshape(-1, 1)
        if not self.static:
            return self._fn(self.model, self.cache, canvas, soft, t, self.prefixes)
        self._end.fill_(self.cache.length)  # a host-to-device write, never a read
        c = self.cache
        return self._fn(self.model, c.keys, c.values, c.key_padding, canvas, soft, t, self._end,
                        self.prefixes[SLIDING])


def compiled_static_hidden(device: torch.device, cache: KVCache | None = None, backend: str = "inductor"
                           ) -> Callable[..., Tensor]:
    """torch.compile(fullgraph=True) of the static denoise step, made on first use. On CUDA: CUDA graphs, with the
    cache marked as living at a fixed address so that replays read it in place instead of copying it in.
    `backend="aot_eager"` traces the same whole graph without generating code (what the tests use: seconds, not
    minutes)."""
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    if device.type == "cuda" and cache is not None:
        for t in (*cache.keys, *cache.values, cache.key_padding):
            torch._dynamo.mark_static_address(t)
    register_expert_loop_op()
    key = f"{backend}/{mode}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_static_hidden, fullgraph=True, dynamic=False, backend=backend, mode=mode)
    return _COMPILED[key]


def _dynamic_hidden(model: DiffusionGemma, cache: KVCache, canvas: Tensor, soft: Tensor | None, t: Tensor | None,
                    prefixes: dict[str, int | None]) -> Tensor:
    """`DiffusionGemma._denoise_hidden` + `final_hidden` with the fast kernels and a given soft embedding."""
    x = model.self_conditioning(model.embed(canvas, t), soft)
    end, L = cache.length, canvas.shape[1]
    masks = denoise_masks(cache, end, L, prefixes)
    cos_sin = model._rope(torch.arange(end, end + L, device=x.device)[None], x.dtype)
    for i, block in enumerate(model.layers):
        kind = model.config.layer_types[i]
        past_k, past_v = cache.visible(i, end, prefixes[kind])
        x, _, _ = block(x, *cos_sin[kind], past_k, past_v, masks[kind], block.layer_scalar, "fast")
    return model.final_hidden(x, soft)


def _static_hidden(model: DiffusionGemma, keys: list[Tensor], values: list[Tensor], key_padding: Tensor,
                   canvas: Tensor, soft: Tensor | None, t: Tensor | None, end: Tensor, prefix: int) -> Tensor:
    """The same computation with shapes that do not depend on `end` (a 0-d device tensor): no host reads, no
    data-dependent shapes, so torch.compile(fullgraph=True) and CUDA graphs can take it whole."""
    B, L = canvas.shape
    device = canvas.device
    x = model.self_conditioning(model.embed(canvas, t), soft)
    cos_sin = model._rope((end + torch.arange(L, device=device))[None], x.dtype)
    T = key_padding.shape[1]
    canvas_keep = key_padding.new_ones(B, L)
    full_keep = torch.cat([key_padding & (torch.arange(T, device=device) < end), canvas_keep], 1)[:, None, None]
    window = end - prefix + torch.arange(prefix, device=device)  # the sliding layers' slots, some maybe < 0
    slots = window.clamp(0, T - 1)
    sliding_keep = torch.cat([key_padding[:, slots] & (window >= 0), canvas_keep], 1)[:, None, None]
    for i, block in enumerate(model.layers):
        kind = model.config.layer_types[i]
        if kind == SLIDING:
            past_k, past_v, mask = keys[i].index_select(2, slots), values[i].index_select(2, slots), sliding_keep
        else:
            past_k, past_v, mask = keys[i], values[i], full_keep
        x, _, _ = block(x, *cos_sin[kind], past_k, past_v, mask, block.layer_scalar, "fast")
    return model.final_hidden(x, soft)


# --- sampling --------------------------------------------------------------------------------------------------------

CPU_CHUNK_BYTES = 256 * 2**20  # rows of (rows, V) fp32 logits per chunk; the head matmul wants many rows at once
CUDA_CHUNK_BYTES = 2**30  # on both, chunks only bound memory (a batch of 262k-vocabulary canvases is GBs)
SHIFTED_LOGIT_FLOOR = -70.0  # z - max(z) is clamped here: exp(-70) ~ 4e-31 keeps every probability a normal float
# (subnormals are ~100x slower on x86); the mass this gives the unlikely tokens is below 1e-24 in all


@torch.no_grad()
def logits_into(model: DiffusionGemma, rows: Tensor, out: Tensor | None = None) -> Tensor:
    """Twin of `DiffusionGemma.logits` for rows (R, D), written into `out` (R, V) fp32 when given (no allocation).
    The softcap is 2c * sigmoid(2x / c) - c, which is c * tanh(x / c) to ~1e-5 and runs ~3x faster on a CPU."""
    weight = model.embed_tokens.weight
    if out is None:
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=rows.device)
    if weight.dtype == torch.float32:
        torch.mm(rows, weight.t(), out=out)
    else:
        out.copy_(F.linear(rows, weight))
    cap = model.config.final_logit_softcapping
    if cap is not None:
        out.mul_(2.0 / cap).sigmoid_().mul_(2.0 * cap).sub_(cap)
    return out


def tempered_stats(z: Tensor, work: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Probabilities, argmax and entropy (nats) of softmax(z) for tempered logits z (R, V) fp32: fast twin of
    softmax + torch.argmax + sampling.token_entropy. H = log s - sum(e * d) / s with d = z - max, e = exp(d), which
    has no cancellation when H is tiny (the stop rule compares a mean entropy with 0.005). Overwrites z (it ends up
    holding d); the probabilities go to `work` (R, V) if given, so a step allocates nothing of size V."""
    argmax = z.argmax(-1)
    d = z.sub_(z.amax(-1, keepdim=True)).clamp_(min=SHIFTED_LOGIT_FLOOR)
    e = torch.exp(d, out=work) if work is not None else d.exp()
    s = e.sum(-1, keepdim=True)
    ed = torch.matmul(e[:, None, :], d[:, :, None]).view(-1)  # sum(e * d) per row, without an (R, V) temporary
    entropy = s.log().squeeze(-1) - ed / s.squeeze(-1)
    return e.div_(s), argmax, entropy


def draw_cdf(probs: Tensor, uniforms: Tensor, block: int = 1024) -> Tensor:
    """Inverse-CDF sampling, one draw per row: probs (R, V), uniforms (R,) in [0, 1) -> ids (R,), in two levels: the
    running sum over blocks of `block` tokens picks a block, the running sum inside it picks the token. The running
    sums are fp64 (a single fp32 cumsum over 262k tokens would blur the tail), block masses fp32 sums of at most
    `block` terms, and a zero-probability token is never drawn. One uniform per row (no (R, V) noise), about one read
    of `probs`, no host sync."""
    R, V = probs.shape
    whole = V - V % block
    masses = [probs[:, :whole].view(R, -1, block).sum(-1)] if whole else []
    if whole < V:
        masses.append(probs[:, whole:].sum(-1, keepdim=True))
    cum = torch.cat(masses, 1).to(torch.float64).cumsum(-1)  # (R, blocks)
    target = uniforms.to(torch.float64)[:, None] * cum[:, -1:]
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # (R, 1)
    rest = target - torch.where(b > 0, cum.gather(1, (b - 1).clamp_(min=0)), 0.0)
    ids = b * block + torch.arange(block, device=probs.device)  # (R, block)
    inner = torch.where(ids < V, probs.gather(1, ids.clamp(max=V - 1)), 0.0).to(torch.float64).cumsum(-1)
    rest = torch.minimum(rest, inner[:, -1:] * (1 - 2**-40))  # rounding never steps past the block's last token
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=block - 1)
    return (b * block + j).squeeze(-1).clamp_(max=V - 1)


def draw_race(probs: Tensor, exponentials: Tensor) -> Tensor:
    """Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) is distributed as p. (R, V) -> (R,)."""
    return (probs / exponentials).argmax(-1)


@dataclass
class StepDraws:
    draw: Tensor  # (B, L) one sample per position from the tempered distribution
    argmax: Tensor  # (B, L)
    entropy: Tensor  # (B, L) fp32 nats
    soft: Tensor | None  # (B, L, D) the next step's self-conditioning input, in the embedding dtype


class Workspace:
    """Two (rows, V) fp32 buffers reused by every step of a canvas: a fresh tensor of tens of MB costs a CPU more
    in page faults than the arithmetic done on it."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device):
        self.logits = torch.empty(rows, vocab_size, device=device)
        self.probs = torch.empty(rows, vocab_size, device=device)


@torch.no_grad()
def head_and_sample(final: Tensor, head: Callable[[Tensor, Tensor | None], Tensor], temperature: Tensor, *,
                    generator: torch.Generator | None = None, draw: Draw = "cdf", embed: Tensor | None = None,
                    embed_scale: float = 1.0, chunk_rows: int | None = None,
                    workspace: Workspace | None = None) -> StepDraws:
    """Head, temperature, sampling statistics and the next self-conditioning input, a row chunk at a time.

    final (B, L, D) -> per chunk: fp32 logits = head(rows, out) (written into `out`, a workspace buffer, when that
    is not None), z = logits / temperature (in place), probabilities, argmax,
    entropy, one draw, and soft = softmax(z in the embedding dtype) @ embed * embed_scale (the twin of
    `DiffusionGemma.soft_embedding` on the tempered logits that the reference feeds back). Neither (B, L, V) logits
    nor probabilities exist whole unless they fit in one chunk of `chunk_rows`."""
    B, L, D = final.shape
    R, device = B * L, final.device
    chunk = min(R, chunk_rows or R)
    rows = final.reshape(R, D)
    out_draw = torch.empty(R, dtype=torch.long, device=device)
    out_argmax = torch.empty(R, dtype=torch.long, device=device)
    out_entropy = torch.empty(R, dtype=torch.float32, device=device)
    soft = None if embed is None else torch.empty(R, embed.shape[1], dtype=embed.dtype, device=device)
    scale = torch.tensor(embed_scale).to(embed.dtype) if embed is not None else None  # rounded as in embed()
    # All rows' uniforms in one call: the chunk size does not change what is drawn.
    uniforms = torch.rand(R, generator=generator, device=device, dtype=torch.float64) if draw == "cdf" else None
    for lo in range(0, R, chunk):
        hi = min(R, lo + chunk)
        use_ws = workspace is not None and workspace.logits.shape[0] >= hi - lo
        z = head(rows[lo:hi], workspace.logits[:hi - lo] if use_ws else None)  # type: ignore[union-attr]
        z.div_(temperature)  # the reference's logits.div_(temp)
        p_sc = None
        if soft is not None and embed.dtype != torch.float32:  # the reference feeds back z in the embedding dtype
            p_sc = torch.softmax(z.to(embed.dtype), -1, dtype=torch.float32)
        probs, out_argmax[lo:hi], out_entropy[lo:hi] = tempered_stats(
            z, workspace.probs[:hi - lo] if use_ws else None)  # type: ignore[union-attr]
        if soft is not None:
            p = probs if p_sc is None else p_sc.to(embed.dtype)
            torch.mm(p, embed, out=soft[lo:hi]).mul_(scale)
        if uniforms is not None:
            out_draw[lo:hi] = draw_cdf(probs, uniforms[lo:hi])
        else:
            out_draw[lo:hi] = draw_race(probs, torch.empty_like(probs).exponential_(generator=generator))
    return StepDraws(out_draw.view(B, L), out_argmax.view(B, L), out_entropy.view(B, L),
                     None if soft is None else soft.view(B, L, -1))


def default_chunk_rows(vocab_size: int, device: torch.device) -> int:
    budget = CUDA_CHUNK_BYTES if device.type == "cuda" else CPU_CHUNK_BYTES
    return max(1, budget // (4 * vocab_size))


@torch.no_grad()
def denoise_canvas(model: DiffusionGemma, cache: KVCache, config: GenerationConfig, *,
                   generator: torch.Generator | None = None, canvas: Tensor | None = None,
                   finished: Tensor | None = None, canvas_index: int = 0,
                   on_step: Callable[[StepInfo], None] | None = None, trace: bool = False,
                   step: Callable[..., Tensor] | None = None,
                   head: Callable[[Tensor, Tensor | None], Tensor] | None = None,
                   draw: Draw | None = None, sync_every: int | None = None, chunk_rows: int | None = None,
                   compile: bool = False) -> StagedCanvas:
    """Twin of `generate.denoise_canvas` for the entropy-bound sampler, with every decision taken on the device.

    Per step: `step` (default `DenoiseStep`) -> final hidden; `head_and_sample` -> draws, argmax, entropy and the
    next soft embedding; then the reference's own rules on device tensors: `sampling.accept_by_entropy`,
    `sampling.renoise`, the stop rule of `generate._stop`, and rows that stopped keep their state (torch.where, not
    a branch on a host value). The host reads `done.all()` once every `sync_every` steps (default: every step on
    CPU, where a read costs nothing; every 4 on CUDA); steps run after the whole batch stopped are discarded, so the
    per-row step counts are the reference's. `draw`: "cdf" (default on CPU) or "race" (default on CUDA)."""
    from dgemma.generate import StagedCanvas, StepInfo, _stop, _StopState  # generate imports this module

    if config.sampler != "entropy-bound":
        raise ValueError(f"the fast sampler implements the entropy-bound sampler, not {config.sampler!r}")
    B, L, V = cache.batch_size, model.config.canvas_length, model.config.vocab_size
    device = model.device
    noise = sampling.uniform_tokens((B, L), V, device, generator)  # drawn even when `canvas` is given
    x = noise if canvas is None else canvas.to(device)
    finished = torch.zeros(B, dtype=torch.bool, device=device) if finished is None else finished
    if step is None:
        sliding_prefix = model.config.sliding_window if config.sliding_prefix == "jax" else None
        step = DenoiseStep(model, cache, sliding_prefix=sliding_prefix, compile=compile)
    head = head or (lambda rows, out: logits_into(model, rows, out))
    draw = draw or ("race" if device.type == "cuda" else "cdf")
    sync_every = sync_every or (1 if device.type == "cpu" else 4)
    chunk_rows = min(B * L, chunk_rows or default_chunk_rows(V, device))
    workspace = Workspace(chunk_rows, V, device)
    N = config.max_denoising_steps
    embed, scale = model.embed_tokens.weight, model.config.hidden_size**0.5
    state = _StopState()
    done = torch.zeros(B, dtype=torch.bool, device=device)
    steps = torch.zeros(B, dtype=torch.long, device=device)
    passes = torch.zeros(B, dtype=torch.long, device=device)
    stopped_at = torch.zeros(B, dtype=torch.long, device=device)  # step at which each row stopped, 0 = never
    argmax, soft = x, None
    entropy = torch.zeros(B, L, device=device)
    mean_entropy = torch.zeros(B, device=device)
    records: list[StepInfo] = []
    for i, n in enumerate(range(N, 0, -1)):  # n = steps remaining
        started = time.perf_counter()
        was_done = done
        active = ~(was_done | finished)
        passes += active
        steps += ~was_done
        final = step(x, soft, n / N if model.config.time_embedding else None)
        temp = sampling.temperature(n, N, config.t_min, config.t_max, device)
        out = head_and_sample(final, head, temp, generator=generator, draw=draw, embed=embed if n > 1 else None,
                              embed_scale=scale, chunk_rows=chunk_rows, workspace=workspace)
        accepted = sampling.accept_by_entropy(out.entropy, config.entropy_bound)
        new_x = sampling.renoise(out.draw, accepted, V, generator)
        keep = was_done[:, None]  # rows that already stopped keep everything (the reference's `if was_done.any()`)
        new_argmax = torch.where(keep, argmax, out.argmax)
        new_x = torch.where(keep, x, new_x)
        entropy = torch.where(keep, entropy, out.entropy)
        if out.soft is not None:
            soft = out.soft if soft is None else torch.where(keep[..., None], soft, out.soft)
        mean_entropy = entropy.mean(-1)
        stopped = _stop(config, state, new_argmax, x, mean_entropy)
        stopped_at = torch.where(stopped & ~was_done, i + 1, stopped_at)
        done = was_done | stopped
        if trace or on_step is not None:
            info = StepInfo(canvas_index, i + 1, N, float(temp), x, new_argmax, accepted, entropy, mean_entropy,
                            done, active, time.perf_counter() - started)
            if trace:
                records.append(info)
            if on_step is not None:
                on_step(info)
        x, argmax = new_x, new_argmax
        if ((i + 1) % sync_every == 0 or n == 1) and bool(done.all()):  # the only host read in the loop
            break
    reasons = ["stable+confident" if s else "max_steps" for s in (stopped_at > 0).tolist()]
    tokens = argmax if config.commit_rule == "argmax" else x
    return StagedCanvas(tokens, argmax, x, steps, passes, reasons, mean_entropy, records)


def fast_generation_supported(config: GenerationConfig) -> bool:
    """Whether `denoise_canvas` implements `config` (the Lite sampler runs the reference loop on fast kernels)."""
    return config.sampler == "entropy-bound" and config.posterior_rule == "tempered" and \
        config.initial_self_conditioning == "zeros"


__all__ = ["DenoiseStep", "Mask", "StepDraws", "attention", "commit_masks", "compiled_static_hidden",
           "default_chunk_rows", "denoise_canvas", "denoise_masks", "draw_cdf", "draw_race", "head_and_sample",
           "moe_experts", "tempered_stats"]
