"""The committing samplers (issue 24): block refinement (diffusers' BlockRefinementScheduler in its uniform mode, with
and without editing) and confidence-threshold parallel decoding (Fast-dLLM). Their rules on hand-built tensors, then
the whole readable loop on a real tiny model: what commits stays (unless edited), how many commit a step, when a
canvas stops, and the settings' errors."""

from __future__ import annotations

import pytest
import torch

from dgemma import generate
from dgemma.eval.viz import CHANGES, step_changes
from dgemma.model.config import ConfigError
from dgemma.sampling import rules as S
from dgemma.sampling.generation_config import GenerationConfig
from tests.helpers import random_model, traced_cli_settings


def test_threshold_commits_take_every_confident_position_and_the_quota():
    confidence = torch.tensor([[0.99, 0.2, 0.5, 0.97, 0.1], [0.3, 0.4, 0.2, 0.1, 0.0]])
    committed = torch.tensor([[True, False, False, False, False], [False] * 5])
    new = S.threshold_commits(confidence, committed, 0.95, torch.tensor([1, 2]))
    # row 0: 0.97 passes the threshold (0.99 is committed already) and is also the quota's one most confident;
    # row 1: none passes, so the quota's two most confident commit
    assert new.tolist() == [[False, False, False, True, False], [True, True, False, False, False]]
    assert not (new & committed).any()  # only open positions commit
    none_by_threshold = S.threshold_commits(confidence, committed, 1.0, torch.tensor([0, 0]))
    assert not none_by_threshold.any()  # no probability exceeds 1, and no quota
    every = S.threshold_commits(confidence, committed, 0.0, torch.tensor([0, 0]))
    assert every.tolist() == [[False, True, True, True, True], [True, True, True, True, False]]  # > 0 strictly


def test_edits_change_only_committed_positions_the_model_is_sure_of():
    draw = torch.tensor([[5, 6, 7, 8]])
    canvas = torch.tensor([[5, 1, 2, 3]])
    committed = torch.tensor([[True, True, True, False]])
    confidence = torch.tensor([[0.99, 0.99, 0.5, 0.99]])
    assert S.edits(draw, canvas, committed, confidence, 0.9).tolist() == [[False, True, False, False]]
    assert not S.edits(draw, canvas, committed, confidence, None).any()  # editing off


def test_a_committing_sampler_stops_once_every_position_is_committed():
    config = GenerationConfig(sampler="confidence")
    state = S.StopState()
    committed = torch.tensor([[True, True], [True, False]])
    entropy = torch.tensor([5.0, 0.0])  # entropy does not enter
    assert S.stop_rows(config, state, committed.long(), committed.long(), entropy, committed).tolist() == [True, False]


def _prompt() -> torch.Tensor:
    return torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(1))


def _committed_per_step(trace):
    return [info.accepted.sum(-1).tolist() for info in trace.steps]


@pytest.mark.parametrize("threshold, steps", [(1.0, None), (0.0, 1)])
def test_confidence_commits_at_least_one_a_step_and_stops_when_all_are_in(threshold, steps):
    """commit_threshold 1 (no probability exceeds it): exactly one position a step, so a canvas of L takes L steps;
    0: every position at the first step."""
    model = random_model("tiny")
    L = model.config.canvas_length
    out = generate(model, _prompt(), seed=0, max_new_tokens=L, sampler="confidence", commit_threshold=threshold,
                   max_denoising_steps=2 * L, trace=True)
    want = L if steps is None else steps
    assert out.steps_per_canvas == [[want, want]]
    assert out.stop_reasons == [["committed", "committed"]]
    assert _committed_per_step(out.trace)[-1] == [L, L]
    if steps is None:
        assert _committed_per_step(out.trace) == [[k, k] for k in range(1, L + 1)]


