"""The pure parts of `dgemma serve`: the OpenAI request rules (dgemma/serving/api.py), chat templates rendered as
transformers renders them, and the thinking / tool-call output parser (dgemma/data/templates.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dgemma
from dgemma.data.templates import (
    BUILTIN_CONVENTIONS,
    CONVENTIONS,
    JSON_TOOL_CALL,
    THINK,
    ChatTemplate,
    ChatTemplateError,
    OutputParser,
    load_chat_template,
    parse_output,
)
from dgemma.data.tokenizer import encode_template, format_chat
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.api import APIError, parse_chat_request, parse_completion_request, parse_json

BASE = GenerationConfig(max_new_tokens=32, max_denoising_steps=8, eos_token_id=(1,))

# A small template in the style of Gemma 4's: turns, a system turn listing the tools, Gemma's tool-call syntax and
# its thinking channel (which the parser then recognizes).
GEMMA_LIKE = (Path(__file__).resolve().parents[2] / "examples" / "gemma4_tools.jinja").read_text()


def chat(tok, template=None, **body):
    return parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], **body}, tokenizer=tok,
                              template=template or ChatTemplate(None), base_config=BASE, model_name="tiny")


def completion(tok, **body):
    return parse_completion_request({"prompt": "Hello", **body}, tokenizer=tok, base_config=BASE, model_name="tiny")


def refused(fn, *args, **body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **body)
    return e.value


# --- request rules ---------------------------------------------------------------------------------------------

def test_sampler_fields_and_openai_fields_become_one_config(tok):
    req = chat(tok, max_completion_tokens=20, max_denoising_steps=4, entropy_bound=0.5, sampler="lite", seed=7, n=3,
               temperature=0.5, stop=["\n\n", "END"], stream=True,
               stream_options={"include_usage": True, "include_denoising": True})
    cfg = req.submissions[0].config
    assert (cfg.max_new_tokens, cfg.max_denoising_steps, cfg.entropy_bound, cfg.sampler) == (20, 4, 0.5, "lite")
    assert (cfg.t_min, cfg.t_max) == pytest.approx((BASE.t_min * 0.5, BASE.t_max * 0.5))  # temperature's rule
    assert [s.seed for s in req.submissions] == [7, 8, 9] and [s.index for s in req.submissions] == [0, 1, 2]
    assert req.stop == ("\n\n", "END") and req.stream and req.include_usage and req.include_denoising
    assert req.prompts == [encode_template(tok, format_chat([{"role": "user", "content": "Hi"}]))]
    assert chat(tok).submissions[0].config == BASE  # nothing given: the server's defaults, untouched


def test_temperature_zero_is_the_lowest_temperature_schedule(tok):
    """What lm-eval-harness and agents send by default: t_min 0, t_max the smallest the sampler computes, so every
    draw is its position's argmax (a whole canvas of argmax draws on the random tiny model)."""
    from dgemma.sampling.generation_config import MIN_TEMPERATURE

    cfg = chat(tok, temperature=0).submissions[0].config
    assert (cfg.t_min, cfg.t_max) == (0.0, MIN_TEMPERATURE)
    assert chat(tok, temperature=1e-9).submissions[0].config.t_max == MIN_TEMPERATURE  # t_max held at the floor
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    prompt = torch.tensor([[5, 6, 7]])
    out = dgemma.generate(model, prompt, generation_config=cfg.replace(max_new_tokens=16, max_denoising_steps=2,
                                                                       eos_token_id=()), seed=0, trace=True)
    first = out.trace.steps[0]
    assert bool(first.accepted.all()) and float(first.entropy.max()) < 1e-3  # one-hot posteriors: all accepted


def test_completion_prompts_strings_ids_and_choice_order(tok):
    req = completion(tok, prompt=["a", "b"], n=2, seed=10)
    assert req.prompts == [tok.encode("a"), tok.encode("b")]
    assert [(s.index, s.prompt, s.seed) for s in req.submissions] == [(0, 0, 10), (1, 0, 11), (2, 1, 12),
                                                                       (3, 1, 13)]
    assert completion(tok, prompt=[5, 6, 7]).prompts == [[5, 6, 7]]
    assert completion(tok, prompt=[[5], [6, 7]]).prompts == [[5], [6, 7]]


