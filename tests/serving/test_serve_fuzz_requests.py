"""A bounded fuzz of well-formed requests that combine the server's features as clients do: grammars (json_object,
JSON Schemas plain and hostile, forced tool calls) under every sampling control (temperature 0, top_k, top_p, min_p,
logit_bias, penalties at the edges of their ranges), logprobs and top_logprobs, n, streaming, stop lists, seeds and
echo scoring. Where the HTTP fuzz (tests/serving/test_serve_hardening.py) throws malformed bytes, this one throws valid
JSON at the meeting points of features.

Every answer must be: a 2xx whose JSON is strictly finite (no NaN or Infinity anywhere, streamed or whole) with usage
counting no more tokens than were asked for, a grammar's `stop` answer valid against its schema, a forced tool call's
answer a call and never raw markup; or a 4xx with OpenAI's error object. Never a 5xx, never a hang; /health answers
after each case. A real uvicorn server on a free 127.0.0.1 port over a real engine and a tiny random model."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import random
from pathlib import Path

import httpx
import pytest
import torch

import dgemma
from dgemma.data.tokenizer import load_tokenizer
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.api import Limits
from dgemma.serving.app import create_app
from dgemma.serving.engine import Engine
from tests.helpers import running_server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.integration

CASES = int(os.environ.get("DGEMMA_FUZZ_REQUESTS", "120"))
ADAPTER_CASES = int(os.environ.get("DGEMMA_FUZZ_ADAPTERS", "40"))
MAX_TOKENS = [0, 1, 5, 24]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}}, "required": ["home"],
          "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                             "required": ["city"], "additionalProperties": False}}}
RECURSIVE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}  # no finite instance
SCHEMAS = [
    PERSON, NESTED, {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, {"enum": ["a", "b"]},
    {"type": "object"}, {"type": "string", "format": "date"},
    # hostile: an empty language, sizes past llguidance's limits, keywords it cannot enforce
    RECURSIVE, {"type": "string", "pattern": "^(x{1000}){1000}$"}, {"const": "x" * 30000},
    {"anyOf": [{"const": f"v{i}"} for i in range(3000)]},
    {"type": "array", "prefixItems": [{"type": "integer"}] * 500},
    {"type": "object", "additionalProperties": {"type": "object"}, "minProperties": 3},
]
TEMPERATURES = [0, 1e-300, 0.5, 1, 2, 1e308]
TOP_P = [1, 0.5, 0.01, 1e-300, 5e-324]
PENALTIES = [1, 5e-324, 1.3, 1e308]
SEEDS = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1]


def finite_json(text: str):
    """`text` parsed as strict JSON: NaN, Infinity and -Infinity are refused."""
    def refuse(constant):
        raise ValueError(f"non-finite number in JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def request(rng: random.Random) -> tuple[str, dict, dict | None]:
    """One fuzzed request: (path, body, the schema its grammar was compiled from or None)."""
    pick, coin = rng.choice, lambda: rng.random() < 0.5
    chat = coin()
    body: dict = {"model": "tiny", "max_tokens": pick(MAX_TOKENS)}
    if chat:
        body["messages"] = [{"role": "user", "content": pick(["Hi", "Describe a person.", "é€😀"])}]
    else:
        body["prompt"] = pick(["Hi", "é€😀", ["a", "b"]])
        if coin():
            body["echo"] = True
    schema = None
    grammar = pick(["none", "none", "json_object", "json_schema", "tool"] if chat else
                   ["none", "none", "json_object", "json_schema"])
    if grammar == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif grammar == "json_schema":
        schema = pick(SCHEMAS)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    elif grammar == "tool":
        schema = pick([PERSON, NESTED, RECURSIVE, {"type": "object", "properties": {}}])
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = pick(["auto", "required", "none", {"type": "function", "function": {"name": "f"}}])
    for key, values in [("temperature", TEMPERATURES), ("top_p", TOP_P), ("top_k", [0, 1, 2, 50]),
                        ("min_p", [0, 0.5, 0.99, 1]), ("repetition_penalty", PENALTIES),
                        ("presence_penalty", [-2, 0, 2]), ("frequency_penalty", [-2, 0, 2]), ("seed", SEEDS),
                        ("n", [1, 2]), ("stream", [False, True])]:
        if coin():
            body[key] = pick(values)
    if coin():
        body["logit_bias"] = {str(t): pick([-100, 100, 1e-300]) for t in rng.sample(range(512), rng.randint(1, 40))}
    if coin():
        body["stop"] = [pick(["\n", "}", "a", "<eos>", "é", "xx"]) for _ in range(rng.randint(0, 6))]
    if coin():
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = pick([0, 1, 5, 20])
        else:
            body["logprobs"] = pick([0, 1, 5])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, schema


@pytest.fixture(scope="module")
def server(tok_path):
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    base = GenerationConfig.for_model(model.config).replace(max_denoising_steps=2, eos_token_id=(1,),
                                                            max_new_tokens=16)
    with Engine(model, max_batch=4, max_context=512, impl="fast") as engine:
        app = create_app(engine, load_tokenizer(tok_path), "tiny", generation_config=base,
                         limits=Limits(max_n=2, max_canvas_passes=8, max_request_steps=512))
        with running_server(app) as url:
            yield url


def problems_of(response: httpx.Response, path: str, body: dict, schema) -> list[str]:
    """What is wrong with the server's answer to one fuzzed request (empty: nothing)."""
    if response.status_code >= 500:
        return [f"{response.status_code}: {response.text[:300]}"]
    if response.status_code >= 400:
        try:
            error = finite_json(response.text)["error"]
        except (ValueError, KeyError, TypeError):
            return [f"{response.status_code}: not OpenAI's error object: {response.text[:200]}"]
        return [] if set(error) == {"message", "type", "param", "code"} else [f"error object {error}"]
    if body.get("stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    finite_json(line[6:])
                except ValueError as e:
                    return [f"SSE chunk: {e}: {line[:200]}"]
        return []  # the whole answers' checks below read the non-streamed form
    try:
        answer = finite_json(response.text)
    except ValueError as e:
        return [f"200: {e}"]
    found = []
    n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    usage = answer.get("usage") or {}
    if usage.get("completion_tokens", 0) > n * body["max_tokens"]:
        found.append(f"usage {usage} over {n} x max_tokens {body['max_tokens']}")
    for choice in answer["choices"]:
        message = choice.get("message") or {}
        content = message.get("content") if path.endswith("chat/completions") else None
        # a client's stop string cuts a grammar's answer where it occurs, "stop" as OpenAI's: no longer whole JSON
        fmt = None if body.get("stop") else body.get("response_format", {}).get("type")
        if choice["finish_reason"] == "stop" and fmt == "json_schema" and content is not None:
            try:
                jsonschema.validate(json.loads(content), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                found.append(f"a stop answer that fails its schema: {content[:120]!r}: {str(e)[:120]}")
        if choice["finish_reason"] == "stop" and fmt == "json_object" and content is not None:
            try:
                assert isinstance(json.loads(content), dict)
            except (ValueError, AssertionError):
                found.append(f"a stop answer that is not one JSON object: {content[:120]!r}")
        lp = choice.get("logprobs") if body.get("echo") else None
        if lp is not None:  # scoring (echo + max_tokens 0 or 1): one entry per prompt token, and the appended one
            lengths = {len(lp["tokens"]), len(lp["token_logprobs"]), len(lp["text_offset"]),
                       len(lp["top_logprobs"] if lp["top_logprobs"] is not None else lp["tokens"])}
            if len(lengths) != 1:
                found.append(f"scoring logprobs of unequal lengths {sorted(lengths)}")
        forced = isinstance(body.get("tool_choice"), dict) or body.get("tool_choice") == "required"
        if forced and body["max_tokens"] > 0 and not message.get("tool_calls") and choice["finish_reason"] != "length":
            found.append(f"a forced call answered without one: {choice}")
        if forced and content and "<" in content:
            found.append(f"template markup in a forced call's content: {content[:120]!r}")
    return found


def test_feature_combinations_never_5xx_hang_or_lie(server):
    """CASES fuzzed requests (DGEMMA_FUZZ_REQUESTS=1000 for a longer round); every problem is collected, counted by
    kind of request and reported together."""
    rng, found, tally = random.Random(0), [], collections.Counter()
    for _ in range(CASES):
        path, body, schema = request(rng)
        try:
            response = httpx.post(server + path, json=body, timeout=120)
            problems = problems_of(response, path, body, schema)
            tally[response.status_code // 100 * 100] += 1
        except httpx.TimeoutException:
            problems = ["no answer in 120 s"]
            tally["timeout"] += 1
        if httpx.get(server + "/health", timeout=30).status_code != 200:
            problems.append("/health stopped answering")
        found += [f"{json.dumps(body)[:300]} -> {p}" for p in problems]
    print(f"{CASES} fuzzed requests: {dict(tally)}; {len(found)} problem(s)")
    assert not found, "\n".join(found)


# --- adapters loaded while serving ---------------------------------------------------------------------------------

ADAPTER_NAMES = ["ok", "\u0000", "x" * 10000, "../../etc", "a/b", ".hidden", " ", "tiny", "é", "a" * 64]
CONFIG_EDITS = [("lora_alpha", "1e300"), ("lora_alpha", "1e999"), ("lora_alpha", "-1"), ("lora_alpha", "0"),
                ("lora_alpha", '"x"'), ("lora_alpha", "null"), ("r", "0"), ("r", "-1"), ("r", "1000000000"),
                ("r", '"2"'), ("r", str(2**63)), ("alpha_pattern", '{".*": 1e999}'), ("alpha_pattern", '{".*": 1e300}'),
                ("rank_pattern", '{".*": 1000000}'), ("target_modules", "[]"), ("target_modules", '["nope"]'),
                ("target_modules", "5"), ("use_dora", "true"), ("fan_in_fan_out", "true"),
                ("base_model_name_or_path", '"../../etc"'), ("lora_dropout", "1e999"),
                ("loftq_config", "[" * 100000 + "]" * 100000), ("use_rslora", "true")]
TENSOR_EDITS = ["inf", "nan", "huge", "transpose", "drop", "extra", "int", "empty_file", "fifo", "truncated",
                "symlink", "directory"]


def adapter_case(rng: random.Random, good: Path, root: Path, i: int) -> tuple[str, Path, str]:
    """A copy of the good adapter with one or two hostile edits: (the name to load it as, its path, what was done)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = root / f"case-{i}"
    shutil.copytree(good, path)
    done, config, raw = [], json.loads((path / "adapter_config.json").read_text()), {}
    for _ in range(rng.choice([1, 1, 2])):
        if rng.random() < 0.5:  # the raw JSON text of a value (it may not parse: it is written, never read back)
            key, value = rng.choice(CONFIG_EDITS)
            config[key], raw[f'"@@{key}@@"'] = f"@@{key}@@", value
            text = json.dumps(config)
            for marker, v in raw.items():
                text = text.replace(marker, v)
            (path / "adapter_config.json").write_text(text)
            done.append(f"{key}={value[:20]}")
            continue
        edit, weights = rng.choice(TENSOR_EDITS), path / "adapter_model.safetensors"
        done.append(edit)
        if edit in ("empty_file", "fifo", "truncated", "symlink", "directory"):
            data = weights.read_bytes()
            weights.unlink()
            if edit == "empty_file":
                weights.touch()
            elif edit == "fifo":
                os.mkfifo(weights)
            elif edit == "truncated":
                weights.write_bytes(data[: len(data) // 2])
            elif edit == "symlink":
                (root / f"elsewhere-{i}").write_bytes(data)
                weights.symlink_to(root / f"elsewhere-{i}")
            else:
                weights.mkdir()
            continue
        if not weights.is_file() or weights.is_symlink() or {"empty_file", "truncated"} & set(done[:-1]):
            continue  # a file an earlier edit broke stays broken
        tensors = load_file(weights)
        key = rng.choice(sorted(tensors))
        if edit == "inf":
            tensors = {k: torch.full_like(v, math.inf) for k, v in tensors.items()}
        elif edit == "nan":
            tensors[key] = torch.full_like(tensors[key], math.nan)
        elif edit == "huge":
            tensors[key] = tensors[key] * 1e30
        elif edit == "transpose":
            tensors[key] = tensors[key].t().contiguous()
        elif edit == "drop":
            del tensors[key]
        elif edit == "extra":
            tensors["base_model.model.nope.lora_A.weight"] = torch.zeros(2, 2)
        else:
            tensors[key] = tensors[key].to(torch.int64)
        save_file(tensors, weights)
    name = rng.choice(ADAPTER_NAMES) if rng.random() < 0.3 else f"a{i}"
    return name, path, "+".join(done)


def release_fifos(root: Path) -> None:
    """Open every FIFO under `root` for writing and close it, so that a reader blocked on one sees its end."""
    for p in root.rglob("*"):
        if p.is_fifo():
            with contextlib.suppress(OSError):
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))


def test_hostile_adapters_loaded_while_serving_never_5xx_or_stall(tmp_path, tok_path):
    """ADAPTER_CASES adapters with hostile configs, tensors, files and names, each loaded while serving and, where the
    load is accepted, asked for a completion; the served model answers a plain request after each case."""
    import copy

    from dgemma.weights import lora
    from tests.helpers import randomize_adapter_

    base = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    model = copy.deepcopy(base)
    lora.save_adapter(model, randomize_adapter_(model, 2, 5.0, "attention", seed=1), tmp_path / "good")
    config = GenerationConfig.for_model(base.config).replace(max_denoising_steps=2, eos_token_id=(), max_new_tokens=8)
    rng, found, tally = random.Random(0), [], collections.Counter()
    plain = {"model": "tiny", "prompt": "Hi", "max_tokens": 8, "seed": 0}
    with Engine(base, max_batch=2, max_context=64, impl="fast") as engine, \
            running_server(create_app(engine, load_tokenizer(tok_path), "tiny", generation_config=config,
                                      allow_runtime_lora=True)) as url:
        for i in range(ADAPTER_CASES):
            name, path, what = adapter_case(rng, tmp_path / "good", tmp_path, i)
            problems = []
            try:
                r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                               timeout=60)
                tally[f"load {r.status_code}"] += 1
                problems += problems_of(r, "", {}, None) if r.status_code >= 400 else []
                if r.status_code == 200:
                    asked = {**plain, "model": name, "logprobs": 2}
                    answer = httpx.post(url + "/v1/completions", json=asked, timeout=60)
                    problems += problems_of(answer, "/v1/completions", asked, None)
                    scored = {"model": name, "prompt": "Hi there", "max_tokens": 0, "echo": True, "logprobs": 1}
                    problems += problems_of(httpx.post(url + "/v1/completions", json=scored, timeout=60),
                                            "/v1/completions", scored, None)
                    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
            except httpx.TimeoutException:
                problems.append("no answer in 60 s")
            release_fifos(tmp_path)  # after the answers: a load that read a FIFO has stalled by now, or not at all
            try:
                if httpx.post(url + "/v1/completions", json=plain, timeout=30).status_code != 200:
                    problems.append("the served model stopped answering")
            except httpx.TimeoutException:
                problems.append("the served model stopped answering (no answer in 30 s)")
            found += [f"{what} as {name[:20]!r} -> {p}" for p in problems]
    print(f"{ADAPTER_CASES} hostile adapters: {dict(tally)}; {len(found)} problem(s)")
    assert not found, "\n".join(found)
