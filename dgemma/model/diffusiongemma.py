"""DiffusionGemma: a uniform-state block-diffusion LM on a Gemma 4 (MoE) backbone. Its layers are
dgemma/model/layers.py; this module stacks them and runs the passes.

One set of weights runs two ways over a shared KV cache:

    commit(ids, cache)         causal *encoder* pass over clean tokens (a prompt, or a finished canvas);
                               writes their K/V into the cache. The cache is the only thing it produces.
    denoise(canvas, cache)     bidirectional *decoder* pass over a noisy canvas of `canvas_length` tokens that
                               attends to the committed prefix; returns fp32 logits (B, L, V). Never writes.

Both run the one loop over the layers (`run_layers`), as does the training forward (`sequence_hidden`). The model
is a pure module: loading, saving, quantization, expert offload and generation settings are applied from outside
(dgemma/weights/, dgemma/sampling/), never stored on it. The op order mirrors `transformers` 5.23 so that the
reference path is bit-identical to it (dgemma/model/layers.py says how).

Shapes: B batch, S new tokens, T visible keys, L canvas, D hidden, H query heads, K kv heads, Dh head dim,
V vocabulary, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.model import attention
from dgemma.model.adapter_rows import AdapterRows
from dgemma.model.attention import Impl, LayerPast, Past, RowPasts, check_impl
from dgemma.model.config import TIME_FEATURES, ModelConfig
from dgemma.model.kv_cache import KVCache, RowCaches
from dgemma.model.layers import (
    SELF_CONDITIONING,
    Block,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
    time_features,
)

Role = Literal["encoder", "decoder"]  # commit (causal, encoder layer scalars) or denoise (bidirectional, decoder)
PastOf = Callable[[int], LayerPast]  # layer -> what it reads of the cache in this pass (attention.Past, RowPasts)


def check_token_ids(ids: Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Refuse ids outside [0, vocab_size) with a message naming the range found (an embedding lookup would fail
    with a bare index error, or silently on some devices). The one check of what `commit`, `denoise` and the sampler
    loops take, so they refuse a bad input with the same message."""
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be an integer tensor of token ids, got {got}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


# --- the model ----------------------------------------------------------------------------------------------------