@pytest.mark.parametrize("body, param, words", [
    ({"bogus": 1}, "bogus", "unsupported field(s): bogus"),
    ({"entropy_bound": -1}, "entropy_bound", "entropy_bound: must be a number > 0"),
    ({"max_denoising_steps": 0}, "max_denoising_steps", "positive int"),
    ({"sampler": "greedy"}, "sampler", "sampler: must be one of"),
    ({"t_min": 0.9}, "t_max", "must be >= t_min"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"min_p": 2}, "min_p", "[0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "[0.01, 100]"),
    ({"logprobs": 1}, "logprobs", "true or false"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
    ({"logit_bias": {"5": 1000}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": [5, 1]}, "logit_bias", "must be an object"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"temperature": -0.1}, "temperature", "[0, 2]"),
    ({"t_max": 3e38, "temperature": 2}, "temperature", "out of range"),
    ({"n": 0}, "n", "from 1 to 8"),
    ({"n": 9}, "n", "from 1 to 8"),
    ({"seed": -1}, "seed", "seed"),
    ({"seed": 1.5}, "seed", "seed"),
    ({"max_tokens": 0}, "max_tokens", "positive int"),
    ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens", "not both"),
    ({"stop": [str(i) for i in range(65)]}, "stop", "at most 64 strings, got 65"),
    ({"stop": ["a", "b" * 257]}, "stop", "stop[1]: at most 256 characters, got 257"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"stream": True, "stream_options": {"include_everything": True}}, "stream_options", "include_everything"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "always"}, "tool_choice", "'auto', 'none', 'required' or"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice", "no tool named 'f'"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be {'type': 'text'}"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice", "not both"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages",
     "only text parts"),
    ({"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, "messages", "mood"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content: required"),
])
def test_bad_chat_fields_are_refused_by_name(tok, body, param, words):
    e = refused(chat, tok, **body)
    assert e.status == 400 and e.param == param and words in e.message, e.message
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": param,
                                  "code": None}}


@pytest.mark.parametrize("body, param", [({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
                                         ({"prompt": [-1]}, "prompt"), ({"echo": True}, "echo"),
                                         ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
                                         ({"logprobs": 6}, "logprobs"), ({"logprobs": True}, "logprobs"),
                                         ({"messages": []}, "messages"),
                                         ({"prompt": "x", "n": 8, "seed": 2**64}, "seed")])
def test_bad_completion_fields_are_refused_by_name(tok, body, param):
    assert refused(completion, tok, **body).param == param


def test_model_name_and_json(tok):
    assert chat(tok, model="tiny").submissions
    e = refused(chat, tok, model="gpt-4")
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b"{bad", b"[1, 2]", b"\xff\xfe"):
        assert refused(parse_json, raw).status == 400


# --- chat templates --------------------------------------------------------------------------------------------

def test_checkpoint_template_renders_as_transformers_and_marks_its_conventions(tmp_path, tok):
    (tmp_path / "chat_template.jinja").write_text(GEMMA_LIKE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<bos>"}}))
    template = load_chat_template(None, tmp_path)
    assert not template.builtin and {c.name for c in template.conventions} == {"gemma-thought", "gemma-tool-call"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    assert template.render(messages) == format_chat(messages)  # this template is the Gemma turn template
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    req = chat(tok, template, messages=history, tools=tools)
    as_template_reads = [history[0], {**history[1], "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo"}}}]}, history[2]]  # arguments as an object
    text = template.render(as_template_reads, tools)
    assert 'get_weather: {"name": "get_weather"' in text  # tojson without HTML escaping
    assert '<|tool_call>call:get_weather{"city": "Oslo"}<tool_call|>' in text  # arguments given as an object
    assert req.prompts == [encode_template(tok, text)]
    assert {c.name for c in req.conventions} == {"gemma-thought", "gemma-tool-call"}
    assert not [c for c in chat(tok, template, tools=tools, tool_choice="none").conventions if c.kind == "tool"]


