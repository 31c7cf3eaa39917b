"""Scoring on /v1/completions (`echo: true`, `max_tokens: 0`; max_tokens 1, lm-eval's request:
tests/serving/test_serve_lm_eval.py): a real server and the real `openai` client against
`likelihood.score_continuation`, which is pinned to the NELBO `dgemma eval` and training's curves compute
(`likelihood.window_nelbo` of the clean-context posterior); refusals name
their field; docs/serving.md's example runs."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from openai import OpenAI

from dgemma.diffusion.likelihood import clean_context_posterior, score_continuation, window_nelbo
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.app import create_app
from dgemma.serving.engine import Engine
from tests.helpers import random_init_model, running_server

KEY = "sk-test"


@pytest.fixture(scope="module")
def model():
    return random_init_model()


@pytest.fixture(scope="module")
def server(model, tok):
    with Engine(model, max_batch=2, max_context=256, impl="reference") as engine, \
            running_server(create_app(engine, tok, "tiny", api_key=KEY,
                                      generation_config=GenerationConfig.for_model(model.config))) as url:
        yield url


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_score_is_the_eval_nelbo_per_token_and_a_context_changes_it(model):
    L = model.config.canvas_length
    x = torch.randint(0, model.config.vocab_size, (1, 2 * L), generator=torch.Generator().manual_seed(1))
    terms = score_continuation(model, [], x[0].tolist(), num_steps=8, num_t_samples=3, seed=5)
    with torch.no_grad():
        want = window_nelbo(clean_context_posterior(model), x, canvas_length=L, vocab_size=model.config.vocab_size,
                            num_steps=8, num_t_samples=3, generator=torch.Generator().manual_seed(5))
    assert terms.shape == (2 * L,) and bool((terms > 0).all())
    assert torch.allclose(terms.view(2, L).sum(-1), want.nelbo[0], rtol=1e-12)
    assert torch.equal(terms, score_continuation(model, [], x[0].tolist(), num_steps=8, num_t_samples=3, seed=5))
    part = score_continuation(model, [7, 8, 9], x[0, :5].tolist(), num_steps=None, num_t_samples=2, seed=5)
    assert part.shape == (5,) and torch.isfinite(part).all()
    assert not torch.equal(part, score_continuation(model, [1, 7, 8, 9], x[0, :5].tolist(), num_steps=None,
                                                    num_t_samples=2, seed=5))
    with pytest.raises(ValueError, match="continuation"):
        score_continuation(model, [1], [], num_steps=8, num_t_samples=2)


def test_echo_with_max_tokens_0_returns_the_bound_per_prompt_token(client, model, tok):
    prompt = "The cat sat on the mat because it was warm there and"
    r = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=0, seed=3,
                                  extra_body={"nelbo_steps": 8, "nelbo_samples": 2})
    ids = tok.encode(prompt)
    want = score_continuation(model, [], ids, num_steps=8, num_t_samples=2, seed=3)
    (c,) = r.choices
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.top_logprobs is None
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset == sorted(c.logprobs.text_offset)
    assert c.logprobs.token_logprobs == pytest.approx((-want).tolist(), rel=1e-12)
    assert c.model_extra["nelbo"] == pytest.approx(float(want.sum()), rel=1e-9)
    assert r.model_extra["scoring"]["bound"] == "nelbo" and r.model_extra["scoring"]["nelbo_steps"] == 8
    again = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=0, seed=3,
                                      extra_body={"nelbo_steps": 8, "nelbo_samples": 2})
    assert again.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    longer = client.completions.create(model="tiny", prompt="Yesterday " + prompt, echo=True, max_tokens=0,
                                       logprobs=0, seed=3, extra_body={"nelbo_steps": 8, "nelbo_samples": 2})
    tail = longer.choices[0].logprobs.token_logprobs[-5:]
    assert tail != c.logprobs.token_logprobs[-5:]


@pytest.mark.parametrize("kwargs, param", [
    ({"echo": True, "max_tokens": 4}, "echo"), ({"echo": True}, "echo"), ({"echo": "yes"}, "echo"),
    ({"echo": True, "max_tokens": 2}, "echo"),
    ({"echo": True, "max_tokens": 0, "stream": True}, "stream"), ({"echo": True, "max_tokens": 0, "n": 2}, "n"),
    ({"echo": True, "max_tokens": 0, "extra_body": {"nelbo_samples": 9, "nelbo_steps": 8}}, "nelbo_samples"),
    ({"echo": True, "max_tokens": 0, "extra_body": {"nelbo_steps": 0}}, "nelbo_steps"),
    ({"extra_body": {"nelbo_samples": 2}}, "nelbo_samples")])
def test_refusals_name_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi there", **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_serving_doc_scoring_example_runs(server):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc.split("## Scoring a prompt (echo + max_tokens 0 or 1)", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("http://127.0.0.1:8000", server).replace('api_key="none"', f'api_key="{KEY}"')
    out: list[str] = []
    exec(compile(code, "docs/serving.md", "exec"), {"print": lambda *a, **k: out.append(" ".join(map(str, a)))})
    assert out and float(out[-1].split()[-1]) < 0, out
