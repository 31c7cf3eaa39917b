"""lm-evaluation-harness against `dgemma serve`, unmodified: echo + max_tokens 1 + logprobs answered as lm-eval's
`local-completions` parses them (the AR model's exact log-probs, the diffusion model's bound terms with alternatives
whose largest is the token's own value exactly when it is the argmax), stop lists past OpenAI's 4, and the
tokenizer routes lm-eval's remote tokenizer reads (/tokenize, /detokenize, /tokenizer_info); and stock lm-eval's
`simple_evaluate` on a tiny local multiple-choice task through the server (integration tier)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch

from dgemma.diffusion.likelihood import first_step_log_probs, score_continuation
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.app import create_app
from dgemma.serving.choice import MAX_STOP
from dgemma.serving.engine import Engine
from dgemma.train.heldout import ar_token_nll
from tests.helpers import random_init_model, running_server

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
# context, choices (lm-eval joins them with its default target_delimiter, a space), the right one
ITEMS = [("The cat sat on the", ["mat", "sky", "river"], 0), ("A dog likes the red", ["ball", "of", "the"], 0),
         ("My friend finds an open", ["window", "and", "dinner"], 0),
         ("The teacher opens the", ["the", "door", "a"], 1), ("Our team builds a", ["with", "house", "quiet"], 1),
         ("The river follows the long road", ["home", "is", "a"], 0)]


@pytest.fixture(scope="module")
def model():
    return random_init_model()


@pytest.fixture(scope="module", params=["diffusion", "ar"])
def served(request, model, tok):
    """(base URL, whether the model is served as an AR run)."""
    ar = request.param == "ar"
    config = GenerationConfig.for_model(model.config).stopping_at(1)
    with Engine(model, max_batch=2, max_context=256, impl="reference") as engine, \
            running_server(create_app(engine, tok, "tiny", api_key=KEY, generation_config=config,
                                      autoregressive=ar)) as url:
        yield url, ar


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=120)


def lm_eval_request(ids: list[int], **extra) -> dict:
    """The body lm-eval 0.4.13's `local-completions` sends for loglikelihood (LocalCompletionsAPI._create_payload)."""
    return {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True, **extra}


def parse_logprobs(out: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval 0.4.13's `LocalCompletionsAPI.parse_logprobs`, as it reads a choice."""
    choice = out["choices"][0]
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(tokens_logprobs), all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs,
                                                                                    strict=True))


def test_echo_max_tokens_1_answers_lm_evals_loglikelihood_request(served, model, tok):
    url, ar = served
    ids = tok.encode("The cat sat on the mat because it was warm", add_special_tokens=False)
    r = post(url, "/v1/completions", lm_eval_request(ids, logprobs=3))
    assert r.status_code == 200, r.text
    out = r.json()
    (c,) = out["choices"]
    lp = c["logprobs"]
    n = len(ids) + 1  # the prompt and the appended greedy token
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": n}
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert c["finish_reason"] == "length" and c["text"].startswith(tok.decode(ids))
    first = 1 if ar else 0
    assert (lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None) if ar else True
    for value, top in zip(lp["token_logprobs"][first:], lp["top_logprobs"][first:], strict=True):
        assert math.isfinite(value) and value < 0 and 1 <= len(top) <= 3 and all(map(math.isfinite, top.values()))
        assert max(top.values()) >= value  # the token's own value is the largest exactly when it is the argmax
    if ar:  # exact: the model's own next-token log-softmax, and the alternatives are its top 3
        with torch.no_grad():
            rows = torch.log_softmax(model.next_token_logits(torch.tensor([ids]), model.new_cache(1, len(ids)))[0]
                                     .float(), -1)
            want = -ar_token_nll(model, torch.tensor([ids]))[0]  # the training loss's next-token NLL
        assert lp["token_logprobs"][1:-1] == pytest.approx(want.tolist(), abs=1e-5)
        top3 = torch.topk(rows[2], 3)  # ids that decode alike share a key: the largest of them is kept
        assert max(lp["top_logprobs"][3].values()) == pytest.approx(float(top3.values[0]), abs=1e-6)
        assert all(any(abs(v - w) < 1e-6 for w in top3.values.tolist()) for v in lp["top_logprobs"][3].values())
        assert lp["token_logprobs"][-1] == pytest.approx(float(rows[-1].max()), abs=1e-6)
        assert out["scoring"]["bound"] == "exact"
    else:  # minus the bound's terms, as max_tokens 0 gives them; the ranking is the first-step posterior's
        terms = score_continuation(model, [], ids, num_steps=16, num_t_samples=4, seed=1234)
        assert lp["token_logprobs"][:-1] == pytest.approx((-terms).tolist(), rel=1e-12)
        assert c["nelbo"] == pytest.approx(float(terms.sum()), rel=1e-9)
        rows = first_step_log_probs(model, [], ids, seed=1234)
        for i, t in enumerate(ids):
            greedy = int(rows[i].argmax()) == t
            assert (max(lp["top_logprobs"][i].values()) == lp["token_logprobs"][i]) == greedy
        after = first_step_log_probs(model, ids, [0], seed=1234)[0]
        assert lp["tokens"][-1] == tok.decode([int(after.argmax())])
        assert lp["token_logprobs"][-1] == pytest.approx(float(after.max()), abs=1e-6)
        assert out["scoring"]["bound"] == "nelbo"
    zero = post(url, "/v1/completions", lm_eval_request(ids, max_tokens=0)).json()["choices"][0]["logprobs"]
    assert zero["token_logprobs"] == lp["token_logprobs"][:-1] and len(zero["top_logprobs"]) == len(ids)


