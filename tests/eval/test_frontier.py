"""dgemma.eval.frontier: the sampler grid of `dgemma eval` (--sampler-grid), its points, their counts and report."""

from __future__ import annotations

import json

import pytest
import torch

import dgemma
from dgemma.eval.decoding import run_sampler
from dgemma.eval.frontier import ALL, frontier_points, parse_sampler_grid
from dgemma.sampling.generation_config import SAMPLERS, GenerationConfig
from dgemma.train.heldout import EvalError


def test_a_spec_is_a_sampler_and_the_product_of_its_fields():
    points = parse_sampler_grid("block-refinement:commit_threshold=0.9/0.7, edit_threshold=none/0.95")
    assert points == [{"sampler": "block-refinement", "commit_threshold": c, "edit_threshold": e}
                      for c in (0.9, 0.7) for e in (None, 0.95)]
    assert parse_sampler_grid("ancestral") == [{"sampler": "ancestral"}]
    assert parse_sampler_grid("lite:adaptive=false,time_level=schedule") == [
        {"sampler": "lite", "adaptive": False, "time_level": "schedule"}]
    assert parse_sampler_grid("predictor-corrector:corrector_steps=2,max_denoising_steps=8") == [
        {"sampler": "predictor-corrector", "corrector_steps": 2, "max_denoising_steps": 8}]


def test_the_bounded_chain_is_a_grid_point_labelled_with_its_nelbo():
    """The ancestral chain the NELBO bounds (temperature 1 throughout, no self-conditioning) is one spec away; its
    row says which likelihood describes it, the default ancestral sampler's says none (families.chain_likelihood)."""
    from dgemma.sampling.families import chain_likelihood

    spec = "ancestral:t_min=1,t_max=1,self_conditioning=off,max_denoising_steps=16"
    assert parse_sampler_grid(spec) == [{"sampler": "ancestral", "t_min": 1, "t_max": 1, "self_conditioning": "off",
                                         "max_denoising_steps": 16}]
    chain, default = frontier_points((4,), (0.1,), [spec, "ancestral"])[1:]
    assert chain.label == "ancestral N=16 t_min=1 t_max=1 self_conditioning=off"
    base = GenerationConfig()
    assert chain_likelihood(base.replace(**chain.overrides)) == "NELBO at T=16"
    assert chain_likelihood(base.replace(**default.overrides)) is None
    with pytest.raises(EvalError, match=r"self_conditioning: must be one of 'on', 'off', got 'no'"):
        parse_sampler_grid("ancestral:self_conditioning=no")


@pytest.mark.parametrize("spec, message", [
    ("greedy", "unknown sampler 'greedy'"),
    ("confidence:threshold=0.9", "unknown field 'threshold'"),
    ("confidence:commit_threshold", "'commit_threshold' is not FIELD=VALUE"),
    ("confidence:commit_threshold=", "is not FIELD=VALUE"),
    ("confidence:commit_threshold=0.9,commit_threshold=0.5", "commit_threshold given twice"),
    ("confidence:max_new_tokens=8", "max_new_tokens is shared by every point"),
    ("confidence:commit_threshold=0.9/2", "commit_threshold: must be a probability in [0, 1], got 2"),
    ("ancestral:max_denoising_steps=0", "max_denoising_steps: must be a positive int, got 0"),
    ("lite:time_level=sometimes", "time_level: must be one of"),
])
def test_a_bad_spec_is_one_error_naming_it(spec, message):
    with pytest.raises(EvalError) as e:
        parse_sampler_grid(spec)
    assert f"--sampler-grid {spec!r}" in str(e.value) and message in str(e.value)


