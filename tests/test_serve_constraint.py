"""`dgemma serve` with response_format (dgemma/constraint.py through the engine): the real openai client against a
real server over a tiny random model, which knows nothing of JSON, so only the grammar can make the output valid."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

import dgemma
from dgemma.data.tokenizer import load_tokenizer
from dgemma.generation_config import GenerationConfig
from dgemma.serving.app import create_app
from dgemma.serving.engine import Engine
from tests.helpers import running_server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

USER = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(tok_path):
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    base = GenerationConfig.for_model(model.config).replace(max_denoising_steps=4, eos_token_id=(1,),
                                                            max_new_tokens=32)
    with Engine(model, max_batch=8, max_context=512, impl="reference") as engine:
        app = create_app(engine, load_tokenizer(tok_path), "tiny", generation_config=base)
        with running_server(app) as url:
            yield OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates_whole_and_streamed(client, seed):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=128, seed=seed,
                                       response_format=FORMAT)
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=128, seed=seed,
                                                 response_format=FORMAT, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # the same seed: the same canvases, canvas by canvas


def test_json_object_output_is_one_object_closed_within_max_tokens(client):
    """The random model never closes an object by itself: the budget's closer does, within max_tokens."""
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, seed=5, n=2,
                                       response_format={"type": "json_object"})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    assert r.usage.completion_tokens <= 2 * 40


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, "must be {'type': 'text'}"),
    ({"type": "json_schema"}, "json_schema: must be an object with a 'schema' object"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "json_schema.name: must be a non-empty string"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "bogus": 1}},
     "unknown field(s) bogus"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}},
     "cannot compile the json schema"),
    ({"type": "json_object", "json_schema": {}}, "unknown field(s) json_schema"),
])
def test_what_cannot_be_honoured_is_a_400_naming_response_format(client, fmt, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, response_format=fmt)
    error = e.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert words in error["message"]


@pytest.mark.parametrize("sampler", ["lite", "confidence", "ancestral"])
def test_the_other_samplers_keep_the_schema_too(client, sampler):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=64, seed=0, response_format=FORMAT,
                                       extra_body={"sampler": sampler})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tool_client(tok_path, tmp_path_factory):
    """A server whose chat template writes Gemma 4's tool calls (the one of tests/test_serve_api.py)."""
    from dgemma.data.templates import load_chat_template
    from tests.test_serve_api import GEMMA_LIKE

    root = tmp_path_factory.mktemp("template")
    (root / "chat_template.jinja").write_text(GEMMA_LIKE)
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<bos>"}}))
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    base = GenerationConfig.for_model(model.config).replace(max_denoising_steps=4, eos_token_id=(1,),
                                                            max_new_tokens=32)
    with Engine(model, max_batch=8, max_context=1024, impl="reference") as engine:
        app = create_app(engine, load_tokenizer(tok_path), "tiny", generation_config=base,
                         template=load_chat_template(None, root))
        with running_server(app) as url:
            yield OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _calls(choice):
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    out = []
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append(call.function.name)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_tool_choice_required_makes_calls_that_parse_and_validate(tool_client, seed):
    r = tool_client.chat.completions.create(model="tiny", messages=USER, max_tokens=160, seed=seed, tools=TOOLS,
                                            tool_choice="required")
    assert len(_calls(r.choices[0])) >= 1
    chunks = list(tool_client.chat.completions.create(model="tiny", messages=USER, max_tokens=160, seed=seed,
                                                      tools=TOOLS, tool_choice="required", stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == [c.function.name for c in
                                                                    r.choices[0].message.tool_calls]


def test_a_named_function_is_the_one_call(tool_client):
    for seed in range(3):
        r = tool_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=160, seed=seed, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}})
        assert _calls(r.choices[0]) == ["add"]
    r = tool_client.chat.completions.create(model="tiny", messages=USER, max_tokens=160, seed=4, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False)
    assert len(_calls(r.choices[0])) == 1


def test_a_forced_calls_dates_are_calendar_dates(tok_path):
    """The tool-call grammar compiles each function's dates as the response_format path does (DATE_PATTERN)."""
    from dgemma.data.templates import ChatTemplate
    from dgemma.serving.formats import tool_constraint
    from tests.test_serve_api import GEMMA_LIKE

    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "book", "parameters": schema}}]
    c = tool_constraint({"tool_choice": "required"}, tools, ChatTemplate(GEMMA_LIKE, origin="test"),
                        load_tokenizer(tok_path), GenerationConfig(eos_token_id=(1,)))
    assert "0[1-9]|[12][0-9]|3[01]" in c.grammar and '"format"' not in c.grammar


GREEDY_AND_CUT = [dict(temperature=0), dict(top_p=0.01), dict(extra_body={"top_k": 1}),
                  dict(extra_body={"min_p": 0.99}), dict(temperature=0, logit_bias={"95": -100, "6": -100})]


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, FORMAT], ids=["json_object", "json_schema"])
@pytest.mark.parametrize("kw", GREEDY_AND_CUT, ids=["temperature 0", "top_p", "top_k", "min_p", "bias"])
def test_a_format_with_greedy_or_truncated_sampling_is_answered(client, fmt, kw):
    """temperature 0 (what agents and eval harnesses send), top_k 1, top_p 0.01, min_p 0.99 or a bias of -100 on
    the tokens a JSON object starts with ('{' is 95, '"' is 6) with a response_format: a 500 (TypeError in the
    grammar's masked draw)."""
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=48, seed=0, response_format=fmt,
                                       **kw)
    assert r.choices[0].finish_reason == "stop"
    out = json.loads(r.choices[0].message.content)
    if fmt is FORMAT:
        jsonschema.validate(out, PERSON)


@pytest.mark.parametrize("kw", GREEDY_AND_CUT, ids=["temperature 0", "top_p", "top_k", "min_p", "bias"])
def test_a_forced_tool_call_with_greedy_or_truncated_sampling_is_answered(tool_client, kw):
    r = tool_client.chat.completions.create(model="tiny", messages=USER, max_tokens=160, seed=0, tools=TOOLS,
                                            tool_choice={"type": "function", "function": {"name": "add"}}, **kw)
    assert _calls(r.choices[0]) == ["add"]