def test_block_refinement_commits_its_quota_and_committed_tokens_stay():
    """Threshold 1: exactly ceil(L k / N) committed after step k, all L at step N; a committed token is the input of
    every later step and the output."""
    model = random_model("tiny")
    L, N = model.config.canvas_length, 5
    out = generate(model, _prompt(), seed=0, max_new_tokens=L, sampler="block-refinement", commit_threshold=1.0,
                   max_denoising_steps=N, trace=True)
    assert _committed_per_step(out.trace) == [[-(-L * k // N)] * 2 for k in range(1, N + 1)]
    steps = out.trace.steps
    final = torch.tensor(out.new_tokens())
    for k in range(N):
        was = steps[k].accepted  # committed after step k: the input of every later step, and the output
        for j in range(k + 1, N):
            assert torch.equal(steps[j].input_canvas[was], steps[k + 1].input_canvas[was])
        if k + 1 < N:
            assert torch.equal(final[was], steps[k + 1].input_canvas[was])
    assert out.stop_reasons == [["committed", "committed"]]


def test_editing_lets_committed_tokens_change():
    """With an edit threshold every committed position whose new draw differs (at any probability above it) takes
    it; without, none does. On a random model at temperature ~1 the draws differ often."""
    model = random_model("tiny")
    L, N = model.config.canvas_length, 6

    def changed(edit):
        out = generate(model, _prompt(), seed=0, max_new_tokens=L, sampler="block-refinement",
                       commit_threshold=1.0, max_denoising_steps=N, trace=True, edit_threshold=edit, t_min=0.9,
                       t_max=1.0)
        steps = out.trace.steps
        edits = sum(int((steps[k].accepted & (steps[k + 1].input_canvas != steps[k].input_canvas)
                         & steps[k - 1].accepted).sum()) for k in range(1, N - 1))
        # the player marks exactly these (dgemma viz: "changed while accepted")
        assert int((step_changes(out.trace.arrays()) == CHANGES.index("changed while accepted")).sum()) == edits
        return edits

    assert changed(None) == 0
    assert changed(1e-12) > 0


@pytest.mark.parametrize("field, value, message", [
    ("commit_threshold", 1.5, "commit_threshold: must be a probability in [0, 1], got 1.5"),
    ("edit_threshold", 0.0, "edit_threshold: must be None (no editing) or a probability in (0, 1], got 0.0"),
    ("sampler", "fast-dllm", "sampler: must be one of 'entropy-bound', 'lite', 'ancestral', 'predictor-corrector', "
                             "'block-refinement', 'confidence', got 'fast-dllm'"),
])
def test_bad_settings_are_one_error_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        GenerationConfig(**{field: value})


def test_the_cli_and_the_server_take_the_samplers_and_their_thresholds(tmp_path, capsys):
    """`--sampler block-refinement --commit-threshold --edit-threshold` reach the sampler (its trace records them);
    the server's request body takes the same fields, and a bad one is a 400 naming it; the CLI's is one line."""
    from dgemma.cli import main
    from dgemma.serving.api import APIError, parse_completion_request

    summary = traced_cli_settings(tmp_path, capsys, "--max-denoising-steps", "4", "--sampler", "block-refinement",
                                  "--commit-threshold", "0.5", "--edit-threshold", "0.99")
    assert (summary["sampler"], summary["commit_threshold"], summary["edit_threshold"]) == \
        ("block-refinement", 0.5, 0.99)
    request = lambda body: parse_completion_request({"prompt": [1, 2], **body}, tokenizer=None,
                                                    base_config=GenerationConfig(), model_name="tiny")
    config = request({"sampler": "confidence", "commit_threshold": 0.8}).submissions[0].config
    assert (config.sampler, config.commit_threshold, config.edit_threshold) == ("confidence", 0.8, None)
    with pytest.raises(APIError, match=r"edit_threshold: must be None \(no editing\) or a probability") as e:
        request({"sampler": "block-refinement", "edit_threshold": 2})
    assert e.value.status == 400 and e.value.param == "edit_threshold"
    rc = main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "1,2", "--commit-threshold", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["dgemma generate: error: commit_threshold: must be a probability in [0, 1], got -1.0"]