def test_template_sources_and_refusals(tmp_path, tok):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{{ raise_exception('roles must alternate') }}"},
        {"name": "tool_use", "template": "{# writes <tool_call> spans #}<think>{{ messages[0].content }}"}]}))
    template = load_chat_template(tmp_path)
    e = refused(chat, tok, template)
    assert e.param == "messages" and "roles must alternate" in e.message
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tok, template, tools=tools).prompts == [tok.encode("<think>Hi", add_special_tokens=False)]
    # the sandbox: no way out to Python internals
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    assert "unsafe" in refused(chat, tok, load_chat_template(tmp_path)).message
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        load_chat_template(tmp_path)
    assert load_chat_template(tmp_path / "nowhere", None).builtin


# --- the output parser -----------------------------------------------------------------------------------------

def test_gemma_thinking_and_tool_calls():
    text = ('<|channel>thought\nThe user wants weather.<channel|>Let me check. <|tool_call>call:get_weather{'
            'location:<|"|>Paris, "FR"<|"|>,days:3,metric:true,hours:[9,12.5],extra:{note:null}}<tool_call|>')
    out = parse_output(text, BUILTIN_CONVENTIONS)
    assert out.reasoning == "The user wants weather." and out.content == "Let me check. "
    (call,) = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": 'Paris, "FR"', "days": 3, "metric": True,
                                                         "hours": [9, 12.5], "extra": {"note": None}}


def test_think_and_json_tool_calls_and_what_does_not_parse():
    out = parse_output('<think>hmm</think>Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
                       '<tool_call>not json</tool_call>', CONVENTIONS)
    assert out.reasoning == "hmm" and [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"x": 1}]
    assert out.content == "Sure.<tool_call>not json</tool_call>"  # a call that does not parse stays text
    assert parse_output("a <think>b", CONVENTIONS).reasoning == "b"  # unclosed thinking: still reasoning
    assert parse_output("a <|tool_call>call:f{", BUILTIN_CONVENTIONS).content == "a <|tool_call>call:f{"
    assert parse_output("<think>x</think>", ()).content == "<think>x</think>"  # no conventions: plain text


def test_parser_pieces_arrive_in_any_split():
    text = 'Hi <|channel>thought\nplan<channel|>ok <|tool_call>call:f{a:<|"|>b<|"|>}<tool_call|> end <|cha'
    whole = parse_output(text, BUILTIN_CONVENTIONS)
    for size in (1, 2, 3, 7):
        parser, pieces = OutputParser(BUILTIN_CONVENTIONS), []
        for i in range(0, len(text), size):
            pieces += parser.feed(text[i:i + size])
        pieces += parser.finish()
        got = {k: "".join(v for kind, v in pieces if kind == k) for k in ("content", "reasoning")}
        assert got == {"content": whole.content, "reasoning": whole.reasoning} == {
            "content": "Hi ok  end <|cha", "reasoning": "plan"}
        assert [json.loads(v["function"]["arguments"]) for k, v in pieces if k == "tool_call"] == [{"a": "b"}]


def test_canvas_text_holds_back_partial_utf8_and_stop_prefixes_then_splits(tok):
    """The app's per-choice text bookkeeping on real token ids arriving canvas by canvas: what it sends never
    contains a half UTF-8 character or a stop string's beginning that the next canvas completes, and the split
    into content, reasoning and tool calls is the whole text's."""
    from dgemma.serving.choice import Choice

    text = 'café <think>plan é</think>Done. <tool_call>{"name": "f", "arguments": {"x": "ü"}}</tool_call> fin'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    whole = parse_output(text, CONVENTIONS)
    for size in (1, 2, 3, 5):
        choice = Choice(0, tok.decode, ("STOP",), OutputParser(CONVENTIONS))
        pieces = []
        for i in range(0, len(ids), size):
            new = choice.on_canvas(ids[i:i + size])
            assert not any("\ufffd" in v for k, v in new if k != "tool_call"), new
            pieces += new
        pieces += choice.finish()
        assert not choice.stopped
        got = {k: "".join(v for kind, v in pieces if kind == k) for k in ("content", "reasoning")}
        assert got == {"content": whole.content, "reasoning": whole.reasoning}
        assert [c["function"] for _, c in pieces if _ == "tool_call"] == [c["function"] for c in whole.tool_calls]
    ids = tok.encode("one two STOP three", add_special_tokens=False)
    choice = Choice(0, tok.decode, ("STOP",), None)
    sent = "".join(v for i in range(len(ids)) for _, v in choice.on_canvas(ids[i:i + 1]))
    assert choice.stopped and sent == "one two " and choice.finish() == []


