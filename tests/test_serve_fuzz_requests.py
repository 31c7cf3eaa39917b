"""A bounded fuzz of well-formed requests that combine the server's features as clients do: grammars (json_object,
JSON Schemas plain and hostile, forced tool calls) under every sampling control (temperature 0, top_k, top_p, min_p,
logit_bias, penalties at the edges of their ranges), logprobs and top_logprobs, n, streaming, stop lists, seeds and
echo scoring. Where the HTTP fuzz (tests/test_serve_hardening.py) throws malformed bytes, this one throws valid JSON
at the meeting points of features.

Every answer must be: a 2xx whose JSON is strictly finite (no NaN or Infinity anywhere, streamed or whole) with usage
counting no more tokens than were asked for, a grammar's `stop` answer valid against its schema, a forced tool call's
answer a call and never raw markup; or a 4xx with OpenAI's error object. Never a 5xx, never a hang; /health answers
after each case. A real uvicorn server on a free 127.0.0.1 port over a real engine and a tiny random model."""

from __future__ import annotations

import collections
import json
import os
import random

import httpx
import pytest

import dgemma
from dgemma.data.tokenizer import load_tokenizer
from dgemma.generation_config import GenerationConfig
from dgemma.serving.api import Limits
from dgemma.serving.app import create_app
from dgemma.serving.engine import Engine
from tests.helpers import running_server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.integration

CASES = int(os.environ.get("DGEMMA_FUZZ_REQUESTS", "120"))
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
                         limits=Limits(max_n=2, max_denoising_steps=8, max_request_steps=512))
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
        fmt = body.get("response_format", {}).get("type")
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
