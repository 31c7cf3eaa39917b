"""dgemma/sampling/fast_sampler.py against the readable loop: the denoise step (dynamic and static, and that
torch.compile takes the static one whole), the sync-free loop's decisions on scripted logits, its memory,
generate(impl="fast"), and generation from several threads on one model. No timing asserts."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dgemma.model.config import FULL, SLIDING, preset
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling import fast_sampler, kernels
from dgemma.sampling.fast_sampler import FastSampler
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import MIN_TEMPERATURE, GenerationConfig
from dgemma.sampling.sampler import denoise_canvas
from dgemma.testing.hf import randomize_
from tests.helpers import random_ids, random_model
from tests.sampling.live_tensors import LiveVocabTensors

TOL = 1e-4  # fp32 logits, fast vs readable


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_denoise_step_matches_denoise(static, padding):
    model = random_model("k8-of-16")
    V, L = model.config.vocab_size, model.config.canvas_length
    mask = torch.ones(2, 11, dtype=torch.long)
    if padding:
        mask[1, :3] = 0
    cache = model.new_cache(2, 11 + 2 * L)  # spare slots: the static step must mask them
    model.commit(random_ids(V, 2, 11, seed=9), cache, attention_mask=mask)
    canvas = random_ids(V, 2, L, seed=10)
    sc = torch.randn(2, L, V, generator=torch.Generator().manual_seed(11)) * 4
    step = fast_sampler.DenoiseStep(model, cache, static=static)
    for _ in range(2):  # before and after a second commit (the sliding window then cuts into the context)
        want = model.denoise(canvas, cache, self_conditioning_logits=sc)
        got = model.logits(step(canvas, model.soft_embedding(sc)))
        assert (got - want).abs().max() <= TOL
        assert (model.logits(step(canvas)) - model.denoise(canvas, cache)).abs().max() <= TOL
        model.commit(canvas, cache)


def test_denoise_step_compiles_whole():
    """torch.compile(fullgraph=True) takes the static step in one graph (traced by aot_eager: seconds, not minutes),
    and a new canvas position reuses it (the committed length is a device scalar, not a guard)."""
    if not hasattr(torch, "compile"):
        pytest.skip("no torch.compile")
    torch._dynamo.reset()
    model = randomize_(DiffusionGemma(preset("tiny").replace(num_hidden_layers=2, layer_types=(SLIDING, FULL),
                                                             num_experts=4)), 0).eval()
    V, L = model.config.vocab_size, model.config.canvas_length
    cache = model.new_cache(1, 11 + L)
    model.commit(random_ids(V, 1, 11, seed=12), cache)
    step = fast_sampler.DenoiseStep(model, cache, compile="aot_eager")
    canvas = random_ids(V, 1, L, seed=13)
    assert (model.logits(step(canvas)) - model.denoise(canvas, cache)).abs().max() <= TOL
    model.commit(canvas, cache)
    counters = torch._dynamo.utils.counters
    before = sum(counters["stats"].values())
    assert (model.logits(step(canvas)) - model.denoise(canvas, cache)).abs().max() <= TOL
    assert sum(counters["stats"].values()) == before or counters["stats"]["unique_graphs"] <= 1


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DGEMMA_TEST_INDUCTOR"), reason="inductor codegen takes minutes on 2 cores; "
                    "set DGEMMA_TEST_INDUCTOR=1")
def test_denoise_step_compiles_with_inductor():
    model = random_model("tiny")
    V, L = model.config.vocab_size, model.config.canvas_length
    cache = model.new_cache(1, 11 + L)
    model.commit(random_ids(V, 1, 11, seed=12), cache)
    try:
        step = fast_sampler.DenoiseStep(model, cache, compile=True)
        got = model.logits(step(random_ids(V, 1, L, seed=13)))
    except Exception as e:  # no C++ toolchain for inductor: not this code's failure
        if "compiler" in str(e).lower() or "InductorError" in type(e).__name__:
            pytest.skip(f"inductor unavailable: {e}")
        raise
    assert (got - model.denoise(random_ids(V, 1, L, seed=13), cache)).abs().max() <= TOL


# --- the sampler loop ---------------------------------------------------------------------------------------------

class _Scripted:
    """Stands in for the model in both sampler loops: pass i returns scripted logits (N, B, L, V)[i], whatever the
    canvas, so that both samplers see the same logits and their decisions can be compared one for one."""

    def __init__(self, script: torch.Tensor):
        self.script, self.calls = script, 0
        L, V = script.shape[2:]
        self.config = SimpleNamespace(canvas_length=L, vocab_size=V, sliding_window=4, time_embedding=False,
                                      observed_likelihood=False, hidden_size=3)
        self.embed_tokens = torch.nn.Embedding(V, 3)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def next(self) -> torch.Tensor:
        self.calls += 1
        return self.script[self.calls - 1].clone()

    def denoise(self, canvas: torch.Tensor, cache: object, **_: object) -> torch.Tensor:
        return self.next()


def _script(N: int, B: int, L: int, V: int) -> torch.Tensor:
    """Moderate logits with a spread of entropies; row b turns confident (near one-hot, stable) at step 3 + 3b."""
    g = torch.Generator().manual_seed(18)
    script = torch.randn(N, B, L, V, generator=g) * torch.linspace(0.5, 6.0, L)[:, None]
    target = torch.randint(0, V, (B, L), generator=g)
    for b in range(B):
        script[2 + 3 * b:, b] = 40.0 * F.one_hot(target[b], V)
    return script


@pytest.mark.parametrize("stop_rule", ["hf", "jax"])
@pytest.mark.parametrize("sync_every", [1, 3])
def test_fast_sampler_takes_the_reference_decisions(stop_rule, sync_every):
    N, B, L, V = 12, 3, 6, 16
    script = _script(N, B, L, V)
    config = GenerationConfig(max_denoising_steps=N, stop_rule=stop_rule)
    finished = torch.tensor([False, False, True])  # a row whose sequence already ended rides along uncounted
    cache = SimpleNamespace(batch_size=B)
    records: dict[str, list] = {"reference": [], "fast": []}
    ref_model, fast_model = _Scripted(script), _Scripted(script)
    want = denoise_canvas(ref_model, cache, config, generator=torch.Generator().manual_seed(0), finished=finished,
                          on_step=records["reference"].append)
    got = denoise_canvas(fast_model, cache, config, loop="sync-free", generator=torch.Generator().manual_seed(1),
                         finished=finished, on_step=records["fast"].append, sync_every=sync_every,
                         step=lambda x, soft, t: fast_model.next(),
                         head=lambda rows, out: rows.clone() if out is None else out.copy_(rows))
    ref, fast = records["reference"], records["fast"]
    assert len(ref) < N and len(fast) >= len(ref)  # every row stopped early; the fast loop may notice later
    for a, b in zip(ref, fast, strict=False):
        assert torch.equal(a.accepted, b.accepted), a.step
        assert torch.equal(a.argmax, b.argmax), a.step
        assert torch.equal(a.done, b.done), a.step
        assert torch.equal(a.active, b.active), a.step
        assert a.temperature == b.temperature
        torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-5)
    for name in ("steps", "passes", "tokens", "argmax"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.stop_reasons == want.stop_reasons
    assert want.steps.tolist() == [4, 7, 10]  # the script makes row b confident and stable from step 3 + 3b


class _TimedScripted(_Scripted):
    """A scripted time-embedding model: records the level each pass is told."""

    def __init__(self, script: torch.Tensor):
        super().__init__(script)
        self.config.time_embedding = True
        self.levels: list[torch.Tensor] = []

    def denoise(self, canvas: torch.Tensor, cache: object, t: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        self.levels.append(t)
        return self.next()


@pytest.mark.parametrize("time_level", ["canvas", "schedule"])
def test_fast_sampler_tells_a_time_embedding_model_the_reference_levels(time_level):
    """Both loops tell the model the same per-row level at every step (sampling.time_level: one rule, one home)."""
    N, B, L, V = 12, 3, 6, 16
    script = _script(N, B, L, V)
    config = GenerationConfig(max_denoising_steps=N, time_level=time_level)
    cache = SimpleNamespace(batch_size=B)
    ref_model, fast_model = _TimedScripted(script), _TimedScripted(script)
    denoise_canvas(ref_model, cache, config, generator=torch.Generator().manual_seed(0))

    def step(x, soft, t):
        fast_model.levels.append(t)
        return fast_model.next()

    denoise_canvas(fast_model, cache, config, loop="sync-free", generator=torch.Generator().manual_seed(1), step=step,
                   head=lambda rows, out: rows.clone() if out is None else out.copy_(rows))
    ref, fast = ref_model.levels, fast_model.levels
    assert len(ref) == len(fast) > 2
    for k, (a, b) in enumerate(zip(ref, fast, strict=True)):
        assert a.shape == (B,) and torch.equal(a, b), k
    assert torch.equal(ref[0], torch.ones(B)) and not torch.equal(ref[1], ref[2])  # moves with the canvas/schedule




@pytest.mark.parametrize("self_conditioning", ["off", "on"])
def test_self_conditioning_off_feeds_no_pass_in_either_loop_and_they_draw_the_same_tokens(self_conditioning):
    """`self_conditioning="off"` on a real model: neither loop hands any pass a self-conditioning input (the readable
    loop's logits, the fast loop's soft embedding), and the two take the same steps to the same tokens. At a
    constant temperature of MIN_TEMPERATURE (t_min = t_max) every draw is the argmax and an entropy bound of 100
    accepts every position, so the loops' different random draws (multinomial, inverse CDF) cannot tell them apart;
    with "on" both feed every pass after the first, which is what "off" must not do."""
    model = random_model("tiny")
    B, L, V = 2, model.config.canvas_length, model.config.vocab_size
    prompt, canvas = random_ids(V, B, 11, seed=21), random_ids(V, B, L, seed=22)
    config = GenerationConfig(max_denoising_steps=6, t_min=MIN_TEMPERATURE, t_max=MIN_TEMPERATURE,
                              entropy_bound=100.0, self_conditioning=self_conditioning)
    runs = {}
    for loop in ("readable", "sync-free"):
        cache = model.new_cache(B, 11 + L)
        model.commit(prompt, cache, impl="fast")
        fed, records = [], []
        inner = fast_sampler.DenoiseStep(model, cache)  # the fast loop's pass; the readable loop's is denoise

        def step(x, sc, t, cache=cache, fed=fed, inner=inner, loop=loop):  # records what each pass is handed
            fed.append(sc)
            return model.denoise(x, cache, self_conditioning_logits=sc, t=t, impl="fast") if loop == "readable" \
                else inner(x, sc, t)
        staged = denoise_canvas(model, cache, config, loop=loop, generator=torch.Generator().manual_seed(3),
                                canvas=canvas, on_step=records.append, step=step)
        runs[loop] = staged, fed, records
    (want, ref_fed, ref), (got, fast_fed, fast) = runs["readable"], runs["sync-free"]
    assert len(ref) == len(fast) >= 2
    for a, b in zip(ref, fast, strict=True):
        assert torch.equal(a.input_canvas, b.input_canvas), a.step
        assert torch.equal(a.argmax, b.argmax) and torch.equal(a.accepted, b.accepted), a.step
        assert torch.equal(a.done, b.done), a.step
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.steps, want.steps)
    for fed in (ref_fed, fast_fed):
        assert fed[0] is None  # the first pass of a canvas reads none either way (initial_self_conditioning zeros)
        assert all((x is None) == (self_conditioning == "off") for x in fed[1:])


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_fast_sampler_memory_is_two_chunks_of_logits(chunk_rows):
    """The fast loop never holds (B, L, V) logits from one step to the next: per step, a chunk of logits and one of
    probabilities (the workspace), so memory is bounded by the chunk, not by the batch."""
    model = random_model("tiny")
    B, L, V = 2, model.config.canvas_length, model.config.vocab_size
    cache = model.new_cache(B, 11)
    model.commit(random_ids(V, B, 11, seed=20), cache)
    rows = chunk_rows or B * L
    with LiveVocabTensors(V, {p.untyped_storage().data_ptr() for p in model.parameters()}) as mode:
        denoise_canvas(model, cache, GenerationConfig(max_denoising_steps=3), loop="sync-free", chunk_rows=chunk_rows,
                       generator=torch.Generator().manual_seed(0))
    assert mode.peak <= 2 * rows * V * 4, f"peak {mode.peak / (rows * V * 4):.2f} chunks"


# --- generate ---------------------------------------------------------------------------------------------------------

def test_generate_fast_runs_and_never_touches_the_model():
    model = random_model("tiny")
    prompt = random_ids(500, 2, 11, seed=19)
    a = generate(model, prompt, seed=0, impl="fast", max_new_tokens=32, max_denoising_steps=3, trace=True)
    b = generate(model, prompt, seed=0, impl="fast", max_new_tokens=32, max_denoising_steps=3)
    assert model.impl == "reference"
    assert torch.equal(a.sequences, b.sequences)  # seeded: reproducible
    assert a.sequences.shape == (2, 11 + 32) and a.trace is not None and len(a.trace.steps) == 6
    ref = generate(model, prompt, seed=0, max_new_tokens=32, max_denoising_steps=3)
    assert a.steps_per_canvas == ref.steps_per_canvas and torch.equal(a.tokens_per_forward, ref.tokens_per_forward)
    with pytest.raises(ValueError, match="compile"):
        generate(model, prompt, compile=True)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_generate_from_several_threads_on_one_model(impl):
    """generate never modifies the model: concurrent calls on one model (each with its own cache, as a server would
    make them) give what the same calls give one after another."""
    from concurrent.futures import ThreadPoolExecutor

    model = random_model("tiny")
    prompts = [random_ids(500, 1, 5 + i, seed=30 + i) for i in range(4)]
    run = lambda i: generate(model, prompts[i], seed=i, impl=impl, max_new_tokens=32, max_denoising_steps=3)
    alone = [run(i).sequences for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = [r.sequences for r in pool.map(run, range(4))]
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    assert model.impl == "reference"


# --- CUDA-only paths: run on a machine with a GPU (`pytest -m gpu`); skipped elsewhere ----------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_grouped_mm_bf16_experts_match_the_loop_on_cuda():
    from dgemma.model import kernels
    from dgemma.model.layers import Experts

    config = preset("tiny").replace(num_experts=16, top_k_experts=4, hidden_size=128, moe_intermediate_size=64)
    experts = randomize_(Experts(config), seed=1).to("cuda", torch.bfloat16)
    x = torch.randn(64, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    probs = torch.softmax(torch.randn(64, 16, device="cuda"), -1)
    weights, ids = probs.topk(4, -1)
    with torch.no_grad():
        assert kernels._grouped_mm_available(x, experts.gate_up_proj, experts.down_proj)
        grouped = kernels.moe_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, backend="grouped")
        loop = kernels.moe_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, backend="loop")
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("sync_every", [1, 4])
def test_fast_loop_on_cuda_takes_the_reference_step_counts(sync_every):
    model = random_model("tiny").to("cuda")
    prompt = random_ids(500, 2, 11, seed=40).cuda()
    config = dict(max_new_tokens=32, max_denoising_steps=6, confidence_threshold=10.0)
    ref = generate(model, prompt, seed=0, **config)
    cache = model.new_cache(2, 11 + 16)
    model.commit(prompt, cache, impl="fast")
    staged = denoise_canvas(model, cache, GenerationConfig(**config), loop="sync-free", sync_every=sync_every,
                            generator=torch.Generator("cuda").manual_seed(0))
    assert staged.steps.tolist() == ref.steps_per_canvas[0]


@pytest.mark.gpu
@cuda
def test_cuda_graph_denoise_step_matches_denoise():
    model = random_model("tiny").to("cuda")
    V, L = model.config.vocab_size, model.config.canvas_length
    cache = model.new_cache(1, 11 + L)
    model.commit(random_ids(V, 1, 11, seed=12).cuda(), cache)
    step = fast_sampler.DenoiseStep(model, cache, compile=True)
    canvas = random_ids(V, 1, L, seed=13).cuda()
    for _ in range(3):  # capture, then replays
        got = model.logits(step(canvas).clone())
    assert (got - model.denoise(canvas, cache)).abs().max() <= TOL


@pytest.mark.parametrize("per_pass", [3, 2, 1])
def test_samplers_stepped_together_take_the_steps_they_take_alone(per_pass):
    """`step_together` (the serving engine's fast rows): one head pass over several one-row samplers, each with its
    own temperature (they are at different steps) and generator, gives each exactly what its own `step` gives,
    whether the shared workspace takes all the rows in one pass or in groups (`per_pass` canvases)."""
    model = random_model("tiny")
    L, D, V = model.config.canvas_length, model.config.hidden_size, model.config.vocab_size
    configs = [GenerationConfig(max_denoising_steps=n, entropy_bound=b, self_conditioning=sc)
               for n, b, sc in ((4, 0.5, "on"), (6, 2.0, "on"), (3, 0.1, "off"))]  # one row feeds nothing back

    def samplers(workspace=None):
        return [fast_sampler.FastSampler(model, c, 1, generator=torch.Generator().manual_seed(i), workspace=workspace)
                for i, c in enumerate(configs)]

    workspace = kernels.Workspace(per_pass * L, V, torch.device("cpu"))
    alone, together = samplers(), samplers(workspace)
    for s in together[1:]:  # start the others a step in, so the rows sit at different temperatures
        s.inputs()
        s.step(torch.randn(1, L, D, generator=torch.Generator().manual_seed(5)))
    for s in alone[1:]:
        s.inputs()
        s.step(torch.randn(1, L, D, generator=torch.Generator().manual_seed(5)))
    for step in range(2):
        final = torch.randn(3, L, D, generator=torch.Generator().manual_seed(10 + step)) * 2
        for s in (*alone, *together):
            s.inputs()
        for i, s in enumerate(alone):
            s.step(final[i:i + 1])
        assert all(s.batchable(L) for s in together)
        existing = {t.untyped_storage().data_ptr() for t in (workspace.logits, workspace.probs, *model.parameters())}
        with LiveVocabTensors(V, existing) as mode:
            FastSampler.step_together(together, final)
        assert mode.peak == 0  # every pass in the shared workspace: no (rows, V) buffer of its own
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a.state.x, b.state.x) and torch.equal(a.state.argmax, b.state.argmax)
            assert torch.equal(a.entropy, b.entropy) and a.remaining == b.remaining
            assert (a.soft is None) == (b.soft is None) and (a.soft is None or torch.equal(a.soft, b.soft))
        assert together[2].soft is None and together[1].soft is not None
