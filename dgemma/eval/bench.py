"""Speed measurements: generation (dgemma's readable and fast paths, and transformers on the same checkpoint) and
training throughput, each next to its physical bound on the machine it ran on.

Generation runs a fixed number of denoising steps per canvas (adaptive stopping and EOS are switched off, so every
implementation does the same work) and reports, per implementation, the median over `repeats` alternating runs of:

    tokens_per_second       generated tokens / wall time of the whole generate call (prefill included)
    tokens_per_forward      generated tokens / denoising passes (transformers' definition)
    ms_per_denoise_step     (wall time - prefill - commits) / denoising passes: decoder pass plus sampler
    ms_per_commit           one finished canvas committed to the cache
    ms_prefill              the prompt committed to the cache
    ms_to_first_canvas      from the call until the first canvas is final (prefill + a whole canvas)
    peak_memory_bytes       CPU: peak resident set of the process during the run; CUDA: peak allocated

Bounds: a denoise step cannot beat max(FLOPs / measured matmul peak, bytes / measured copy bandwidth), where the
bytes are the weights the step must read (dense parts, the experts a canvas touches, the embedding) plus the
visible KV cache. Training reports tokens/s and model FLOP utilisation (MFU) against the measured matmul peak.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dgemma.io import fsio
from dgemma.io.system import git_commit, machine_info, peak_memory, reset_peak_memory
from dgemma.model import attention, costs
from dgemma.model.config import PRESETS, ConfigError, ModelConfig
from dgemma.model.costs import check_memory
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig, offset_seed
from dgemma.train import diffusion
from dgemma.weights.loading import DTYPES, init_weights, load_model
from dgemma.weights.offload import check_combination

IMPLS_ORDER = ("reference", "fast", "transformers")
NO_STOP = 1e-38  # confidence_threshold: mean entropy never falls below it, so every canvas runs all its steps
GPU_ONLY = {"diffusiongemma-26b-a4b"}  # too large for host memory in any dtype we run on CPU


# --- settings ---------------------------------------------------------------------------------------------------

@dataclass
class BenchSettings:
    preset: str | None = "tiny"
    model_dir: str | None = None
    impls: tuple[str, ...] = ("reference", "fast")
    compare_transformers: bool = False
    steps: int = 16  # denoising steps per canvas (fixed)
    canvases: int = 2  # a commit happens between canvases
    repeats: int = 3
    batch: int = 1
    prompt_length: int | None = None  # default: sliding_window + canvas_length // 4 (longer than the window)
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    compile: bool = False  # the fast path's denoise step through torch.compile
    seed: int = 0
    train: bool = True
    train_preset: str | None = None  # default: cpu-small (CPU) / lite-380m (CUDA), tiny with the tiny preset
    train_steps: int | None = None  # timed optimizer steps per objective; default: `repeats`
    threads: int | None = None
    quantize: str | None = None  # "int8" / "int4": weight-only (dgemma/weights/quantize.py), for dgemma's paths only
    offload_experts: bool = False  # experts read from a memory-mapped file per layer (dgemma/weights/offload.py)

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.model_dir is None):
            raise ConfigError("give exactly one of a preset and a checkpoint directory")
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
        bad = [i for i in self.impls if i not in ("reference", "fast")]
        if bad or not self.impls:
            raise ConfigError(f"impls must be 'reference' and/or 'fast', got {self.impls!r}")
        for name in ("steps", "canvases", "repeats", "batch", "train_steps", "prompt_length", "threads"):
            v = getattr(self, name)
            if name in ("train_steps", "prompt_length", "threads") and v is None:  # None: the default
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is available")
        if self.device == "cpu" and self.preset in GPU_ONLY and self.model_dir is None:
            cfg = PRESETS[self.preset]
            gb = costs.weight_bytes(cfg, 2, self.quantize)["total"] / 1e9
            kind = f"{self.quantize} (embedding in bf16)" if self.quantize else "bf16"
            raise ConfigError(f"preset {self.preset} is a GPU benchmark: its random {kind} weights alone take "
                              f"{gb:.0f} GB ({costs.parameter_counts(cfg)['total']:,} parameters), more than a CPU "
                              "host should hold; run it with --device cuda")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in costs.QUANTIZE_MODES:
            raise ConfigError(f"quantize must be one of {', '.join(costs.QUANTIZE_MODES)}, got {self.quantize!r}")
        if self.quantize is not None:  # before the machine's peaks are measured: int4 has no CPU kernel
            from dgemma.weights.quantize import check_supported

            check_supported(self.quantize, self.device, self.torch_dtype)
        check_combination(self.quantize, self.offload_experts, self.compile)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype or ("bfloat16" if self.device == "cuda" else "float32")]


# --- the machine: measured peaks -------------------------------------------------------------------------------------

def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _best_time(fn: Callable[[], Any], device: torch.device | str, repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls: a ceiling is what the machine can do, not what it did on average."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_matmul_peak(device: str, dtype: torch.dtype, size: int | None = None) -> float:
    """FLOP/s of a large square matmul in `dtype`: the compute ceiling used for MFU and bounds."""
    n = size or (8192 if device == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_time(lambda: a @ b, device, repeats=10)
    return 2 * n**3 / seconds


def measure_bandwidth(device: str, num_bytes: int | None = None) -> float:
    """Bytes/s of a large tensor copy (read + write counted): the memory ceiling used for the bounds."""
    n = (num_bytes or (2**31 if device == "cuda" else 2**27)) // 4  # well past any CPU cache
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, repeats=5)
    return 2 * n * 4 / seconds


# --- generation -------------------------------------------------------------------------------------------------------

@dataclass
class RunTimes:
    total: float = 0.0
    prefill: float = 0.0
    commits: list[float] = field(default_factory=list)
    first_canvas: float = math.nan
    passes: int = 0
    tokens: int = 0
    tokens_per_forward: float = math.nan
    peak_memory: int | None = None


class _Stopwatch:
    """Times calls of a callable (synchronising CUDA around them), appending seconds to a list."""

    def __init__(self, device: str):
        self.device, self.laps = device, []
        self._t = 0.0

    def start(self, *_: Any, **__: Any) -> None:
        _sync(self.device)
        self._t = time.perf_counter()

    def stop(self, *_: Any, **__: Any) -> None:
        _sync(self.device)
        self.laps.append(time.perf_counter() - self._t)

    def time(self, run: Callable[[], Any]) -> None:
        """Run `run` once, timed (generate's `around_commit`)."""
        self.start()
        run()
        self.stop()


def _sampler_settings(steps: int, canvas_length: int, canvases: int) -> dict[str, Any]:
    g = GenerationConfig()
    return dict(max_new_tokens=canvases * canvas_length, max_denoising_steps=steps, t_min=g.t_min, t_max=g.t_max,
                entropy_bound=g.entropy_bound, stability_threshold=g.stability_threshold,
                confidence_threshold=NO_STOP)


def run_dgemma(model: DiffusionGemma, prompt: Tensor, impl: str, s: BenchSettings, seed: int) -> RunTimes:
    """One generate call, instrumented: commits timed through generate's `around_commit`."""
    rt = RunTimes()
    watch = _Stopwatch(s.device)
    started = 0.0

    def on_canvas(index: int, tokens: Tensor) -> None:
        if index == 0:
            _sync(s.device)
            rt.first_canvas = time.perf_counter() - started

    reset_peak_memory(s.device)
    _sync(s.device)
    started = time.perf_counter()
    result = generate(model, prompt, seed=seed, impl=impl, compile=s.compile and impl == "fast",  # type: ignore[arg-type]
                      on_canvas=on_canvas, around_commit=watch.time, eos_token_id=(), pad_token_id=None,
                      **_sampler_settings(s.steps, model.config.canvas_length, s.canvases))
    _sync(s.device)
    rt.total = time.perf_counter() - started
    rt.peak_memory = peak_memory(s.device)
    rt.prefill, rt.commits = watch.laps[0], watch.laps[1:]
    rt.passes = sum(max(row) for row in result.steps_per_canvas)
    rt.tokens = int(result.sequences.shape[1] - prompt.shape[1]) * prompt.shape[0]
    rt.tokens_per_forward = float(result.tokens_per_forward.float().mean())
    return rt


def run_transformers(hf: nn.Module, prompt: Tensor, s: BenchSettings, seed: int) -> RunTimes:
    """One transformers generate call: encoder passes timed with forward hooks, decoder passes counted."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    rt = RunTimes()
    watch = _Stopwatch(s.device)
    encoder = hf.model.encoder
    passes = [0]
    hooks = [encoder.register_forward_pre_hook(watch.start), encoder.register_forward_hook(watch.stop),
             hf.model.decoder.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))]
    canvas_length = hf.config.canvas_length
    settings = _sampler_settings(s.steps, canvas_length, s.canvases)
    settings["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=settings.pop("entropy_bound"))
    started = 0.0

    class FirstCanvas:  # transformers' streamer protocol: put(prompt), then put(canvas) per canvas, end()
        calls = 0

        def put(self, value: Tensor) -> None:
            FirstCanvas.calls += 1
            if FirstCanvas.calls == 2:
                rt.first_canvas = time.perf_counter() - started

        def end(self) -> None:
            pass

    try:
        torch.manual_seed(seed)
        reset_peak_memory(s.device)
        _sync(s.device)
        started = time.perf_counter()
        out = hf.generate(prompt, streamer=FirstCanvas(), eos_token_id=hf.config.text_config.vocab_size,
                          pad_token_id=None, **settings)
        _sync(s.device)
        rt.total = time.perf_counter() - started
        rt.peak_memory = peak_memory(s.device)
    finally:
        for h in hooks:
            h.remove()
    rt.prefill, rt.commits = watch.laps[0], watch.laps[1:]
    rt.passes = passes[0]
    rt.tokens = int(out.sequences.shape[1] - prompt.shape[1]) * prompt.shape[0]
    rt.tokens_per_forward = float(out.tokens_per_forward.float().mean())
    return rt


def summarize(runs: list[RunTimes]) -> dict[str, Any]:
    med = lambda xs: statistics.median(xs) if xs else math.nan
    per_step = [(r.total - r.prefill - sum(r.commits)) / r.passes for r in runs]
    peaks = [r.peak_memory for r in runs if r.peak_memory is not None]
    return {
        "tokens_per_second": med([r.tokens / r.total for r in runs]),
        "tokens_per_forward": med([r.tokens_per_forward for r in runs]),
        "ms_per_denoise_step": 1e3 * med(per_step),
        "ms_per_commit": 1e3 * med([c for r in runs for c in r.commits]),
        "ms_prefill": 1e3 * med([r.prefill for r in runs]),
        "ms_to_first_canvas": 1e3 * med([r.first_canvas for r in runs]),
        "seconds_per_run": med([r.total for r in runs]),
        "denoising_passes": runs[0].passes,
        "generated_tokens": runs[0].tokens,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "repeats": len(runs),
        "all_tokens_per_second": [r.tokens / r.total for r in runs],
    }


def step_bounds(cfg: ModelConfig, context: int, batch: int, dtype_bytes: int, peak_flops: float,
                bandwidth: float, quantize: str | None = None) -> dict[str, Any]:
    """Lower bounds for one denoise step and one canvas commit at `context` committed tokens; the weight bytes are
    those of `quantize` ("int8", "int4") when given (costs.weight_bytes)."""
    flops = costs.flops_per_denoise_step(cfg, context, batch)
    w = costs.weight_bytes(cfg, dtype_bytes, quantize)
    tokens = batch * cfg.canvas_length
    dense = w["total"] - w["experts"]  # includes the embedding (head and soft embedding)
    touched = cfg.num_experts * (1 - (1 - cfg.top_k_experts / cfg.num_experts) ** tokens) if cfg.is_moe else 0
    expert_bytes = (w["experts"] / max(cfg.num_experts, 1)) * touched if cfg.is_moe else 0
    cache = batch * costs.kv_cache_bytes(cfg, context, dtype_bytes)
    weight_bytes = dense + expert_bytes
    commit_flops = tokens * costs.flops_per_committed_token(cfg, context)
    return {
        "denoise_step": {"flops": flops, "bytes": int(weight_bytes + cache), "experts_touched_per_layer": touched,
                         "ms_compute_bound": 1e3 * flops / peak_flops,
                         "ms_memory_bound": 1e3 * (weight_bytes + cache) / bandwidth,
                         "ms_bound": 1e3 * max(flops / peak_flops, (weight_bytes + cache) / bandwidth)},
        "commit": {"flops": commit_flops, "ms_compute_bound": 1e3 * commit_flops / peak_flops},
    }


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def bench_generation(s: BenchSettings, peak_flops: float, bandwidth: float) -> dict[str, Any]:
    """Load (or build) the model(s) once, warm each implementation up, then run them in alternation."""
    from dgemma.testing.hf import build_hf_checkpoint, load_hf_model  # transformers only when compared

    dtype = s.torch_dtype
    with tempfile.TemporaryDirectory(prefix="dgemma-bench-") as tmp:
        path = s.model_dir
        if path is None and s.compare_transformers:
            path = tmp
            build_hf_checkpoint(PRESETS[s.preset], path, seed=s.seed, dtype=dtype)  # type: ignore[index]
        if path is not None:
            model = load_model(path, dtype=dtype, device=s.device, quantize=s.quantize)
        else:  # allocated once, in the target dtype, on the device (26B in fp32 first would not fit an H200)
            model = _random_model(PRESETS[s.preset], dtype, s.device, s.seed, s.quantize)  # type: ignore[index]
        if s.offload_experts:
            from dgemma.weights.offload import offload_experts

            offload_experts(model, Path(tmp) / "experts.safetensors")
        hf = load_hf_model(path, dtype=dtype, device=s.device, eager=False) if s.compare_transformers else None  # type: ignore[arg-type]
        cfg = model.config
        prompt_len = s.prompt_length or cfg.sliding_window + max(4, cfg.canvas_length // 4)
        # the batch's prompts, cache and logits must fit before anything is allocated (--batch 1000000000)
        check_memory(cfg, dtype, s.device, batch_size=s.batch, prompt_length=prompt_len,
                     cache_length=prompt_len + s.canvases * cfg.canvas_length)
        g = torch.Generator().manual_seed(s.seed)
        prompt = torch.randint(0, cfg.vocab_size - 3, (s.batch, prompt_len), generator=g).to(s.device)
        runners: dict[str, Callable[[int], RunTimes]] = {
            impl: (lambda seed, impl=impl: run_dgemma(model, prompt, impl, s, seed)) for impl in s.impls}
        if hf is not None:
            runners["transformers"] = lambda seed: run_transformers(hf, prompt, s, seed)
        order = [k for k in IMPLS_ORDER if k in runners]
        for name in order:  # warm-up: allocator, kernels, and (fast + --compile) the compiled step
            runners[name](s.seed)
        runs: dict[str, list[RunTimes]] = {name: [] for name in order}
        for r in range(s.repeats):
            for name in order if r % 2 == 0 else reversed(order):  # alternate, so drift hits every side alike
                runs[name].append(runners[name](offset_seed(s.seed, 1 + r)))
    results = {name: summarize(rs) for name, rs in runs.items()}
    ratios = {}
    for a, b in (("fast", "reference"), ("fast", "transformers"), ("reference", "transformers")):
        if a in results and b in results:
            ratios[f"{a}/{b}"] = results[a]["tokens_per_second"] / results[b]["tokens_per_second"]
    context = prompt_len + (s.canvases - 1) * cfg.canvas_length // 2  # a middle canvas's context, for the bounds
    bounds = step_bounds(cfg, context, s.batch, torch.finfo(dtype).bits // 8, peak_flops, bandwidth, s.quantize)
    return {"model": s.model_dir or s.preset, "prompt_length": prompt_len, "batch": s.batch, "steps": s.steps,
            "canvases": s.canvases, "canvas_length": cfg.canvas_length, "dtype": str(dtype).removeprefix("torch.")
            + (f", {s.quantize} weights" if s.quantize else "") + (", experts offloaded" if s.offload_experts else ""),
            "compile": s.compile, "results": results, "ratios": ratios, "bounds": bounds,
            "bound_context": context}


def _random_model(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int, quantize: str | None
                  ) -> DiffusionGemma:
    """Random weights (`testing.hf.randomize_`) made in `dtype` on `device`; with `quantize`, each layer is
    quantized as soon as it is filled, so the 26B-A4B never exists whole in bf16 (peak: quantized model + a layer)."""
    from dgemma.testing.hf import randomize_

    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    if quantize is None:
        return randomize_(model.to(dtype).to_empty(device=device), seed).eval()
    from dgemma.weights import quantize as q

    q.check_supported(quantize, device, dtype)
    layers, model.layers = model.layers, nn.ModuleList()
    parts = [model.to(dtype), *layers]  # the model without its layers (embedding, norm, self-conditioning) first
    for i, part in enumerate(parts):
        randomize_(part.to_empty(device=device), offset_seed(seed, i))
        for name in list(q.quantized_names(part)):
            q.replace(part, name, quantize)
    model.layers = layers
    return model.eval()


# --- training -------------------------------------------------------------------------------------------------------

def training_flops(cfg: ModelConfig, batch: int, seq_len: int, objective: str, self_conditioned: bool,
                   masks: dict[str, Tensor]) -> int:
    """Model FLOPs of one training step (forward + backward = 3 x forward), counting attention only over the pairs
    the masks allow. clean-context runs 2 x seq_len tokens (clean copy + noisy copy), the head on the noisy half;
    a self-conditioning pre-pass adds a no-grad forward and the soft embedding p @ E."""
    D, V = cfg.hidden_size, cfg.vocab_size
    per_token = 2 * costs._matmul_params(cfg, self_conditioning=False)
    attention = 0
    for i in range(cfg.num_hidden_layers):
        pairs = int(masks[cfg.layer_types[i]].sum()) * batch
        attention += 4 * cfg.num_attention_heads * cfg.layer_head_dim(i) * pairs
    tokens = batch * (2 * seq_len if objective == "clean-context" else seq_len)
    head_tokens = batch * seq_len
    forward = tokens * per_token + attention + head_tokens * 2 * V * D
    sc_params = costs._self_conditioning_params(cfg) - (D if cfg.self_conditioning == "mlp" else 0)
    total = 3 * forward
    if self_conditioned:
        total += 3 * head_tokens * 2 * sc_params  # the conditioned pass runs the self-conditioning MLP too
        total += forward + head_tokens * 2 * V * D  # the no-grad pre-pass, then softmax(head) @ E
    return total


def _train_step(model: DiffusionGemma, opt: torch.optim.Optimizer, data: Tensor, objective: str,
                g: torch.Generator, sc_prob: float, chunk: int, device: str, use_bf16: bool) -> tuple[float, bool]:
    """One timed optimizer step on `data` (B, S + 1): seconds, and whether it ran the self-conditioning pre-pass."""
    _sync(device)
    start = time.perf_counter()
    with torch.autocast(device, torch.bfloat16, enabled=use_bf16):
        x0 = data if objective == "ar" else data[:, :-1]
        out = diffusion.training_loss(model, x0, objective=objective, self_conditioning_prob=sc_prob,  # type: ignore[arg-type]
                                      chunk_rows=chunk, generator=g)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - start, out.self_conditioned


def bench_training(s: BenchSettings, peak_flops: float) -> dict[str, Any]:
    """Diffusion (clean-context) and AR optimizer steps of the training preset, the impls alternating step by step;
    mean time per step over the timed steps, MFU = model FLOPs / time / the measured fp32 (CPU) matmul peak."""
    name = s.train_preset or ("tiny" if s.preset == "tiny" else "lite-380m" if s.device == "cuda" else
                              "cpu-small" if "cpu-small" in PRESETS else "tiny")
    if name not in PRESETS:
        raise ConfigError(f"unknown training preset {name!r}")
    cfg = PRESETS[name]
    batch, seq_len, sc_prob, chunk = 4, 4 * cfg.canvas_length, 0.5, 1024
    try:
        from dgemma.train.config import train_preset
        tc = train_preset(name)
        batch, seq_len, sc_prob, chunk = tc.batch_size, tc.seq_len, tc.self_conditioning_prob, tc.chunk_rows
    except (ImportError, ConfigError):
        pass
    use_bf16 = s.device == "cuda"
    out: dict[str, Any] = {"preset": name, "batch": batch, "seq_len": seq_len,
                           "precision": "bf16 autocast" if use_bf16 else "float32", "results": {}}
    W, L = cfg.sliding_window, cfg.canvas_length
    masks = {"clean-context": attention.clean_context_masks(seq_len, L, W), "ar": attention.causal_masks(seq_len, W)}
    runs: dict[str, Any] = {}
    for impl in s.impls:  # one model per impl, same weights, data and noise draws (the self-conditioning coin)
        model = init_weights(DiffusionGemma(cfg, impl=impl)).to(s.device).train()  # type: ignore[arg-type]
        g = torch.Generator(device=s.device).manual_seed(s.seed)
        data = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g, device=s.device)
        runs[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), data, g)
    samples: dict[str, dict[str, list[tuple[float, int]]]] = {i: {"clean-context": [], "ar": []} for i in runs}
    for r in range(1 + (s.train_steps or s.repeats)):  # the first round warms up
        for objective in ("clean-context", "ar"):
            for impl in s.impls if r % 2 == 0 else reversed(s.impls):  # alternate, as for generation
                seconds, sc = _train_step(*runs[impl][:3], objective, runs[impl][3], sc_prob, chunk, s.device,
                                          use_bf16)
                if r:
                    samples[impl][objective].append((seconds, training_flops(cfg, batch, seq_len, objective, sc,
                                                                             masks[objective])))
    for impl, per_objective in samples.items():
        res: dict[str, Any] = {}
        for objective, xs in per_objective.items():  # totals: the self-conditioning coin makes steps bimodal
            seconds, flops = sum(x[0] for x in xs), sum(x[1] for x in xs)
            res[objective] = {"ms_per_step": 1e3 * seconds / len(xs), "tokens_per_second": batch * seq_len * len(xs)
                              / seconds, "model_flops_per_step": flops / len(xs), "mfu": flops / seconds / peak_flops}
        res["diffusion/ar_time"] = res["clean-context"]["ms_per_step"] / res["ar"]["ms_per_step"]
        out["results"][impl] = res
    return out


# --- the whole run --------------------------------------------------------------------------------------------------

def run(s: BenchSettings) -> dict[str, Any]:
    torch.manual_seed(s.seed)
    with _threads(s.threads):
        dtype = s.torch_dtype
        peak = measure_matmul_peak(s.device, dtype)
        bandwidth = measure_bandwidth(s.device)
        report: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
            "machine": machine_info(s.device), "settings": asdict(s),
            "peak": {"matmul_flops_per_second": peak, "matmul_dtype": str(dtype).removeprefix("torch."),
                     "copy_bytes_per_second": bandwidth},
        }
        report["generation"] = bench_generation(s, peak, bandwidth)
        if s.train:  # CPU training runs in fp32, CUDA training under bf16 autocast
            train_peak = peak if s.device == "cuda" or dtype == torch.float32 else \
                measure_matmul_peak(s.device, torch.float32)
            report["training"] = bench_training(s, train_peak)
        with contextlib.suppress(OSError):
            report["machine"]["load_average_after"] = list(os.getloadavg())
    return report


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_report(r: dict[str, Any]) -> str:
    g, m, pk = r["generation"], r["machine"], r["peak"]
    lines = [f"machine: {m['cpu']} ({m['cores']} cores, {m['threads']} threads), torch {m['torch']}"
             + (f", {m['gpu']}" if "gpu" in m else "") + (f", load {m['load_average'][0]:.2f}" if
                                                           "load_average" in m else ""),
             f"measured peak: matmul {pk['matmul_flops_per_second'] / 1e9:.1f} GFLOP/s ({pk['matmul_dtype']}), "
             f"copy {pk['copy_bytes_per_second'] / 1e9:.1f} GB/s",
             f"generation: {g['model']}, {g['dtype']}, batch {g['batch']}, prompt {g['prompt_length']}, "
             f"{g['canvases']} canvases x {g['steps']} steps (fixed), "
             f"{next(iter(g['results'].values()))['repeats']} repeats, medians"]
    cols = ("tokens_per_second", "tokens_per_forward", "ms_per_denoise_step", "ms_per_commit", "ms_prefill",
            "ms_to_first_canvas", "peak_memory_bytes")
    head = ["impl", "tok/s", "tok/fwd", "ms/step", "ms/commit", "ms prefill", "ms 1st canvas", "peak MB"]
    rows = [head]
    for name, res in g["results"].items():
        rows.append([name] + [_fmt(res[c] / 2**20 if c == "peak_memory_bytes" and res[c] else res[c],
                                   ".2f" if c == "tokens_per_forward" else ".1f") for c in cols])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    if g["ratios"]:
        lines.append("  tokens/s ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in g["ratios"].items()))
    b = g["bounds"]["denoise_step"]
    lines.append(f"  denoise-step bound at context {g['bound_context']}: compute {b['ms_compute_bound']:.2f} ms, "
                 f"memory {b['ms_memory_bound']:.2f} ms ({b['bytes'] / 1e6:.1f} MB); commit compute bound "
                 f"{g['bounds']['commit']['ms_compute_bound']:.2f} ms")
    if "training" in r:
        t = r["training"]
        lines.append(f"training: {t['preset']}, batch {t['batch']} x {t['seq_len']} tokens, {t['precision']}")
        for impl, res in t["results"].items():
            for obj in ("clean-context", "ar"):
                x = res[obj]
                lines.append(f"  {impl:9} {obj:13} {x['ms_per_step']:9.1f} ms/step  {x['tokens_per_second']:9.0f} "
                             f"tok/s  MFU {100 * x['mfu']:.1f}%")
    return "\n".join(lines)


def docs_entry(r: dict[str, Any], command: str) -> str:
    """A dated markdown section for docs/benchmarks.md."""
    m = r["machine"]
    load = f"{m['load_average'][0]:.2f}" if "load_average" in m else "?"
    load_after = f"{m['load_average_after'][0]:.2f}" if "load_average_after" in m else "?"
    return "\n".join([
        f"### {r['date']} — {r['generation']['model']}", "",
        f"- command: `{command}`",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads"
        + (f", {m['gpu']}" if "gpu" in m else "") + f"; torch {m['torch']}"
        + (f", transformers {m['transformers']}" if "transformers" in m else ""),
        f"- commit: `{r['commit']}`; 1-minute load average {load} before, {load_after} after",
        "", "```", format_report(r), "```", "",
    ])


def write_docs(r: dict[str, Any], command: str, path: str | os.PathLike[str] = "docs/benchmarks.md") -> Path:
    path = Path(path)
    if path.exists():
        before = fsio.read_text(path)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        before = ("# Benchmarks\n\nAppended by `dgemma bench --write-docs`; the top of dgemma/eval/bench.py says what "
                  "each number means.\n\n")
    fsio.write_text(path, before + docs_entry(r, command) + "\n")  # the whole file again: atomic, never half-appended
    return path


def to_json(r: dict[str, Any]) -> str:
    """Strict JSON: NaN (a number that was not measured) becomes null."""
    def clean(o: Any) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o if isinstance(o, (str, int, float, bool)) or o is None else str(o)
    return json.dumps(clean(r))


__all__ = ["BenchSettings", "format_report", "measure_bandwidth", "measure_matmul_peak", "run", "step_bounds",
           "training_flops", "write_docs"]
