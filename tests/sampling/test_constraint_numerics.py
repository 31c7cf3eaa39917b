"""The grammar's masked draw at every temperature, truncation and bias (dgemma/sampling/constraint.py `_walk`):
temperature 0 draws the allowed argmax; where top_k/top_p/min_p cut every token the grammar allows, the draw is the
masked distribution of the unfiltered logits; through `generate` with both kernel sets, the serving engine and the
CLI."""

from __future__ import annotations

import json
import queue

import pytest
import torch

from dgemma import cli, generate
from dgemma.data.tokenizer import build_test_tokenizer, load_tokenizer
from dgemma.sampling.constraint import Constraint
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.engine import CanvasEvent, DoneEvent, Engine
from tests.helpers import random_model

llguidance = pytest.importorskip("llguidance")

EOS = 1
GREEDY = dict(t_min=0.0, t_max=1e-6)  # the server's temperature 0 (api.scaled_schedule)


@pytest.fixture(scope="module")
def model():
    return random_model("tiny")


def _one(tok, text: str) -> int:
    (t,) = tok.encode(text, add_special_tokens=False)
    return t


def settings(tok) -> dict[str, dict]:
    """What the audit sent: greedy, truncations that keep one token, and a bias of -100 on the tokens a JSON object
    must start with (so that the grammar's allowed set is what the bias pushes down)."""
    bias = {_one(tok, "{"): -100, _one(tok, '"'): -100, _one(tok, "}"): -100}
    return {"temperature 0": GREEDY, "top_k 1": dict(top_k=1), "top_p 0.01": dict(top_p=0.01),
            "min_p 0.99": dict(min_p=0.99), "bias -100": dict(logit_bias=bias),
            "bias -100, temperature 0, top_k 1": dict(logit_bias=bias, top_k=1, **GREEDY)}


def constraints(tok) -> dict[str, Constraint]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    return {"json_object": Constraint.json_object(tok, eos_token_id=EOS),
            "json_schema": Constraint.json_schema(schema, tok, eos_token_id=EOS)}


def _valid(tok, ids: list[int]) -> dict:
    return json.loads(tok.decode([t for t in ids if t != EOS]))


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
@pytest.mark.parametrize("sampler", ["entropy-bound", "lite"])
def test_a_grammar_draws_under_greedy_truncated_and_biased_sampling(model, tok, impl, kind, sampler):
    """Temperature 0 (and a truncation or a bias that leaves the allowed tokens nothing) failed with numpy's
    `ndarray - Tensor` TypeError in the masked draw's underflow fallback (a 500 from the server)."""
    c = constraints(tok)[kind]
    prompt = torch.randint(5, 500, (2, 5), generator=torch.Generator().manual_seed(0))
    for name, kw in settings(tok).items():
        out = generate(model, prompt, seed=0, max_new_tokens=40, max_denoising_steps=3, constraint=c,
                       eos_token_id=EOS, impl=impl, sampler=sampler, **kw)
        assert out.constraint_complete == [True, True], name
        assert all(isinstance(_valid(tok, ids), dict) for ids in out.new_tokens()), name


def test_greedy_is_the_allowed_argmax_and_a_total_cut_draws_from_the_unfiltered_logits(tok):
    """One position that allows a, b or c. At temperature 0 the draw is the allowed argmax (the unmasked argmax is
    forbidden); where the filter cut a, b and c, the draw follows softmax of their unfiltered logits."""
    ids = [_one(tok, w) for w in "abc"]
    state = Constraint.regex("a|b|c", tok, eos_token_id=EOS).start(1)
    z = torch.zeros(1, 1, 512)
    z[0, 0, ids] = torch.tensor([0.0, 1.0, 2.0])
    z[0, 0, 7] = 9.0  # the most likely token overall is not allowed
    g = torch.Generator().manual_seed(0)
    draw, greedy, entropy, _ = state.draw(z / 1e-6, g)  # temperature 0: every p of an allowed token is 0.0
    assert int(draw[0, 0]) == int(greedy[0, 0]) == ids[2] and float(entropy[0, 0]) == 0.0
    cut = torch.full_like(z, -torch.inf)
    cut[0, 0, 7] = 9.0  # top_k 1: only the forbidden token is left
    counts = torch.zeros(3)
    for _ in range(2000):
        draw, greedy, entropy, _ = state.draw(cut, g, unfiltered=z)
        counts[ids.index(int(draw[0, 0]))] += 1
    want = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    assert torch.allclose(counts / counts.sum(), want, atol=0.04)
    assert int(greedy[0, 0]) == ids[2]
    assert float(entropy[0, 0]) == pytest.approx(float(-(want * want.log()).sum()), rel=1e-5)
    out, _ = state.project(torch.tensor([[7]]), cut, unfiltered=z)  # a proposal the grammar forbids
    assert int(out[0, 0]) == ids[2]


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_the_engine_serves_greedy_and_truncated_grammar_requests(model, tok, impl):
    base = GenerationConfig.for_model(model.config).replace(max_denoising_steps=3, eos_token_id=(EOS,),
                                                            max_new_tokens=32)
    with Engine(model, max_batch=4, max_context=256, impl=impl) as engine:
        for kind, c in constraints(tok).items():
            for name, kw in settings(tok).items():
                events: queue.Queue = queue.Queue()
                engine.submit([5, 6, 7], base.replace(**kw), seed=0, on_event=events.put, constraint=c)
                tokens, done = [], None
                while done is None:
                    e = events.get(timeout=120)
                    tokens += e.tokens if isinstance(e, CanvasEvent) else []
                    done = e if isinstance(e, DoneEvent) else None
                assert done.finish_reason == "stop", (kind, name, done.error)
                assert isinstance(_valid(tok, tokens), dict), (kind, name)


@pytest.mark.parametrize("kind", ["--json-object", "--json-schema"])
@pytest.mark.parametrize("flags", [["--top-k", "1"], ["--t-min", "0", "--t-max", "1e-6"], ["--top-p", "0.01"],
                                   ["--min-p", "0.99"], ["--logit-bias", "95=-100,6=-100"]])
def test_the_cli_generates_under_a_grammar_with_greedy_and_truncated_sampling(tmp_path, capsys, kind, flags):
    path = tmp_path / "tokenizer.json"
    build_test_tokenizer(512, path)
    assert [_one(load_tokenizer(path), s) for s in '{"'] == [95, 6]  # the ids the bias names
    grammar = [kind]
    if kind == "--json-schema":
        (tmp_path / "s.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"], "additionalProperties": False}))
        grammar.append(str(tmp_path / "s.json"))
    code = cli.main(["generate", "--preset", "tiny", "--random-init", "--tokenizer", str(path), "--prompt",
                     "A person:", *grammar, "--seed", "0", "--max-new-tokens", "32",
                     "--max-denoising-steps", "3", *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert isinstance(json.loads(out.out.strip().splitlines()[0]), dict)