def test_no_grid_point_runs_more_model_passes_than_the_cap(capsys):
    """Corrector passes count: `--sampler-grid predictor-corrector:corrector_steps=100000` (400,004 model passes a
    canvas at N=4; it used to run unbounded) and a step grid over the cap are refused by `dgemma eval` in one line,
    exit 2, before anything loads."""
    from dgemma import cli

    with pytest.raises(EvalError, match=r"--sampler-grid 'predictor-corrector:corrector_steps=100000': "
                                        r"predictor-corrector N=4 corrector_steps=100000: corrector_steps: "
                                        r"max_denoising_steps=4 x \(1 \+ corrector_steps=100000\) make 400,004 model "
                                        r"passes a canvas; at most 1024 in dgemma eval"):
        frontier_points((4,), (0.1,), ["predictor-corrector:corrector_steps=100000"])
    with pytest.raises(EvalError, match=r"--max-denoising-steps-grid: entropy-bound N=2048 eb=0\.1: "
                                        r"max_denoising_steps: at most 1024 in dgemma eval, got 2048"):
        frontier_points((2048,), (0.1,), [])
    assert len(frontier_points((512,), (0.1,), ["predictor-corrector:corrector_steps=1"])) == 2  # 1024: at the cap
    status = cli.main(["eval", "--model", "nowhere", "--data", "nowhere", "--out", "nowhere",
                       "--sampler-grid", "predictor-corrector:corrector_steps=100000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("dgemma eval: error: --sampler-grid") and \
        "400,004 model passes a canvas" in err[0], err


def test_the_frontier_is_the_entropy_bound_grid_then_each_spec_over_the_step_grid():
    points = frontier_points((4, 8), (0.1,), ["confidence:commit_threshold=0.9/0.5,max_denoising_steps=16",
                                             "ancestral"])
    assert [p.label for p in points] == [
        "entropy-bound N=4 eb=0.1", "entropy-bound N=8 eb=0.1",
        "confidence N=16 commit_threshold=0.9", "confidence N=16 commit_threshold=0.5",
        "ancestral N=4", "ancestral N=8"]
    assert [p.fixed_twin for p in points] == [True, True, False, False, False, False]
    assert [p.group for p in points] == ["entropy-bound eb=0.1"] * 2 + \
        ["confidence:commit_threshold=0.9/0.5,max_denoising_steps=16"] * 2 + ["ancestral"] * 2
    assert [p.trace_name for p in points] == ["N4_eb0p1", "N8_eb0p1", "confidence_N_16_commit_threshold_0p9",
                                              "confidence_N_16_commit_threshold_0p5", "ancestral_N_4", "ancestral_N_8"]
    every = frontier_points((4,), (0.1,), ["all"])
    assert [p.overrides["sampler"] for p in every] == ["entropy-bound", *ALL] and set(ALL) | {"entropy-bound"} == \
        set(SAMPLERS)
    with pytest.raises(EvalError, match=r"N=4 entropy_bound=0\.1 is the setting entropy-bound N=4 eb=0\.1 again"):
        frontier_points((4,), (0.1,), ["entropy-bound:entropy_bound=0.1"])


@pytest.fixture(scope="module")
def tiny():
    return dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()


@pytest.mark.parametrize("correctors", [1, 2])
def test_a_corrector_pass_is_counted_as_a_forward(tiny, correctors):
    """The predictor-corrector chain runs N predictor passes and N x corrector_steps corrector passes a canvas, plus
    its commit: tokens per forward counts them all, so a corrector cannot look cheaper than it is."""
    L, N = tiny.config.canvas_length, 3
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7)]
    cfg = GenerationConfig(max_new_tokens=2 * L, max_denoising_steps=N, sampler="predictor-corrector",
                           corrector_steps=correctors)
    run = run_sampler(tiny, prompts, cfg, progress=False)
    canvases = 2 * 2
    assert run.denoise_passes == canvases * N * (1 + correctors) and run.commit_passes == canvases
    assert run.tokens_per_forward == pytest.approx(L / (N * (1 + correctors) + 1))


def test_dgemma_eval_puts_every_spec_on_the_frontier(tiny_run, tiny_data, tmp_path):
    from dgemma.cli import main

    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    grids = ["confidence:commit_threshold=0.9/0.3,max_denoising_steps=4", "predictor-corrector:max_denoising_steps=2",
             "ancestral:t_min=1,t_max=1,self_conditioning=off,max_denoising_steps=2"]  # the bounded chain
    rc = main(["eval", "--model", str(tiny_run), "--data", str(tiny_data), "--out", str(out), "--prompts", "2",
               "--max-denoising-steps-grid", "2", "--entropy-bounds", "0.5", "--max-windows", "2", "--quiet",
               *[x for g in grids for x in ("--sampler-grid", g)]])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    frontier = report["frontier"]
    chain = "ancestral N=2 t_min=1 t_max=1 self_conditioning=off"
    assert [f["label"] for f in frontier] == ["entropy-bound N=2 eb=0.5", "confidence N=4 commit_threshold=0.9",
                                              "confidence N=4 commit_threshold=0.3", "predictor-corrector N=2", chain]
    assert [f["sampler"] for f in frontier] == ["entropy-bound", "confidence", "confidence", "predictor-corrector",
                                                "ancestral"]
    # every row says which likelihood describes its samples: only the bounded chain has one
    assert [f["likelihood"] for f in frontier] == ["none"] * 4 + ["NELBO at T=2"]
    assert frontier[0]["fixed"] is not None and all(f["fixed"] is None for f in frontier[1:])
    # a lower threshold commits at least as many positions a pass; the corrector pays two passes a step
    assert frontier[2]["adaptive"]["tokens_per_forward"] >= frontier[1]["adaptive"]["tokens_per_forward"]
    assert frontier[3]["adaptive"]["tokens_per_forward"] == pytest.approx(16 / (2 * 2 + 1))
    md = (out / "report.md").read_text()
    for f in frontier:
        assert f"| {f['label']} |" in md and f"**{f['label']}:**" in md
        assert f"| {f['label']} | {f['likelihood']} |" in md  # the likelihood table
    assert report["command"].count("--sampler-grid") == 3 and grids[0] in report["command"]
    assert sorted(p.stem for p in (out / "traces").glob("*.json")) == sorted(
        ["N2_eb0p5", "confidence_N_4_commit_threshold_0p9", "confidence_N_4_commit_threshold_0p3",
         "predictor_corrector_N_2", "ancestral_N_2_t_min_1_t_max_1_self_conditioning_off"])


def test_dgemma_eval_refuses_a_bad_spec_in_one_line(tiny_run, tiny_data, tmp_path, capsys):
    from dgemma.cli import main

    rc = main(["eval", "--model", str(tiny_run), "--data", str(tiny_data), "--out", str(tmp_path / "r"), "--quiet",
               "--sampler-grid", "confidence:commit_treshold=0.9"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown field 'commit_treshold'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()
