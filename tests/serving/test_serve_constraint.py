"""`dgemma serve` with response_format (dgemma/sampling/constraint.py through the engine): the real openai client
against a real server over a tiny random model, which knows nothing of JSON, so only the grammar can make the output
valid."""

from __future__ import annotations

import json
import threading

import openai
import pytest
from openai import OpenAI

import dgemma
from dgemma.data.tokenizer import load_tokenizer
from dgemma.sampling.generation_config import GenerationConfig
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
    with Engine(model, max_batch=8, max_context=1024, impl="reference") as engine:  # room for a tool prompt
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
    # grammars that used to answer an empty or invalid output marked complete ("stop")
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
        "$ref": "#/$defs/a"}}}, "the grammar engine gives up on the json schema within its first 32 tokens"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "additionalProperties": {"type": "object"}, "minProperties": 3}}},
     "minProperties 3 is more than its 0 required key(s)"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "x" * 300000}}},
     "the json schema is 300,013 characters; at most 65,536 are compiled"),
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
    """A server whose chat template writes Gemma 4's tool calls (the one of tests/serving/test_serve_api.py)."""
    from dgemma.data.templates import load_chat_template
    from tests.serving.test_serve_api import GEMMA_LIKE

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
    from tests.serving.test_serve_api import GEMMA_LIKE

    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "book", "parameters": schema}}]
    c = tool_constraint({"tool_choice": "required"}, tools, ChatTemplate(GEMMA_LIKE, origin="test"),
                        load_tokenizer(tok_path), GenerationConfig(eos_token_id=(1,)))
    assert "0[1-9]|[12][0-9]|3[01]" in c.grammar and '"format"' not in c.grammar


def test_a_tool_schema_the_grammar_engine_gives_up_on_is_a_400_naming_tools(tool_client):
    recursive = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
                 "$ref": "#/$defs/a"}
    tools = [{"type": "function", "function": {"name": "loop", "parameters": recursive}}]
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, tools=tools,
                                            tool_choice="required")
    error = e.value.response.json()["error"]
    assert error["param"] == "tools" and "the grammar engine gives up on the lark" in error["message"], error


# --- a grammar slow to mask holds its own row only (round-three hardening) ---------------------------------------

SLOW = {"type": "json_schema", "json_schema": {"name": "slow", "schema": {"const": "x" * 60000}}}  # under the cap


def test_a_grammar_over_its_step_budget_ends_as_length_not_as_a_complete_answer(client):
    """The const's masks take seconds per step on this tokenizer: past the engine's budget per step (2 s) the
    request ends with what it has, marked incomplete (it used to hold the engine for the whole mask work)."""
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=0, response_format=SLOW)
    assert r.choices[0].finish_reason == "length"
    assert ('"' + "x" * 60000).startswith(r.choices[0].message.content)  # a valid prefix, however short