class DiffusionGemma(nn.Module):
    """The text model. Parameter names mirror the checkpoint under `model.decoder.` (see
    dgemma/weights/checkpoint.py)."""

    def __init__(self, config: ModelConfig, impl: Impl = "reference"):
        super().__init__()
        self.config = config
        self.impl: Impl = impl
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SELF_CONDITIONING[config.self_conditioning](config)
        # Lite (seed 003): each canvas is told its noise level; clean tokens get t = 0.
        self.time_proj = nn.Linear(TIME_FEATURES, config.hidden_size) if config.time_embedding else None
        # RoPE inverse frequencies per layer type, fp32, computed once (plain tensors, not buffers: `.to(bf16)` must
        # never round them, a pitfall transformers' own `.to` has).
        # On the CPU even when the model is built on the meta device (load_model), then moved where positions live.
        self.inv_freq = {kind: rope_inv_freq(config.layer_rope(i), config.layer_head_dim(i), torch.device("cpu"))
                         for kind, i in config.first_layer_of_each_type().items()}

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """A preallocated cache for `max_length` committed tokens, in the model's dtype and device."""
        return KVCache(self.config, batch_size, max_length, dtype=self.dtype, device=self.device)

    def embed(self, ids: Tensor, t: Tensor | None = None) -> Tensor:
        """Token embeddings (B, S, D); with a time embedding, plus that of the noise level t (B, S) (None: 0)."""
        # Gemma: embeddings scaled by sqrt(D), the scale rounded to the weight dtype first (53.0, not 53.07, in bf16)
        x = self.embed_tokens(ids) * torch.tensor(self.config.hidden_size**0.5).to(self.dtype)
        if self.time_proj is not None:
            t = torch.zeros(ids.shape, device=ids.device) if t is None else t.expand(ids.shape)
            x = x + self.time_proj(time_features(t, TIME_FEATURES).to(x.dtype))
        return x

    def soft_embedding(self, logits: Tensor, mask: Tensor | None = None) -> Tensor:
        """Self-conditioning input from logits (B, L, V): softmax (fp32) @ E * sqrt(D), in the model dtype; `mask`
        (B,) bool zeroes rows."""
        E = self.embed_tokens.weight
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(E.dtype)
        soft = (probs @ E) * torch.tensor(self.config.hidden_size**0.5).to(E.dtype)  # same scale as embed()
        return soft if mask is None else soft * mask.to(soft.dtype)[:, None, None]

    def final_hidden(self, hidden: Tensor, soft: Tensor | None = None) -> Tensor:
        """The final norm (and, for "linear" self-conditioning, its output-side add): what the head reads."""
        return self.self_conditioning.output(self.norm(hidden), soft)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """cos, sin per layer type for integer positions (B or 1, S)."""
        return {kind: rope_cos_sin(inv.to(positions.device), positions, dtype) for kind, inv in self.inv_freq.items()}

    def run_layers(self, x: Tensor, positions: Tensor, role: Role | Tensor, past: PastOf, impl: Impl, *,
                   write: Callable[[int, Tensor, Tensor], None] | None = None, adapters: AdapterRows | None = None
                   ) -> Tensor:
        """The one loop over the layers, which every pass runs: x (B, S, D) at integer `positions` (B or 1, S).
        `role` picks the layer scalars: "encoder" (commit), "decoder" (denoise), or a (1, S, 1) bool tensor, True
        for decoder tokens, when one training sequence holds both roles. `past(i)`: what layer i reads besides the
        pass's own keys: the visible cached keys and values and who attends to whom (`attention.Past`; per row,
        `attention.RowPasts`); `write(i, k, v)`: stores layer i's new keys and values (commit). `adapters`: each
        row's LoRA adapter (None: the base)."""
        cos_sin = self.rope(positions, x.dtype)
        for i, block in enumerate(self.layers):
            if isinstance(role, Tensor):
                scalar = torch.where(role, block.layer_scalar, block.encoder_layer_scalar)
            else:
                scalar = block.encoder_layer_scalar if role == "encoder" else block.layer_scalar
            x, k, v = block(x, *cos_sin[self.config.layer_types[i]], past(i), scalar, impl,
                            adapters.layer(i) if adapters is not None else None)
            if write is not None:
                write(i, k, v)
        return x

    def sequence_hidden(self, tokens: Tensor, positions: Tensor, masks: dict[str, Tensor], *, num_clean: int,
                        soft: Tensor | None = None, t: Tensor | None = None, impl: Impl | None = None,
                        adapters: AdapterRows | None = None) -> Tensor:
        """The training forward: one pass over a whole sequence (B, S) without a cache. Tokens [0, num_clean) run in
        the encoder role (as `commit`: plain embedding, encoder scalars); the rest are canvas tokens in the decoder
        role (self-conditioning on `soft` (B, S - num_clean, D), post-norm, decoder scalars). `masks[layer_type]`
        (B or 1, 1, S, S) bool: who attends to whom (the bounds build them); `t` (B, S): noise levels for a
        time-embedding model; `adapters`: each row's LoRA adapter. Returns the final hidden states (B, S, D)."""
        S = tokens.shape[1]
        x = self.embed(tokens, t)
        if num_clean < S:
            x = torch.cat([x[:, :num_clean], self.self_conditioning(x[:, num_clean:], soft)], dim=1)
        is_canvas = (torch.arange(S, device=x.device) >= num_clean)[None, :, None]  # (1, S, 1)
        kinds = self.config.layer_types
        x = self.norm(self.run_layers(x, positions, is_canvas, lambda i: Past(None, masks[kinds[i]]), self._impl(impl),
                                      adapters=adapters))
        if soft is not None and num_clean < S:
            x = torch.cat([x[:, :num_clean], self.self_conditioning.output(x[:, num_clean:], soft)], dim=1)
        return x

    def _impl(self, impl: Impl | None) -> Impl:
        if impl is None:
            return self.impl
        check_impl(impl)
        return impl

    @torch.no_grad()
    def commit(self, input_ids: Tensor, cache: KVCache | RowCaches, *, adapters: AdapterRows | None = None,
               start: int | None = None, attention_mask: Tensor | None = None, impl: Impl | None = None) -> None:
        """Causal encoder pass over `input_ids` (B, S): writes their K/V to the cache at `start` (default: the end of
        what is committed). Committing at an earlier `start` overwrites that span and discards everything after it.
        `attention_mask` (B, S), 1 = token, 0 = left padding; padded positions are never attended to. `impl` (default:
        the model's): "reference" or "fast" kernels. `cache` may also be `RowCaches`, B one-row caches, as for
        `denoise`: each row appends at its own length, as it would alone. `adapters`: each row's LoRA
        (dgemma/weights/adapters.py)."""
        cache.check_batch(input_ids, "input_ids")
        if isinstance(cache, KVCache):
            self._encode(input_ids, cache, start, attention_mask, self._impl(impl), adapters)
            return
        if start is not None or attention_mask is not None:
            raise ValueError("a commit over one-row caches appends at each row's end: no start or attention_mask")
        check_token_ids(input_ids, self.config.vocab_size)
        impl = self._impl(impl)
        S = input_ids.shape[1]
        rows = cache.rows
        starts = [c.prepare_write(input_ids[r:r + 1], None, None) for r, c in enumerate(rows)]
        masks = [attention.commit_masks(c, p, S, c.is_token[:, p:p + S], impl, self.dtype)
                 for c, p in zip(rows, starts, strict=True)]
        seen = attention.visible_prefixes(self.config.sliding_window, "encoder")
        kinds = self.config.layer_types

        def past(i: int) -> RowPasts:
            return RowPasts([Past(c.visible(i, p, seen[kinds[i]]), m[kinds[i]])
                             for c, p, m in zip(rows, starts, masks, strict=True)])

        def write(i: int, k: Tensor, v: Tensor) -> None:
            for r, (c, p) in enumerate(zip(rows, starts, strict=True)):
                c.write(i, p, k[r:r + 1], v[r:r + 1])

        device = input_ids.device
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)
        self.run_layers(self.embed(input_ids), positions, "encoder", past, impl, write=write, adapters=adapters)
        for c, p in zip(rows, starts, strict=True):
            c.finish_write(p + S)

    @torch.no_grad()
    def next_token_logits(self, input_ids: Tensor, cache: KVCache, *, start: int | None = None,
                          attention_mask: Tensor | None = None, impl: Impl | None = None) -> Tensor:
        """`commit`, and also the encoder's fp32 logits (B, S, V) at those positions, i.e. next-token predictions:
        what an autoregressive model (objective `ar`) decodes with."""
        hidden = self._encode(input_ids, cache, start, attention_mask, self._impl(impl))
        return self.logits(self.final_hidden(hidden))

    def _encode(self, input_ids: Tensor, cache: KVCache, start: int | None, attention_mask: Tensor | None,
                impl: Impl, adapters: AdapterRows | None = None) -> Tensor:
        check_token_ids(input_ids, self.config.vocab_size)
        start = cache.prepare_write(input_ids, start, attention_mask)
        B, S = input_ids.shape
        if S == 0:  # nothing to encode; still truncates at `start`
            return self.embed_tokens.weight.new_zeros(B, 0, self.config.hidden_size)
        masks = attention.commit_masks(cache, start, S, cache.is_token[:, start:start + S], impl, self.dtype)
        seen = attention.visible_prefixes(self.config.sliding_window, "encoder")
        kinds = self.config.layer_types
        positions = torch.arange(start, start + S, device=input_ids.device)[None]
        hidden = self.run_layers(self.embed(input_ids), positions, "encoder",
                                 lambda i: Past(cache.visible(i, start, seen[kinds[i]]), masks[kinds[i]]), impl,
                                 write=lambda i, k, v: cache.write(i, start, k, v), adapters=adapters)
        cache.finish_write(start + S)
        return hidden

    @torch.no_grad()
    def denoise(self, canvas: Tensor, cache: KVCache | RowCaches, *, adapters: AdapterRows | None = None,
                self_conditioning_logits: Tensor | None = None, self_conditioning_mask: Tensor | None = None,
                sliding_prefix: int | None = None, t: Tensor | float | None = None, impl: Impl | None = None) -> Tensor:
        """Bidirectional decoder pass over `canvas` (B, L) against everything committed; returns fp32 logits
        (B, L, V). Never writes the cache, so several canvases can be tried at the same position.
        `self_conditioning_logits` (B, L, V): the previous step's logits (temperature-scaled, as transformers'
        sampler passes them); None on the first step of a canvas; their softmax runs in fp32 whatever their dtype
        (transformers passes them in the model dtype, so cast them to reproduce it in bf16).
        `self_conditioning_mask` (B,) bool zeroes the signal per row. `sliding_prefix`: how many committed tokens
        sliding layers see; default `sliding_window - 1` (transformers); the JAX reference uses `sliding_window`.
        `t`: the canvas's noise level in [0, 1], a float or (B,), for a time-embedding model. `cache` may also be
        `RowCaches`, B one-row caches each at its own committed length (continuous batching: `KVCache.rows` views of
        a pool); each row then computes what it would in a batch of its own. `impl` (default: the model's):
        "reference" or "fast" kernels. `adapters`: each row's LoRA adapter or the base, as for `commit`."""
        check_token_ids(canvas, self.config.vocab_size, "canvas")
        soft = None
        if self_conditioning_logits is not None:
            expected = (*canvas.shape, self.config.vocab_size)
            if tuple(self_conditioning_logits.shape) != expected:
                raise ValueError(f"self_conditioning_logits has shape {tuple(self_conditioning_logits.shape)}, "
                                 f"expected {expected}")
            soft = self.soft_embedding(self_conditioning_logits, self_conditioning_mask)
        return self.logits(self.denoise_hidden(canvas, cache, soft=soft, sliding_prefix=sliding_prefix, t=t,
                                               impl=impl, adapters=adapters))

    @torch.no_grad()
    def denoise_hidden(self, canvas: Tensor, cache: KVCache | RowCaches, *, soft: Tensor | None = None,
                       sliding_prefix: int | None = None, t: Tensor | float | None = None,
                       impl: Impl | None = None, adapters: AdapterRows | None = None) -> Tensor:
        """`denoise` up to the final hidden state (B, L, D) that the head reads, with the self-conditioning signal
        given as the soft embedding (B, L, D) (`soft_embedding`), or None."""
        cache.check_batch(canvas, "canvas")
        impl = self._impl(impl)
        if t is not None:
            t = torch.as_tensor(t, dtype=torch.float32, device=canvas.device).reshape(-1, 1)
        x = self.self_conditioning(self.embed(canvas, t), soft)  # Gemma: SC MLP + weightless post-norm on the input
        L = canvas.shape[1]
        seen = attention.visible_prefixes(self.config.sliding_window, "decoder", sliding_prefix)
        kinds = self.config.layer_types
        offsets = torch.arange(L, device=x.device)
        if isinstance(cache, KVCache):
            end = cache.length
            masks = attention.denoise_masks(cache, end, L, seen, impl)
            hidden = self.run_layers(x, end + offsets[None], "decoder",
                                     lambda i: Past(cache.visible(i, end, seen[kinds[i]]), masks[kinds[i]]), impl,
                                     adapters=adapters)
        else:  # one row per cache, each at its own length: the masks and cached keys of each row's lone pass
            rows = cache.rows
            row_masks = [attention.denoise_masks(c, c.length, L, seen, impl) for c in rows]
            positions = torch.tensor([c.length for c in rows], device=x.device)[:, None] + offsets

            def past(i: int) -> RowPasts:
                return RowPasts([Past(c.visible(i, c.length, seen[kinds[i]]), m[kinds[i]])
                                 for c, m in zip(rows, row_masks, strict=True)])

            hidden = self.run_layers(x, positions, "decoder", past, impl, adapters=adapters)
        return self.final_hidden(hidden, soft)

    def logits(self, final: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Tied head and softcap on the final hidden states (`final_hidden`): (..., D) -> (..., V) in `dtype` (fp32;
        float64 for a float64 judge's scores)."""
        logits = F.linear(final, self.embed_tokens.weight).to(dtype)  # Gemma: tied input/output embedding
        cap = self.config.final_logit_softcapping
        if cap is not None:
            if torch.is_grad_enabled() and logits.requires_grad:  # training keeps tanh's input for backward
                logits = torch.tanh(logits / cap) * cap  # Gemma: logit softcap, 30 * tanh(x / 30), in fp32
            else:  # sampling: in place, so no second (B, L, V) fp32 tensor
                logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    @torch.no_grad()
    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor | None = None,
                self_conditioning_logits: Tensor | None = None, attention_mask: Tensor | None = None,
                self_conditioning_mask: Tensor | None = None, impl: Impl | None = None) -> Tensor:
        """The transformers-compatible forward: commit `input_ids` (B, T) into a fresh cache, denoise
        `decoder_input_ids` (B, L) against it, return fp32 logits (B, L, V), which equal
        `DiffusionGemmaForBlockDiffusion(...).logits` for the same inputs. With `attention_mask`, padded prompt
        positions are hidden from the canvas too (transformers needs `decoder_attention_mask` for that)."""
        check_token_ids(input_ids, self.config.vocab_size)
        if decoder_input_ids is not None:
            check_token_ids(decoder_input_ids, self.config.vocab_size, "decoder_input_ids")
            if decoder_input_ids.ndim != 2 or decoder_input_ids.shape[0] != input_ids.shape[0]:
                raise ValueError(f"decoder_input_ids must have shape (batch={input_ids.shape[0]}, canvas length), "
                                 f"got {tuple(decoder_input_ids.shape)}")
        if decoder_input_ids is None:  # as transformers: a uniformly random canvas from the global generator
            decoder_input_ids = torch.randint(0, self.config.vocab_size, (input_ids.shape[0],
                                              self.config.canvas_length), device=input_ids.device)
        cache = self.new_cache(input_ids.shape[0], max(1, input_ids.shape[1]))
        self.commit(input_ids, cache, attention_mask=attention_mask, impl=impl)
        return self.denoise(decoder_input_ids, cache, self_conditioning_logits=self_conditioning_logits,
                            self_conditioning_mask=self_conditioning_mask, impl=impl)
