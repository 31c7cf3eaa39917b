"""A randomized parity sweep: dgemma against transformers 5.23 on seeded random geometries.

`random_case(seed)` draws one case: a text geometry (heads and KV heads 1-8, head dims 8-64, global head dims,
layer-type mixes, sliding windows 2-64, experts 1-16 with any top-k, RoPE thetas and partial factors), a canvas
length (4-64), a vocabulary (100-4096), an embedding scale (peaked or flat posteriors), EOS lists and pad ids,
every generation-config field in its valid range, a batch of 1-3 rows, and left padding or not.

`run_case(case)` builds the randomised transformers model, saves it, loads it in both libraries, and checks:
  - forward: first denoising step, a step with self-conditioning, a second canvas after a commit: bit-exact (fp32,
    transformers with eager attention and eager experts); in bf16 too when `case.bf16`;
  - `impl="fast"` logits within max(FAST_FLOOR, 2 x transformers' own default-vs-eager distance) of the reference, fp32;
  - `generate`: sequences, tokens_per_forward, and the number of denoising steps of every canvas identical, under
    the same seed (fp32; bf16 when `case.bf16`).
On a mismatch it raises `Mismatch` with the case, the seed, and the first divergent canvas and step.

`python -m tests.model.sweep 0-200` runs a range of cases from the command line and prints one line per case.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import tempfile
import time
from typing import Any

import torch

from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.testing.hf import EntropyBoundSamplerConfig, build_hf_model, load_hf_model, save_hf_model
from dgemma.weights.loading import load_generation_config, load_model

S, F = "sliding_attention", "full_attention"

# fp32 rounding of the fast kernels' reordered sums on a small random model: the error no case may pass against the
# float64 logits, whatever the reference's (measured up to 1.1e-4 on AMD EPYC AVX-512, under 1e-4 on Intel Xeon)
FAST_FLOOR = 2e-4


class Mismatch(AssertionError):
    pass


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    text: dict[str, Any]  # transformers text-config keys
    canvas_length: int
    embedding_std: float
    generation: dict[str, Any]  # GenerationConfig fields, as dgemma.generate overrides (entropy_bound included)
    batch: int
    prompt_length: int
    left_pad: tuple[int, ...]  # pad tokens per row (all 0: no attention mask)
    bf16: bool

    def describe(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_case(seed: int) -> Case:
    r = random.Random(seed)
    V = r.choice([100, 128, 257, 500, 1000, 2048, 4096]) if r.random() < 0.5 else r.randint(100, 4096)
    heads = r.randint(1, 8)
    layers = r.randint(1, 6)
    kinds = [r.choice([S, F]) for _ in range(layers - 1)] + [F]  # transformers forces the last layer to full
    experts = r.randint(1, 16)
    text: dict[str, Any] = dict(
        vocab_size=V, hidden_size=r.choice([16, 32, 48, 64, 96]), intermediate_size=r.choice([8, 24, 64, 128]),
        num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
        num_key_value_heads=r.choice(_divisors(heads)), head_dim=r.choice(range(8, 65, 2)),
        global_head_dim=r.choice(range(8, 65, 2)),
        num_global_key_value_heads=r.choice([None, *_divisors(heads)]), sliding_window=r.randint(2, 64),
        num_experts=experts, top_k_experts=r.randint(1, experts), moe_intermediate_size=r.choice([8, 16, 40]),
        rms_norm_eps=r.choice([1e-6, 1e-5]), max_position_embeddings=4096,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": r.choice([100.0, 10_000.0])},
            F: {"rope_type": "proportional", "partial_rotary_factor": r.choice([0.25, 0.5, 1.0]),
                "rope_theta": r.choice([10_000.0, 1_000_000.0])},
        },
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    canvas = r.choice([4, 5, 8, 16, 32, 64]) if r.random() < 0.7 else r.randint(4, 64)
    t_min = r.uniform(0.05, 1.0)
    steps = r.randint(1, 16)
    eos = r.sample(range(V), r.choice([0, 1, 1, 2, 3]))
    generation: dict[str, Any] = dict(
        max_new_tokens=r.randint(1, 3 * canvas), max_denoising_steps=steps,
        entropy_bound=r.choice([1e-3, 0.01, 0.1, 0.5, 2.0, 10.0]), t_min=t_min, t_max=t_min + r.uniform(1e-3, 1.0),
        stability_threshold=r.choice([0, 1, 1, 2, 3]),
        confidence_threshold=r.choice([1e-4, 0.005, 0.5, 2.0, 10.0]),
        eos_token_id=eos, pad_token_id=r.choice([None, 0, r.randrange(V)]),
    )
    batch = r.randint(1, 3)
    prompt = r.randint(1, 80)
    padded = batch > 1 and r.random() < 0.3
    left_pad = tuple(r.randint(0, prompt - 1) if padded and i > 0 else 0 for i in range(batch))
    embedding_std, bf16 = r.choice([0.3, 1.0, 3.0]), r.random() < 0.25
    # Drawn last, so that adding them left every earlier case as it was. `max_length` stops generation after the
    # canvas that reaches it; with the literal default max_new_tokens=256 it also sets the number of canvases
    # (transformers' rule), which is only valid while it leaves room after the prompt.
    if r.random() < 0.3:
        generation["max_length"] = r.randint(1, prompt + 3 * canvas)
        if r.random() < 0.5 and generation["max_length"] > prompt:
            generation["max_new_tokens"] = 256
    return Case(seed, text, canvas, embedding_std, generation, batch, prompt, left_pad, bf16=bf16)


def _hf_kwargs(generation: dict[str, Any]) -> dict[str, Any]:
    kw = dict(generation)
    kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=kw.pop("entropy_bound"))
    kw["eos_token_id"] = list(kw["eos_token_id"]) or None
    return kw


class _Drafts:
    """A transformers streamer that records the argmax canvas of every denoising step, canvas by canvas."""

    def __init__(self) -> None:
        self.canvases: list[list[torch.Tensor]] = []
        self._open: list[torch.Tensor] = []
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.canvases.append(self._open)
        self._open = []

    def put_draft(self, value: torch.Tensor) -> None:
        self._open.append(value.clone())

    def end(self) -> None:
        pass


def _prompt(case: Case) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, case.text["vocab_size"], (case.batch, case.prompt_length), generator=g)
    if not any(case.left_pad):
        return ids, None
    mask = torch.ones_like(ids)
    for row, n in enumerate(case.left_pad):
        mask[row, :n] = 0
        ids[row, :n] = case.generation["pad_token_id"] or 0
    return ids, mask


def _patch_transformers_padding_bug() -> None:
    """transformers 5.23 builds the decoder's eager padding mask from a long dummy tensor (`finfo(long)` raises):
    give it a float dummy of the same shape. Only the dtype of the dummy changes; the mask values do not."""
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as m

    decoder = m.DiffusionGemmaDecoderModel
    original = decoder.create_diffusion_decoder_attention_mask
    if getattr(original, "_dgemma_patched", False):
        return

    def patched(config, inputs_embeds, past_key_values, decoder_attention_mask=None):
        if not inputs_embeds.is_floating_point():
            inputs_embeds = torch.empty((*inputs_embeds.shape[:2], 0), dtype=torch.float32)
        return original(config, inputs_embeds, past_key_values, decoder_attention_mask)

    patched._dgemma_patched = True
    decoder.create_diffusion_decoder_attention_mask = staticmethod(patched)


def _check_forward(case: Case, hf: Any, hf_default: Any, model: Any, dtype: torch.dtype, where: str,
                   exact: Any = None) -> None:
    """`exact`: the same checkpoint in float64 (float32 cases): the truth both float32 paths round."""
    from dgemma.testing.hf import hf_logits

    V, L = case.text["vocab_size"], case.canvas_length
    g = torch.Generator().manual_seed(case.seed + 1)
    prompt = torch.randint(0, V, (case.batch, case.prompt_length), generator=g)
    canvas = torch.randint(0, V, (case.batch, L), generator=g)
    committed = torch.randint(0, V, (case.batch, L), generator=g)
    sc = (torch.randn(case.batch, L, V, generator=g) * 4).to(dtype)
    want, hf_cache = hf_logits(hf, prompt, canvas)
    cache = model.new_cache(case.batch, case.prompt_length + 2 * L)
    model.commit(prompt, cache)
    checks = [("first step", model.denoise(canvas, cache), want)]
    want_sc, _ = hf_logits(hf, None, canvas, self_conditioning_logits=sc, past_key_values=hf_cache)
    checks.append(("self-conditioned step", model.denoise(canvas, cache, self_conditioning_logits=sc), want_sc))
    fast_first = model.denoise(canvas, cache, impl="fast") if dtype == torch.float32 else None
    if fast_first is not None:
        exact_cache = exact.new_cache(case.batch, case.prompt_length + L)
        exact.commit(prompt, exact_cache)
        truth = exact.denoise(canvas, exact_cache)
    want2, _ = hf_logits(hf, committed, canvas, past_key_values=hf_cache)
    model.commit(committed, cache)
    checks.append(("second canvas", model.denoise(canvas, cache), want2))
    for name, got, ref in checks:
        if not torch.equal(got, ref):
            raise Mismatch(f"{where}: forward ({name}) differs from transformers: max |diff| "
                           f"{(got - ref).abs().max().item():.3g}\ncase: {case.describe()}")
    if fast_first is not None:
        # The fast kernels (SDPA, sorted experts) reorder fp32 sums like transformers' default kernels (SDPA,
        # grouped_mm) do. Peaked random models amplify that rounding past 1e-4, and past the reference path's own
        # distance from the exact (float64) logits: both float32 paths round the same truth. So the fast path's
        # error against the float64 logits is bounded by 1e-4, or twice the reference path's error, or twice
        # transformers' own default-vs-eager distance, whichever is largest (case 258: the fast path is 2.9e-3 from
        # the truth, the reference 3.3e-3, while the two are 9.3e-4 apart).
        # The floor is the CPU's: on an AVX-512 AMD EPYC case 7 is 1.1e-4 from the truth (the reference 3.5e-5,
        # transformers' two kernels 4.0e-5 apart), past the 1e-4 that held on an Intel Xeon (FAST_FLOOR).
        want_default, _ = hf_logits(hf_default, prompt, canvas)
        noise = (want_default - want).abs().max().item()
        reference_error = (want.double() - truth).abs().max().item()
        error = (fast_first.double() - truth).abs().max().item()
        if not error <= max(FAST_FLOOR, 2 * reference_error, 2 * noise):
            raise Mismatch(f"{where}: impl='fast' logits are {error:.3g} from the float64 logits > "
                           f"max({FAST_FLOOR:g}, 2 x {reference_error:.3g} (the reference's), 2 x {noise:.3g} "
                           f"(transformers' default vs "
                           f"eager))\ncase: {case.describe()}")


def _check_generate(case: Case, hf: Any, model: Any, settings: GenerationConfig, where: str) -> None:
    ids, mask = _prompt(case)
    drafts = _Drafts()
    torch.manual_seed(case.seed)
    padding = {} if mask is None else {"attention_mask": mask}
    want = hf.generate(ids, streamer=drafts, **padding, **_hf_kwargs(case.generation))
    steps: list[list[torch.Tensor]] = []
    on_step = lambda info: (steps.append([]) if info.step == 1 else None, steps[-1].append(info.argmax.clone()))
    got = generate(model, ids, generation_config=settings, attention_mask=mask, seed=case.seed, on_step=on_step,
                   **case.generation)
    if torch.equal(got.sequences, want.sequences) and \
            torch.equal(got.tokens_per_forward, want.tokens_per_forward.to(got.tokens_per_forward.dtype)) and \
            [len(c) for c in steps] == [len(c) for c in drafts.canvases]:
        return
    detail = "sequences identical; tokens_per_forward or step counts differ"
    for c, (mine, theirs) in enumerate(zip(steps, drafts.canvases, strict=False)):
        for s, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if not torch.equal(a, b):
                rows = (a != b).any(-1).nonzero().flatten().tolist()
                detail = (f"first divergent argmax at canvas {c} step {s + 1}, rows {rows}: dgemma "
                          f"{a[rows[0]].tolist()} vs transformers {b[rows[0]].tolist()}")
                break
        else:
            if len(mine) != len(theirs):
                detail = f"canvas {c}: dgemma ran {len(mine)} steps, transformers {len(theirs)}"
            else:
                continue
        break
    raise Mismatch(f"{where}: generate differs from transformers ({detail})\n"
                   f"  sequences: dgemma {got.sequences[:, case.prompt_length:].tolist()}\n"
                   f"        transformers {want.sequences[:, case.prompt_length:].tolist()}\n"
                   f"  tokens_per_forward: dgemma {got.tokens_per_forward.tolist()} transformers "
                   f"{want.tokens_per_forward.tolist()}; steps dgemma {[len(c) for c in steps]} transformers "
                   f"{[len(c) for c in drafts.canvases]}\ncase: {case.describe()}")


def run_case(case: Case) -> None:
    _patch_transformers_padding_bug()
    with tempfile.TemporaryDirectory() as path:
        with torch.random.fork_rng(devices=[]):
            hf = build_hf_model("tiny", seed=case.seed, canvas_length=case.canvas_length, text_overrides=case.text,
                                embedding_std=case.embedding_std)
            save_hf_model(hf, path)
        for dtype in (torch.float32, torch.bfloat16) if case.bf16 else (torch.float32,):
            where = f"case {case.seed} ({str(dtype).removeprefix('torch.')})"
            hf = load_hf_model(path, dtype=dtype, eager=True)
            model = load_model(path, dtype=dtype)
            if not any(case.left_pad):
                default = load_hf_model(path, dtype=dtype, eager=False) if dtype == torch.float32 else None
                exact = load_model(path, dtype=torch.float64) if dtype == torch.float32 else None
                _check_forward(case, hf, default, model, dtype, where, exact)
            with torch.random.fork_rng(devices=[]):
                _check_generate(case, hf, model, load_generation_config(path), where)


def _seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return out


if __name__ == "__main__":
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and other work on the machine cannot stall it
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    failed = 0
    started = time.perf_counter()
    for seed in _seeds(sys.argv[1] if len(sys.argv) > 1 else "0-49"):
        t = time.perf_counter()
        try:
            run_case(random_case(seed))
            print(f"case {seed}: ok ({time.perf_counter() - t:.1f} s)", flush=True)
        except Mismatch as e:
            failed += 1
            print(f"case {seed}: FAIL {e}", flush=True)
        except Exception as e:  # report and go on
            failed += 1
            print(f"case {seed}: ERROR {type(e).__name__}: {e}\ncase: {random_case(seed).describe()}", flush=True)
    print(f"{failed} failed, {time.perf_counter() - started:.0f} s", flush=True)
    sys.exit(1 if failed else 0)
