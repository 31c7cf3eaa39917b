"""dgemma in lm-evaluation-harness (dgemma/eval/lm_eval_model.py, dgemma/eval/continuations.py, `dgemma lm-eval`):
an AR run's loglikelihood is its exact log-softmax sum, a diffusion run's is minus its NELBO (the documented bound)
with a Monte Carlo SE over replicates, is_greedy means what the docs say for both, generate_until stops at its
`until` strings and takes sampler settings, bad inputs are one line; the integration tier runs lm-eval's own command
line on both runs with dgemma's two local tasks, offline."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

from dgemma import cli
from dgemma.diffusion.likelihood import clean_context_posterior, first_step_log_probs, score_continuation
from dgemma.eval.continuations import request_seed
from dgemma.eval.lm_eval_model import DgemmaLM

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "dgemma" / "eval" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def ar_run(tiny_data, tmp_path_factory) -> Path:
    """The `tiny` preset trained as an AR run (objective 'ar') for 2 steps on `tiny_data`."""
    from dgemma.train.config import train_preset
    from dgemma.train.loop import train

    run = tmp_path_factory.mktemp("tiny-ar") / "run"
    cfg = train_preset("tiny").replace(objective="ar", batch_size=2, max_steps=2, warmup_steps=1, eval_every=100,
                                       eval_batches=1, save_every=100, log_every=100)
    train(cfg, tiny_data, run, stream=io.StringIO())
    return run


@pytest.fixture(scope="module")
def ar_lm(ar_run) -> DgemmaLM:
    return DgemmaLM(pretrained=str(ar_run), batch_size=3)


@pytest.fixture(scope="module")
def diffusion_lm(tiny_run) -> DgemmaLM:
    return DgemmaLM(pretrained=str(tiny_run), mc_replicates=3, nelbo_steps=8, t_samples=2)


def ll(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), 0)


def gen(context: str, **kwargs) -> Instance:
    return Instance("generate_until", {}, (context, kwargs), 0)


def exact_ar_logprob(model, ids: list[int], start: int) -> tuple[float, list[int]]:
    """log p(ids[start:] | ids[:start]) from the KV-cache forward (not the scorer's causal pass), and the argmax of
    each of those positions."""
    cache = model.new_cache(1, len(ids))
    logits = model.next_token_logits(torch.tensor([ids]), cache)[0].double().log_softmax(-1)
    total = sum(float(logits[j - 1, ids[j]]) for j in range(start, len(ids)))
    return total, [int(logits[j - 1].argmax()) for j in range(start, len(ids))]


def test_ar_loglikelihood_is_the_exact_log_softmax_sum(ar_lm):
    reqs = [ll("the king said", " the cat sat"), ll("a", " dog"), ll("", "the quick fox")]
    got = ar_lm.loglikelihood(reqs)
    for (logprob, greedy), req, score in zip(got, reqs, ar_lm.last_scores, strict=True):
        ctx, cont = req.args
        if ctx:
            c, x = ar_lm._encode_pair(ctx, cont)
        else:
            c, x = [ar_lm.prefix_token_id], ar_lm.tok_encode(cont, add_special_tokens=False)
        want, argmax = exact_ar_logprob(ar_lm.model, c + x, len(c))
        assert logprob == pytest.approx(want, abs=1e-3)
        assert greedy == (argmax == x)
        assert score.exact and score.mc_se is None


def test_ar_is_greedy_for_its_argmax_continuation(ar_lm):
    ctx = ar_lm.tok_encode("the king")
    ids = list(ctx)
    for _ in range(3):  # the greedy continuation, one token at a time
        _, argmax = exact_ar_logprob(ar_lm.model, [*ids, 0], len(ids))
        ids.append(argmax[0])
    best = ar_lm.score([(ctx, ids[len(ctx):])])[0]
    other = ar_lm.score([(ctx, [*ids[len(ctx):-1], (ids[-1] + 1) % ar_lm.model.config.vocab_size])])[0]
    assert best.is_greedy and not other.is_greedy
    assert best.logprob > other.logprob


def test_diffusion_loglikelihood_is_minus_the_nelbo_with_its_monte_carlo_se(diffusion_lm):
    model = diffusion_lm.model
    (logprob, _), = diffusion_lm.loglikelihood([ll("the king said", " the cat sat on the mat")])
    score = diffusion_lm.last_scores[0]
    ctx, cont = diffusion_lm._encode_pair("the king said", " the cat sat on the mat")
    nelbos = [float(score_continuation(model, ctx, cont, num_steps=8, num_t_samples=2,
                                      seed=request_seed(0, r, ctx, cont)).sum()) for r in range(3)]
    assert all(math.isfinite(v) and v > 0 for v in nelbos)
    assert logprob == pytest.approx(-sum(nelbos) / 3, rel=1e-9)  # minus the NELBO: a lower bound on log p
    mean = sum(nelbos) / 3
    assert score.mc_se == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in nelbos) / 2 / 3), rel=1e-9)
    assert not score.exact and score.replicates == 3 and score.mc_se > 0
    # the same request scores the same in another batch, in another place
    again = diffusion_lm.loglikelihood([ll("a", " dog"), ll("the king said", " the cat sat on the mat")])
    assert again[1][0] == logprob


def test_diffusion_is_greedy_is_the_denoising_posteriors_argmax(diffusion_lm):
    model = diffusion_lm.model
    L, V = model.config.canvas_length, model.config.vocab_size
    ctx = diffusion_lm.tok_encode("the king said")
    # one canvas at pure noise given the context: its own clean tokens are not seen, so the argmax is any x0's
    g = torch.Generator().manual_seed(request_seed(0, -1, ctx, ()))
    posterior = clean_context_posterior(model, torch.tensor([ctx]), num_scored=L, generator=g)
    xt = torch.randint(0, V, (1, L), generator=g)
    argmax = posterior(torch.zeros(1, L, dtype=torch.long), xt, torch.ones(1, 1))[0].argmax(-1).tolist()
    best = diffusion_lm.score([(ctx, argmax)])[0]
    other = diffusion_lm.score([(ctx, [*argmax[:-1], (argmax[-1] + 1) % V])])[0]
    assert best.is_greedy and not other.is_greedy


def test_the_prompt_bound_is_what_the_server_answers(tiny_run):
    """bound=prompt: context and continuation bounded as one prompt from its first token, the continuation's terms
    summed (dgemma serve's scoring of lm-eval's local-completions request, seed 0); is_greedy from the first-step
    posterior over the whole prompt."""
    lm = DgemmaLM(pretrained=str(tiny_run), bound="prompt", nelbo_steps=16, t_samples=4, seed=0)
    ((logprob, greedy),) = lm.loglikelihood([ll("the king said", " the cat sat")])
    ctx, cont = lm._encode_pair("the king said", " the cat sat")
    terms = score_continuation(lm.model, [], ctx + cont, num_steps=16, num_t_samples=4, seed=0)
    assert logprob == pytest.approx(-float(terms[len(ctx):].sum()), rel=1e-9)
    rows = first_step_log_probs(lm.model, [], ctx + cont, seed=0)[len(ctx):]
    assert greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())
    with pytest.raises(ValueError, match="bound='canvas'"):
        DgemmaLM(pretrained=str(tiny_run), bound="canvas")


def test_rolling_loglikelihood_sums_windows(ar_lm, diffusion_lm):
    text = "the king said the cat sat on the mat " * 12
    for lm in (ar_lm, diffusion_lm):
        (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
        assert math.isfinite(total) and total < 0
    ids = ar_lm.tok_encode(text, add_special_tokens=False)
    assert len(ids) > ar_lm.max_length  # more than one window
    want, _ = exact_ar_logprob(ar_lm.model, [ar_lm.prefix_token_id, *ids[:ar_lm.max_length]], 1)
    first = ar_lm.score([([ar_lm.prefix_token_id], ids[:ar_lm.max_length])])[0]
    assert first.logprob == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("which", ["ar", "diffusion"])
def test_generate_until_stops_at_until_strings(which, ar_lm, diffusion_lm):
    lm = ar_lm if which == "ar" else diffusion_lm
    settings = dict(max_gen_toks=24, do_sample=False, max_denoising_steps=2)
    (full,) = lm.generate_until([gen("the king", until=[], **settings)])
    assert len(full) > 6, full
    stop = full[3:5]
    (cut,) = lm.generate_until([gen("the king", until=["\x00never", stop], **settings)])
    assert cut == full[:full.index(stop)]
    assert stop not in cut


def test_generate_until_takes_sampler_settings_and_refuses_unknown_ones(diffusion_lm):
    a = diffusion_lm.generate_until([gen("the king", until=[], max_gen_toks=8, sampler="confidence",
                                         max_denoising_steps=1, temperature=0.5)])
    assert isinstance(a[0], str)
    with pytest.raises(ValueError, match="no_such_setting"):
        diffusion_lm.generate_until([gen("the king", until=[], no_such_setting=1)])


def test_registering_dgemma_keeps_lm_evals_own_models():
    """lm-eval loads its built-in models only into an empty registry: dgemma's registration must not hide them (a
    process that imported dgemma's model could no longer run `local-completions` against `dgemma serve`)."""
    from lm_eval.api.registry import get_model

    assert get_model("dgemma") is DgemmaLM
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"


@pytest.mark.parametrize(("args", "match"), [
    (dict(foo=1), "unknown argument.*foo"),
    (dict(mc_replicates=0), "mc_replicates=0"),
    (dict(dtype="float8"), "dtype='float8'"),
    (dict(nelbo_steps=2, t_samples=4), "t_samples=4 exceeds"),
    (dict(seed=-1), "seed=-1"),
    (dict(max_length=0), "max_length=0"),
    (dict(batch_size="big"), "batch_size='big'"),
    (dict(nelbo_steps="discrete"), "nelbo_steps='discrete'"),
])
def test_bad_model_args_name_the_argument(tiny_run, args, match):
    with pytest.raises(ValueError, match=match):
        DgemmaLM(pretrained=str(tiny_run), **args)


def test_the_cli_refuses_in_one_line(capsys, monkeypatch):
    assert cli.main(["lm-eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dgemma lm-eval: error: give lm-eval's flags") and "\n" not in err
    monkeypatch.setitem(sys.modules, "lm_eval._cli.harness", None)  # lm-eval not installed
    assert cli.main(["lm-eval", "--tasks", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'dgemma[eval]'" in err and "\n" not in err


def test_the_shipped_tasks_hold_their_items():
    next_line = [json.loads(x) for x in (TASKS / "next_line.jsonl").read_text().splitlines()]
    speaker = [json.loads(x) for x in (TASKS / "speaker.jsonl").read_text().splitlines()]
    assert len(next_line) == len(speaker) == 150
    assert all(len(x["choices"]) == 4 and len(set(x["choices"])) == 4 for x in next_line)
    assert sorted({x["label"] for x in next_line}) == [0, 1, 2, 3]
    assert all(x["prompt"].endswith("\n\n") and x["speaker"] in x["prompt"] for x in speaker)


def lm_eval_cli(run: Path, out: Path, *extra: str) -> dict:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                        "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(out / "hf-cache")}
    done = subprocess.run([sys.executable, "-m", "dgemma", "lm-eval", "--model_args", f"pretrained={run}",
                           "--tasks", "dgemma_shakespeare_next_line,dgemma_shakespeare_speaker", "--limit", "8",
                           "--output_path", str(out), *extra], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"]


@pytest.mark.integration
@pytest.mark.parametrize("which", ["ar", "diffusion"])
def test_dgemma_lm_eval_runs_both_tasks_offline(which, ar_run, tiny_run, tmp_path):
    run = ar_run if which == "ar" else tiny_run
    results = lm_eval_cli(run, tmp_path, "--gen_kwargs", "max_denoising_steps=2")
    acc = results["dgemma_shakespeare_next_line"]["acc,none"]
    match = results["dgemma_shakespeare_speaker"]["exact_match,strip"]
    assert 0 <= acc <= 1 and 0 <= match <= 1


@pytest.mark.integration
@pytest.mark.parametrize("which", ["ar", "diffusion"])
def test_the_server_and_the_native_model_give_the_same_numbers(which, ar_run, tiny_run, tmp_path, monkeypatch):
    """Stock lm-eval `local-completions` against `dgemma serve` (echo + max_tokens 1 + logprobs, the remote
    tokenizer) and the native model on the same multiple-choice items: the same log-likelihoods (an AR run's exact
    ones; a diffusion run's bound=prompt, which is what the server computes, at its T = 16 and 4 t-samples, with
    the seed 1234 local-completions sends) and the same accuracy."""
    pytest.importorskip("fastapi")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from dgemma.serving.app import create_app
    from dgemma.serving.engine import Engine
    from tests.helpers import running_server

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    run = ar_run if which == "ar" else tiny_run
    native = f"pretrained={run},bound=prompt,nelbo_steps=16,t_samples=4,seed=1234,max_length=4096"
    lm = DgemmaLM.create_from_arg_string(native)
    tasks = TaskManager(include_path=str(TASKS))
    common = dict(tasks=["dgemma_shakespeare_next_line"], task_manager=tasks, limit=4, log_samples=True,
                  bootstrap_iters=0)
    with Engine(lm.model, max_batch=2, max_context=512, impl="reference") as engine, \
            running_server(create_app(engine, lm.tokenizer, "m", api_key="sk-test", generation_config=lm.gcfg,
                                      autoregressive=lm.autoregressive)) as url:
        args = (f"base_url={url}/v1/completions,model=m,tokenizer_backend=remote,tokenized_requests=True,"
                "auth_token=sk-test,max_length=4096,num_concurrent=1,max_retries=1")
        served = lm_eval.simple_evaluate(model="local-completions", model_args=args, **common)
    here = lm_eval.simple_evaluate(model=lm, **common)

    def numbers(results: dict) -> list[tuple[float, bool]]:
        return [r[0] for s in results["samples"]["dgemma_shakespeare_next_line"] for r in s["resps"]]

    for (a, ga), (b, gb) in zip(numbers(served), numbers(here), strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4) and ga == gb
    task = "dgemma_shakespeare_next_line"
    assert served["results"][task]["acc,none"] == here["results"][task]["acc,none"]