# --- what newer clients send: template kwargs, reasoning_effort, fields with no effect, an opened thinking span ---

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
             "{% else %}<think>\n{% endif %}{% endif %}"
             "{% if reasoning_effort %}effort={{ reasoning_effort }}{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_a_prompt_opened_thinking_span_is_parsed(tok):
    template = ChatTemplate(QWEN_LIKE, origin="test")
    assert {"enable_thinking", "reasoning_effort"} <= template.variables
    thinking = chat(tok, template)
    assert thinking.opened is THINK  # the prompt ends inside <think>: the output begins in it
    parser = OutputParser(thinking.conventions, start=thinking.opened)
    pieces = parser.feed("I think</think>The answer") + parser.finish()
    assert ("reasoning", "I think") in pieces and ("content", "The answer") in pieces
    plain = chat(tok, template, chat_template_kwargs={"enable_thinking": False})
    assert plain.opened is None and plain.prompts[0] != thinking.prompts[0]
    effort = chat(tok, template, reasoning_effort="low")
    assert "effort=low" in tok.decode(effort.prompts[0]) and effort.ignored == ()


def test_fields_with_no_effect_are_accepted_and_named_and_malformed_ones_refused(tok):
    req = chat(tok, store=False, metadata={"run": "a"}, service_tier="auto", reasoning_effort="high")
    assert req.ignored == ("store", "metadata", "service_tier", "reasoning_effort")  # the built-in template: unread
    assert completion(tok, store=True).ignored == ("store",)
    for body, param in (({"store": "yes"}, "store"), ({"metadata": {"a": 1}}, "metadata"),
                        ({"reasoning_effort": "max"}, "reasoning_effort"),
                        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        assert refused(chat, tok, ChatTemplate(QWEN_LIKE, origin="test"), **body).param == param


# --- tools on a template with no tool-call syntax: dgemma's default tool prompt ---------------------------------

def test_tools_on_a_template_without_tool_syntax_get_the_default_json_tool_prompt(tok):
    """The built-in template (and QWEN_LIKE, which marks no tool-call span) render tools, calls and results through
    data/tool_prompt.py; the output parser then reads JSON tool calls, and only when tools were given."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "-3 C"}]
    for template in (ChatTemplate(None), ChatTemplate(QWEN_LIKE, origin="test")):
        req = chat(tok, template, messages=history, tools=tools)
        text = tok.decode(req.prompts[0])
        assert text.index("Be brief.") < text.index('{"name": "get_weather", "parameters"')  # in the system turn
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
        assert '<tool_response>{"name": "get_weather", "content": "-3 C"}</tool_response>' in text
        assert JSON_TOOL_CALL in req.conventions
        parsed = parse_output('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                              req.conventions)
        assert parsed.content == "Sure." and parsed.tool_calls[0]["function"]["name"] == "get_weather"
        assert JSON_TOOL_CALL not in chat(tok, template).conventions  # no tools: <tool_call> text stays text
        assert chat(tok, template, tools=tools, tool_choice="required", max_tokens=64).constraint is not None


def test_openai_fields_without_a_use_here_are_accepted_neutral_and_refused_set(tok):
    """functions, function_call, modalities, prediction and audio: what SDKs and proxies send as null (or the neutral
    value) is accepted; anything else is a 400 naming the field and what to send instead."""
    req = chat(tok, functions=None, function_call=None, modalities=None, prediction=None, audio=None)
    assert req.submissions and chat(tok, modalities=["text"], function_call="none").submissions
    for body, words in (({"functions": [{"name": "f", "parameters": {}}]}, "send tools"),
                        ({"function_call": {"name": "f"}}, "send tool_choice"),
                        ({"modalities": ["text", "audio"]}, "text is the only output modality"),
                        ({"prediction": {"type": "content", "content": "x"}}, "predicted outputs"),
                        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio output")):
        (name,) = body
        e = refused(chat, tok, **body)
        assert (e.status, e.param) == (400, name) and words in e.message, e.message