def test_is_greedy_is_true_for_the_argmax_continuation(served, model, tok):
    """A continuation built of each position's argmax is greedy by lm-eval's check; one token off is not. The AR
    model's argmax is its next-token one; the diffusion model's, its first-step posterior's at each position (which
    reads the canvases before the position's own, so the continuation's argmaxes are found in one pass)."""
    url, ar = served
    ctx = tok.encode("The old man watches", add_special_tokens=False)
    ids = list(ctx)
    if ar:
        for _ in range(3):
            with torch.no_grad():
                logits = model.next_token_logits(torch.tensor([ids]), model.new_cache(1, len(ids)))
            ids.append(int(logits[0, -1].argmax()))
    else:
        rows = first_step_log_probs(model, [], [*ctx, 0, 0, 0], seed=1234)
        ids += [int(rows[i].argmax()) for i in range(len(ctx), len(ctx) + 3)]
    _, greedy = parse_logprobs(post(url, "/v1/completions", lm_eval_request(ids)).json(), len(ctx))
    assert greedy
    wrong = [*ids[:-1], (ids[-1] + 1) % model.config.vocab_size]
    _, greedy = parse_logprobs(post(url, "/v1/completions", lm_eval_request(wrong)).json(), len(ctx))
    assert not greedy


@pytest.mark.parametrize("body, param", [
    ({"echo": True, "max_tokens": 2}, "echo"), ({"echo": True, "max_tokens": 1, "stream": True}, "stream"),
    ({"echo": True, "max_tokens": 1, "n": 2}, "n"), ({"echo": True, "max_tokens": 1, "logprobs": 6}, "logprobs"),
    ({"echo": True, "max_tokens": 1, "response_format": {"type": "json_object"}}, "response_format")])
