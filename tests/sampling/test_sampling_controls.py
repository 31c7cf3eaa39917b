"""The sampling controls (GenerationConfig.top_k, top_p, min_p, repetition/presence/frequency penalties,
logit_bias; dgemma/sampling/rules.py:penalize, filter_tokens): each pinned to a per-position loop written from its
definition, their neutral values leaving generation untouched, and their effect through `generate` and the server."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI

import dgemma
from dgemma.sampling import rules
from dgemma.sampling.generation_config import GenerationConfig, GenerationError
from tests.helpers import random_init_model

V = 40


def _reference_truncate(z: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """One position at a time, from the definitions: top_k, then top_p on what is left, then min_p."""
    out = z.clone()
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in z.shape[:-1]]):
        row = out[tuple(idx)]
        if 0 < cfg.top_k < V:
            kth = sorted(row.tolist(), reverse=True)[cfg.top_k - 1]
            row[row < kth] = -torch.inf
        if cfg.top_p < 1:
            p = torch.softmax(row, 0)
            mass, keep = 0.0, []
            for t in sorted(range(V), key=lambda t: -float(row[t])):
                if mass >= cfg.top_p:
                    break
                keep.append(t)
                mass += float(p[t])
            cut = torch.ones(V, dtype=torch.bool)
            cut[keep] = False
            row[cut] = -torch.inf
        if cfg.min_p > 0:
            p = torch.softmax(row, 0)
            row[p < cfg.min_p * p.max()] = -torch.inf
    return out


@pytest.mark.parametrize("changes", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2),
                                     dict(top_k=8, top_p=0.9, min_p=0.05), dict(top_k=1)])
def test_truncation_is_its_definition(changes):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, V, generator=g) * 2
    cfg = GenerationConfig(**changes)
    got = z.clone()
    rules.filter_tokens(got, cfg)
    want = _reference_truncate(z, cfg)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], z[~torch.isinf(got)])  # what is kept is untouched
    assert bool((~torch.isinf(got)).any(-1).all())  # the most probable token always stays


def _reference_penalize(logits, cfg, prompt_seen, output, canvas, carried):
    """Per position: counts of the output plus the carried canvas tokens at the other positions; repetition over
    those and the prompt, then presence and frequency, then the bias."""
    out = logits.clone()
    B, L, _ = logits.shape
    for b in range(B):
        for i in range(L):
            counts = output[b].clone()
            for j in range(L):
                if j != i and carried[b, j]:
                    counts[canvas[b, j]] += 1
            row = out[b, i]
            if cfg.repetition_penalty != 1:
                hit = prompt_seen[b] | (counts > 0)
                r = cfg.repetition_penalty
                row[hit] = torch.where(row[hit] > 0, row[hit] / r, row[hit] * r)
            row -= cfg.presence_penalty * (counts > 0).float() + cfg.frequency_penalty * counts
            for t, bias in cfg.logit_bias:
                row[t] += bias
    return out


@pytest.mark.parametrize("changes", [dict(repetition_penalty=1.7), dict(presence_penalty=1.5),
                                     dict(frequency_penalty=0.7), dict(logit_bias={3: 5.0, 7: -2.5}),
                                     dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.2,
                                          logit_bias={0: 1.0})])
def test_penalties_and_bias_are_their_definition(changes):
    g = torch.Generator().manual_seed(1)
    B, L = 2, 6
    logits = torch.randn(B, L, V, generator=g) * 3
    canvas = torch.randint(0, 8, (B, L), generator=g)  # few ids: repeats within the canvas
    carried = torch.rand(B, L, generator=g) < 0.6
    prompts = torch.randint(0, 8, (B, 4), generator=g)
    seen = rules.Seen.of(prompts, V)
    seen.add(torch.randint(0, 8, (B, 5), generator=g))
    cfg = GenerationConfig(**changes)
    got = logits.clone()
    rules.penalize(got, cfg, seen, canvas, carried)
    want = _reference_penalize(logits, cfg, seen.prompt, seen.output, canvas, carried)
    torch.testing.assert_close(got, want)


def test_seen_counts_prompts_without_their_padding_and_committed_rows():
    prompts = torch.tensor([[0, 0, 5], [4, 4, 6]])
    seen = rules.Seen.of(prompts, 10, mask=torch.tensor([[0, 0, 1], [1, 1, 1]]))
    assert seen.prompt[0].nonzero().flatten().tolist() == [5] and seen.prompt[1].nonzero().flatten().tolist() == [4, 6]
    seen.add(torch.tensor([[1, 1, 2], [3, 3, 3]]), rows=torch.tensor([True, False]))
    assert seen.output[0, 1] == 2 and seen.output[0, 2] == 1 and float(seen.output[1].sum()) == 0


@pytest.fixture(scope="module")
def model():
    return random_init_model()


def test_neutral_values_change_nothing_and_the_controls_act_through_generate(model):
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    kw = dict(seed=3, max_new_tokens=32, max_denoising_steps=4, eos_token_id=())
    plain = dgemma.generate(model, prompt, **kw).sequences
    neutral = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                   frequency_penalty=0.0, logit_bias={})
    assert torch.equal(dgemma.generate(model, prompt, **kw, **neutral).sequences, plain)
    biased = dgemma.generate(model, prompt, **kw, logit_bias={42: 100.0}).sequences[:, 3:]
    assert bool((biased == 42).all())  # a +100 bias makes every position's draw the token
    spread = dgemma.generate(model, prompt, **kw, frequency_penalty=2.0, top_k=3).sequences[:, 3:]
    assert not torch.equal(spread, plain[:, 3:])
    with pytest.raises(GenerationError, match=r"logit_bias: token id\(s\) \[100000\] outside the vocabulary"):
        dgemma.generate(model, prompt, **kw, logit_bias={100000: 1.0})


def test_the_sync_free_loop_names_the_controls_it_does_not_implement(model):
    with pytest.raises(GenerationError, match=r"does not implement top_p=0\.5, presence_penalty=1\.0.*loop='readable'"):
        dgemma.generate(model, torch.tensor([[5, 6]]), impl="fast", loop="sync-free", seed=0, max_new_tokens=16,
                        top_p=0.5, presence_penalty=1.0)
    fast = dgemma.generate(model, torch.tensor([[5, 6]]), impl="fast", loop="readable", seed=0, max_new_tokens=16,
                           top_p=0.5)
    assert fast.sequences.shape == (1, 18)


def test_the_openai_client_sends_the_controls(tok_path):
    from dgemma.data.tokenizer import load_tokenizer
    from dgemma.serving.app import create_app
    from dgemma.serving.engine import Engine
    from tests.helpers import running_server

    base = GenerationConfig(max_denoising_steps=3, eos_token_id=(), max_new_tokens=16)
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    with Engine(model, max_batch=4, max_context=256, impl="reference") as engine, \
            running_server(create_app(engine, load_tokenizer(tok_path), "tiny", generation_config=base)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt="The sea", max_tokens=16, seed=0, logit_bias={"65": 100},
                                      top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                                      extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
        ids, _ = engine.complete([5, 6], base.replace(logit_bias={65: 100.0}), seed=0)
        assert set(ids) == {65}
        assert r.choices[0].text == load_tokenizer(tok_path).decode([65] * 16)