def test_a_slow_grammar_holds_its_own_row_only_and_cancelling_it_is_prompt(tok_path):
    """A plain request sent while a slow grammar masks its first step is answered while that step still runs (the
    engine steps it on a worker thread and leaves its row out meanwhile); the slow request, its client gone, leaves
    its row without waiting for the step, whose budget here (60 s) it never reaches."""
    import httpx

    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    base = GenerationConfig.for_model(model.config).replace(max_denoising_steps=4, eos_token_id=(1,),
                                                            max_new_tokens=16)
    with Engine(model, max_batch=4, max_context=256, impl="reference", grammar_step_seconds=60) as engine:
        app = create_app(engine, load_tokenizer(tok_path), "tiny", generation_config=base)
        with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            slow = {"model": "tiny", "messages": USER, "max_tokens": 16, "stream": True, "response_format": SLOW}
            with http.stream("POST", "/v1/chat/completions", json=slow) as stream:
                assert stream.status_code == 200  # compiled (on a worker thread) and submitted
                while engine.stats().active == 0:  # until it holds a row
                    threading.Event().wait(0.01)
                plain = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 16})
                assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
                s = engine.stats()
                assert s.active == 1 and s.requests_finished == 1  # the slow one still holds its row
            for _ in range(3000):  # its client left: the row is freed while the step would still run
                if engine.stats().active == 0:
                    break
                threading.Event().wait(0.01)
            s = engine.stats()
            assert s.active == 0 and s.requests_cancelled == 1


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_refuses_a_grammar_step_budget_that_is_not_a_positive_number(capsys, value):
    from dgemma import cli

    assert cli.main(["serve", "--preset", "tiny", "--random-init", "--grammar-step-seconds", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dgemma serve: error: --grammar-step-seconds must be a number of seconds > 0, got {float(value)}"]


def _nested_schema():
    """A tool's parameters with a nested model, as pydantic writes them ($defs and a $ref to it)."""
    try:
        import pydantic
    except ImportError:
        return {"$defs": {"Addr": {"properties": {"street": {"type": "string", "maxLength": 12},
                                                  "city": {"type": "string", "maxLength": 8}},
                                   "required": ["street", "city"], "title": "Addr", "type": "object"}},
                "properties": {"name": {"type": "string", "maxLength": 8}, "home": {"$ref": "#/$defs/Addr"}},
                "required": ["name", "home"], "title": "Person", "type": "object"}

    class Addr(pydantic.BaseModel):
        street: str = pydantic.Field(max_length=12)
        city: str = pydantic.Field(max_length=8)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        home: Addr

    return Person.model_json_schema()


def test_tools_work_on_the_built_in_template_and_nested_models_are_forced(client):
    """The built-in template has no tool syntax: dgemma's default tool prompt (JSON tool calls) serves the tools,
    and a forced call's arguments follow a schema with $defs / $ref (pydantic's nested models)."""
    schema = _nested_schema()
    tools = [{"type": "function", "function": {"name": "save_person", "parameters": schema}}]
    for seed in range(2):
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=160, seed=seed, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "save_person"}})
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice.message
        (call,) = choice.message.tool_calls
        assert call.function.name == "save_person"
        jsonschema.validate(json.loads(call.function.arguments), schema)
    auto = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=0, tools=tools)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_template_with_json_tool_calls_forces_nested_models(tok_path):
    """A checkpoint template of its own JSON tool calls: the arguments' schema is a root of its own in the grammar,
    so pydantic's "$ref": "#/$defs/..." resolves (it once failed: "Pointer '/$defs/Addr' does not exist")."""
    from dgemma.data.templates import JSON_TOOL_CALL, ChatTemplate
    from dgemma.serving.formats import tool_constraint

    template = ChatTemplate("{# writes <tool_call> spans #}{% for m in messages %}{{ m.content }}{% endfor %}",
                            origin="test")
    assert template.tool_convention is JSON_TOOL_CALL and not template.tool_prompt
    tools = [{"type": "function", "function": {"name": "save_person", "parameters": _nested_schema()}}]
    c = tool_constraint({"tool_choice": "required"}, tools, template, load_tokenizer(tok_path),
                        GenerationConfig(eos_token_id=(1,)))
    assert '"$ref": "#/$defs/Addr"' in c.grammar


def test_completions_take_response_format_as_chat_does(client):
    """vLLM accepts response_format on /v1/completions: the same constraint path as chat, whole and streamed."""
    for seed in range(2):
        r = client.completions.create(model="tiny", prompt="A person:", max_tokens=128, seed=seed,
                                      extra_body={"response_format": FORMAT})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)
        chunks = list(client.completions.create(model="tiny", prompt="A person:", max_tokens=128, seed=seed,
                                                stream=True, extra_body={"response_format": FORMAT}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=16,
                                  extra_body={"response_format": {"type": "xml"}})
    assert e.value.response.json()["error"]["param"] == "response_format"


def test_a_forced_call_that_cannot_fit_max_tokens_is_refused_naming_it(tool_client):
    """LangChain's bind_tools with a small max_tokens once got 200, the call's raw markup as content and no
    tool_calls: the budget must hold the shortest call the grammar's closer writes."""
    named = {"type": "function", "function": {"name": "add"}}
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            tool_client.chat.completions.create(model="tiny", messages=USER, seed=0, tools=TOOLS, tool_choice=named,
                                                **{field: 4})
        error = e.value.response.json()["error"]
        assert error["param"] == field and "a forced tool_choice needs at least" in error["message"], error
        need = int(error["message"].split("at least ")[1].split()[0])
        assert need > 4
    r = tool_client.chat.completions.create(model="tiny", messages=USER, seed=0, tools=TOOLS, tool_choice=named,
                                            max_tokens=need)
    assert _calls(r.choices[0]) == ["add"]  # the budget it named is enough


def test_a_forced_call_cut_short_returns_no_markup_as_content(tool_client):
    """A stop string that cuts a forced call inside its markup leaves no call; the content is not the markup."""
    for stream in (False, True):
        r = tool_client.chat.completions.create(model="tiny", messages=USER, max_tokens=160, seed=0, tools=TOOLS,
                                                tool_choice="required", stop=["{"], stream=stream)
        if stream:
            chunks = list(r)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        else:
            content, calls = r.choices[0].message.content or "", r.choices[0].message.tool_calls
        assert content == "" and not calls


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