def test_scoring_refusals_name_the_field(served, body, param):
    r = post(served[0], "/v1/completions", {"model": "tiny", "prompt": "Hi there", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_ar_run_is_served_for_scoring_only(served):
    url, ar = served
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi there", "max_tokens": 2})
    if ar:
        assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "autoregressive" in r.text
        r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    else:
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("count", [5, 8, MAX_STOP])
def test_stop_lists_past_openais_4_are_taken(served, count):
    url, ar = served
    if ar:
        pytest.skip("an AR run generates nothing here")
    stop = [f"zz{i}" for i in range(count - 1)] + ["<eos>"]  # lm-eval appends its EOS string to a task's own
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stop": stop, "seed": 0})
    assert r.status_code == 200, r.text


def test_a_stop_list_over_the_cap_is_refused_naming_stop(served):
    r = post(served[0], "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                            "stop": [f"s{i}" for i in range(MAX_STOP + 1)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and str(MAX_STOP) in r.text


def test_tokenize_and_detokenize_round_trip_as_vllm_serves_them(served, tok, model):
    url, _ = served
    text = "The cat sat on the mat. é€😀"
    r = post(url, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tok.encode(text, add_special_tokens=False) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == model.config.max_position_embeddings and "token_strs" not in out
    assert post(url, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": text}
    with_bos = post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert with_bos["tokens"] == tok.encode(text) and len(with_bos["token_strs"]) == with_bos["count"]
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert tok.decode(chat["tokens"]).startswith("<bos><|turn>user") and chat["count"] == len(chat["tokens"])
    info = httpx.get(url + "/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>" and info["tokenizer_class"]
    assert info["model_max_length"] == model.config.max_position_embeddings and "chat_template" in info
    # lm-eval's remote tokenizer reads the ids of these by encoding them
    assert post(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"] == [1]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"},
                                              "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "messages": []}, "messages"), ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ("/tokenize", {"messages": "Hi"}, "messages"), ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"), ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"), ("/detokenize", {}, "tokens")])
def test_tokenizer_routes_refuse_bad_input_naming_the_field(served, path, body, param):
    r = post(served[0], path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_routes_need_the_key_and_a_served_model(served):
    url, _ = served
    assert httpx.post(url + "/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401
    assert httpx.get(url + "/tokenizer_info", timeout=30).status_code == 401
    assert post(url, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 404


def write_task(root: Path) -> Path:
    """A 6-item multiple-choice task as lm-eval reads a local one: a YAML over a JSON-lines file (no download)."""
    import json

    data = root / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": ch, "label": y}) + "\n" for c, ch, y in ITEMS))
    (root / "dgemma_tiny_mc.yaml").write_text(
        "task: dgemma_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(data) +
        "\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n")
    return root


def expected_logliks(model, tok, ar: bool) -> list[list[float]]:
    """Each item's log-likelihood per choice as the server computes it, on the tokens lm-eval sends (context and
    " " + choice encoded whole, the context's tokens first, as TemplateLM._encode_pair cuts them): the AR model's
    exact sum, the diffusion model's minus the bound's terms over the continuation (seed 1234, lm-eval's)."""
    out = []
    for context, choices, _ in ITEMS:
        ctx = tok.encode(context, add_special_tokens=False)
        row = []
        for choice in choices:
            whole = tok.encode(f"{context} {choice}", add_special_tokens=False)
            assert whole[:len(ctx)] == ctx
            if ar:
                with torch.no_grad():  # the training loss's next-token NLL (train/heldout.py)
                    row.append(-float(ar_token_nll(model, torch.tensor([whole]))[0, len(ctx) - 1:].sum()))
            else:
                terms = score_continuation(model, [], whole, num_steps=16, num_t_samples=4, seed=1234)
                row.append(-float(terms[len(ctx):].sum()))
        out.append(row)
    return out


@pytest.mark.integration
def test_stock_lm_eval_runs_a_multiple_choice_task_through_the_server(served, model, tok, monkeypatch, tmp_path):
    """lm-eval 0.4.13, unmodified: `local-completions` with the remote tokenizer, a 6-item local task; each choice's
    log-likelihood it reads is the server's score of it, and its accuracy is the one those scores give."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    url, ar = served
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as its bearer key; the tokenizer auth_token
    args = (f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=remote,tokenized_requests=True,"
            f"auth_token={KEY},max_length=512,num_concurrent=1,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["dgemma_tiny_mc"],
                                      task_manager=TaskManager(include_path=str(write_task(tmp_path))), limit=6,
                                      log_samples=True, bootstrap_iters=0)
    acc = results["results"]["dgemma_tiny_mc"]["acc,none"]
    assert isinstance(acc, float) and 0 <= acc <= 1
    want = expected_logliks(model, tok, ar)
    samples = sorted(results["samples"]["dgemma_tiny_mc"], key=lambda s: s["doc_id"])
    got = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    assert got == [pytest.approx(row, abs=1e-4) for row in want]  # float32 sums over two forward paths (AR)
    assert acc == pytest.approx(sum(max(range(3), key=row.__getitem__) == y for row, (_, _, y) in
                                    zip(want, ITEMS, strict=True)) / len(ITEMS))
