"""Structured output (dgemma/sampling/constraint.py): every committed canvas keeps the output a valid prefix of the
grammar, on a random tiny model that knows nothing of JSON, so the grammar alone decides validity; the masked draw is
the masked product distribution; and the errors for what cannot be constrained."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from dgemma import generate
from dgemma.sampling.constraint import CLOSED, FREE, PINNED, Constraint, ConstraintError
from dgemma.sampling.generation_config import SAMPLERS, GenerationError
from tests.helpers import random_model

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

EOS = 1
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "number"}},
     "required": ["colour", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "admin": {"type": "boolean"}}, "required": ["id", "admin"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def model():
    return random_model("tiny")


def _prompt(rows: int = 2) -> torch.Tensor:
    return torch.randint(5, 500, (rows, 5), generator=torch.Generator().manual_seed(rows))


def _text(tok, ids):
    return tok.decode([t for t in ids if t != EOS])


def _is_prefix(constraint: Constraint, ids: list[int]) -> bool:
    """Whether a fresh parser takes every token (up to the grammar's end) of `ids`."""
    m = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar)
    for t in ids:
        if m.is_stopped():
            return t == EOS
        if not m.consume_token(t):
            return False
    return True


@pytest.mark.parametrize("schema", SCHEMAS, ids=["scalars", "enum+number", "array", "nested"])
def test_every_output_is_a_valid_prefix_and_a_complete_one_validates(model, tok, schema):
    c = Constraint.json_schema(schema, tok, eos_token_id=EOS)
    out = generate(model, _prompt(), seed=0, max_new_tokens=96, max_denoising_steps=6, constraint=c,
                   eos_token_id=EOS)
    assert len(out.constraint_complete) == 2
    for ids, complete in zip(out.new_tokens(), out.constraint_complete, strict=True):
        assert _is_prefix(c, ids)
        if complete:
            jsonschema.validate(json.loads(_text(tok, ids)), schema)
    assert any(out.constraint_complete)  # the random model does finish some, within 6 canvases


def test_a_regex_and_a_lark_grammar_hold_whole(model, tok):
    c = Constraint.regex(r"[a-z]{3,6}-[0-9]{2}", tok, eos_token_id=EOS)
    out = generate(model, _prompt(3), seed=1, max_new_tokens=32, max_denoising_steps=6, constraint=c,
                   eos_token_id=EOS)
    texts = [_text(tok, ids) for ids in out.new_tokens()]
    assert out.constraint_complete == [True] * 3 and all(re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", t) for t in texts)
    c = Constraint.lark('start: "yes" | "no" | "maybe"', tok, eos_token_id=EOS)
    out = generate(model, _prompt(3), seed=2, max_new_tokens=16, max_denoising_steps=4, constraint=c,
                   eos_token_id=EOS)
    assert {_text(tok, ids) for ids in out.new_tokens()} <= {"yes", "no", "maybe"}


def test_a_budget_too_small_says_so_and_keeps_a_valid_prefix(model, tok):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 60}}, "required": ["text"]}
    c = Constraint.json_schema(schema, tok, eos_token_id=EOS)
    out = generate(model, _prompt(), seed=0, max_new_tokens=16, max_denoising_steps=4, constraint=c,
                   eos_token_id=EOS)
    assert out.constraint_complete == [False, False]
    assert all(_is_prefix(c, ids) and _text(tok, ids).startswith('{"text": "') for ids in out.new_tokens())


def test_a_sentence_finished_past_the_budget_is_not_complete(model, tok):
    """max_new_tokens 1 with a JSON object: the canvas writes '{' then its closer's '}' past the budget, which is
    never output; the grammar advanced over the whole canvas and called '{' complete (the server answered "stop")."""
    c = Constraint.json_object(tok, eos_token_id=EOS)
    for budget in (1, 2):
        out = generate(model, _prompt(), seed=0, max_new_tokens=budget, max_denoising_steps=4, constraint=c,
                       eos_token_id=EOS)
        texts = [_text(tok, ids[:budget]) for ids in out.new_tokens()]
        assert out.constraint_complete == [t == "{}" for t in texts], texts
        assert budget == 2 or out.constraint_complete == [False, False]


def test_the_masked_draw_is_the_masked_distribution(tok):
    """One position, a grammar allowing three tokens: the draw's frequencies follow softmax restricted to them."""
    words = ["a", "b", "c"]
    ids = [tok.encode(w, add_special_tokens=False) for w in words]
    assert all(len(i) == 1 for i in ids), ids  # one token each in the test tokenizer
    c = Constraint.regex("a|b|c", tok, eos_token_id=EOS)
    state = c.start(1)
    z = torch.zeros(1, 1, 512)
    z[0, 0, [i[0] for i in ids]] = torch.tensor([0.0, 1.0, 2.0])
    z[0, 0, 7] = 9.0  # the most likely token overall is not allowed
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        draw, greedy, entropy, _ = state.draw(z, g)
        counts[[i[0] for i in ids].index(int(draw[0, 0]))] += 1
    want = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    assert torch.allclose(counts / counts.sum(), want, atol=0.03)
    assert int(greedy[0, 0]) == ids[2][0]
    assert float(entropy[0, 0]) == pytest.approx(float(-(want * want.log()).sum()), rel=1e-5)
    assert state.complete() == [False]  # a step's draw does not move the parser


@pytest.mark.parametrize("build, message", [
    (lambda tok: Constraint.json_schema("{not json", tok), "json_schema: not JSON"),
    (lambda tok: Constraint.regex("[a-z", tok), "cannot compile the regex: .*unclosed character class"),
    (lambda tok: Constraint.lark("start: undefined_rule", tok), "cannot compile the lark"),
    (lambda tok: Constraint.json_schema({"type": "object"}, "/nonexistent/tokenizer.json"), "cannot read"),
])
def test_what_cannot_be_compiled_is_one_error_naming_it(tok, build, message):
    with pytest.raises(ConstraintError, match=message):
        build(tok)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_keeps_the_grammar_and_closes_within_the_budget(model, tok, sampler):
    """The random model never ends a free JSON object by itself; the budget's closer ends every row, and a sampler
    that commits its own canvas (Lite, the committing samplers, the chains) has it projected onto the grammar."""
    for schema, budget in (({"type": "object"}, 40), (SCHEMAS[3], 48)):
        c = Constraint.json_schema(schema, tok, eos_token_id=EOS)
        out = generate(model, _prompt(3), seed=3, max_new_tokens=budget, max_denoising_steps=4, constraint=c,
                       eos_token_id=EOS, sampler=sampler)
        assert out.constraint_complete == [True] * 3, [_text(tok, ids) for ids in out.new_tokens()]
        for ids in out.new_tokens():
            assert len([t for t in ids if t != EOS]) <= budget  # a grammar that stops by itself needs no EOS
            jsonschema.validate(json.loads(_text(tok, ids)), schema)


GRAMMARS = [
    ("json", {"type": "object", "properties": {"mail": {"type": "string", "format": "email"},
                                              "day": {"type": "string", "format": "date"},
                                              "level": {"enum": ["low", "high"]},
                                              "xs": {"type": "array", "items": {"type": "number"}, "minItems": 2}},
              "required": ["mail", "day", "level", "xs"], "additionalProperties": False}),
    ("json", {"type": "object", "properties": {"a": {"type": "object"}, "b": {"type": "string", "minLength": 5}},
              "required": ["a", "b"]}),
    ("regex", "a*b"),
    ("regex", r"[a-z]{3,6}-[0-9]{2}"),
    ("lark", 'start: "<call>" %json {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
             ' "</call>"'),
]


@pytest.mark.parametrize("kind, source", GRAMMARS, ids=["formats", "nested+minLength", "a*b", "word-num", "lark"])
def test_the_closer_finishes_every_kind_of_grammar(tok, kind, source):
    c = getattr(Constraint, kind if kind != "json" else "json_schema")(source, tok, eos_token_id=EOS)
    state = c.start(1, max_new_tokens=64)
    m = state.matchers[0]
    path = state.closer.path(m, 200)
    assert path is not None and not m.is_stopped()  # the parser is left where it was
    assert m.consume_tokens(path) and m.is_stopped()  # with an EOS, or where the grammar stops itself
    text = _text(tok, path)
    if kind == "json":
        jsonschema.validate(json.loads(text), source)
    elif kind == "regex":
        assert re.fullmatch(source, text)
    assert state.closer.path(llguidance.LLMatcher(c.tokenizer, c.grammar), len(path) - 1) is None  # the limit


def test_the_trace_marks_what_the_grammar_pinned_and_closed(model, tok):
    c = Constraint.json_object(tok, eos_token_id=EOS)
    out = generate(model, _prompt(2), seed=0, max_new_tokens=40, max_denoising_steps=4, constraint=c,
                   eos_token_id=EOS, trace=True)
    marks = out.trace.arrays()["grammar"]
    assert marks.shape == out.trace.arrays()["argmax"].shape and set(marks.ravel().tolist()) <= {FREE, PINNED, CLOSED}
    assert (marks == CLOSED).any()  # the random model never closes an object by itself
    state = c.start(1)
    for step in out.trace.steps:  # a pinned position is one where the grammar allowed exactly one token
        if step.canvas != 0:
            continue
        m = llguidance.LLMatcher(c.tokenizer, c.grammar)
        for i, t in enumerate(step.argmax[0].tolist()):
            if m.is_stopped():
                break
            bits = llguidance.numpy.allocate_token_bitmask(1, c.tokenizer.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(m, bits, 0)
            one = int(np.unpackbits(bits.view(np.uint8)).sum()) == 1
            assert (int(step.grammar[0, i]) == PINNED) == one or int(step.grammar[0, i]) == CLOSED
            assert m.consume_token(t)
    del state


def test_the_fast_kernels_run_the_readable_loop_and_the_sync_free_loop_is_refused(model, tok):
    c = Constraint.json_object(tok, eos_token_id=EOS)
    kw = dict(seed=0, max_new_tokens=40, max_denoising_steps=4, constraint=c, eos_token_id=EOS)
    fast = generate(model, _prompt(), impl="fast", **kw)
    assert fast.new_tokens() == generate(model, _prompt(), impl="fast", loop="readable", **kw).new_tokens()
    assert fast.constraint_complete == [True, True]
    with pytest.raises(GenerationError, match="readable loop"):
        generate(model, _prompt(), impl="fast", loop="sync-free", **kw)


def test_a_date_is_a_calendar_date_as_validators_read_it(tok):
    """llguidance's "date" format takes 0000-00-00 and 02-31; a schema's date is compiled as DATE_PATTERN, which
    holds exactly the dates Python's date.fromisoformat (jsonschema's FormatChecker) accepts."""
    import datetime

    from dgemma.sampling.schema_rules import DATE_PATTERN

    rx = re.compile(DATE_PATTERN)
    for y in [*range(0, 12), *range(396, 404), *range(1896, 1904), *range(1996, 2005), 9999]:
        for mo in range(14):
            for d in range(33):
                text = f"{y:04d}-{mo:02d}-{d:02d}"
                try:
                    valid = bool(datetime.date.fromisoformat(text))
                except ValueError:
                    valid = False
                assert valid == bool(rx.match(text)), text
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
    c = Constraint.json_schema(schema, tok, eos_token_id=EOS)
    state = c.start(1, max_new_tokens=64)
    closed = json.loads(_text(tok, state.closer.path(state.matchers[0], 100)))
    jsonschema.validate(closed, schema, format_checker=jsonschema.FormatChecker())
    m = llguidance.LLMatcher(c.tokenizer, c.grammar)
    assert m.consume_tokens(tok.encode('{"d": "2024-02-2', add_special_tokens=False))
    assert m.validate_tokens(tok.encode('9"}', add_special_tokens=False)) == len(tok.encode('9"}',
                                                                                         add_special_tokens=False))
    m = llguidance.LLMatcher(c.tokenizer, c.grammar)
    assert m.consume_tokens(tok.encode('{"d": "2023-02-2', add_special_tokens=False))
    assert m.validate_tokens(tok.encode('9"}', add_special_tokens=False)) < len(tok.encode('9"}',
                                                                                         add_special_tokens=False))


# --- grammars the engine gives up on: refused up front, or an honest incomplete row (round-three hardening) --------

RECURSIVE = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
             "$ref": "#/$defs/a"}  # every object needs another inside it: no finite sentence


@pytest.mark.parametrize("build, words", [
    (lambda tok: Constraint.json_schema(RECURSIVE, tok, eos_token_id=EOS),
     r"the grammar engine gives up on the json schema within its first 32 tokens: .*Too many items"),
    (lambda tok: Constraint.lark('start: start "a"', tok, eos_token_id=EOS),
     r"the grammar engine cannot start the lark"),
    (lambda tok: Constraint.regex("", tok, eos_token_id=EOS), r"regex: the pattern is empty"),
    (lambda tok: Constraint.json_schema({"const": "x" * 70000}, tok, eos_token_id=EOS),
     r"the json schema is 70,013 characters; at most 65,536 are compiled"),
    (lambda tok: Constraint.json_schema({"type": "object", "additionalProperties": {"type": "object"},
                                         "minProperties": 3}, tok, eos_token_id=EOS),
     r"minProperties 3 is more than its 0 required key\(s\)"),
    (lambda tok: Constraint.json_schema({"type": "object", "properties": {"inner": {
        "type": "object", "minProperties": 2, "required": ["a"]}}}, tok, eos_token_id=EOS),
     r"properties\.inner: minProperties 2 is more than its 1 required key"),
], ids=["recursive-ref", "left-recursive-lark", "empty-regex", "over-the-size-cap", "min-properties",
        "nested-min-properties"])
def test_a_grammar_with_no_honest_output_is_refused_when_compiled(tok, build, words):
    """Each of these used to compile and then answer an empty or invalid output marked complete."""
    with pytest.raises(ConstraintError, match=words):
        build(tok)


def test_min_properties_covered_by_required_keys_still_compiles(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "minProperties": 2, "const_like": {"const": {"minProperties": 9}}}
    assert Constraint.json_schema(schema, tok, eos_token_id=EOS).kind == "json_schema"


def test_a_row_llguidance_gives_up_on_mid_way_is_incomplete_never_complete(tok):
    """A grammar whose Earley rows outgrow llguidance's limit after 59 tokens: the row that reaches it is recorded as
    failed, draws nothing more, and is not complete (it used to be reported complete: the error state reads as
    stopped), while the other row carries on."""
    c = Constraint.lark('start: s\ns: ' + " | ".join(" ".join(["s"] * j) for j in range(8, 1, -1)) + ' | "a"', tok,
                        eos_token_id=EOS)
    a = c.tokenizer.tokenize_str("a")[0]
    state = c.start(2)
    state.commit(torch.tensor([[a] * 64, [a] + [EOS] * 63]))
    assert state.failed[0] is not None and "Current row has" in state.failed[0] and state.failed[1] is None
    assert state.complete() == [False, True]
    _, greedy, _, _ = state.draw(torch.zeros(2, 4, 512), torch.Generator().manual_seed(0))
    assert greedy[0].tolist() == [EOS] * 4


def test_a_row_over_its_step_budget_ends_incomplete_and_others_go_on(tok):
    """The time budget of one draw: once spent (here at once), the row's grammar stops and says why."""
    c = Constraint.json_schema({"type": "object"}, tok, eos_token_id=EOS)
    state = c.start(1, max_new_tokens=16)
    state.step_seconds = 1e-9
    _, greedy, _, _ = state.draw(torch.zeros(1, 4, 512), torch.Generator().manual_seed(0))
    assert greedy[0].tolist() == [EOS] * 4 and state.complete() == [False]
    assert state.failed[0] == "the grammar work took over 1e-09 s in one step"


@pytest.mark.parametrize("flag, value, words", [
    ("--regex", "", r"--regex: regex: the pattern is empty"),  # used to drop the constraint silently
    ("--json-schema", RECURSIVE, r"--json-schema: the grammar engine gives up on the json schema within its first "
                                 r"32 tokens: .*Too many items"),  # used to answer "" as "1 of 1 output\(s\) complete"
])
def test_the_cli_refuses_a_grammar_with_no_honest_output_in_one_line(tmp_path, capsys, tok_path, flag, value, words):
    from dgemma import cli

    if isinstance(value, dict):
        (tmp_path / "schema.json").write_text(json.dumps(value))
        value = str(tmp_path / "schema.json")
    code = cli.main(["generate", "--preset", "tiny", "--random-init", "--tokenizer", str(tok_path), "--prompt", "Hi",
                     "--max-new-tokens", "16", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.fullmatch(f"dgemma generate: error: {words}.*", err[0]), err


@pytest.mark.integration  # about 10 s: llguidance's Earley rows grow with every token until it gives up
def test_the_cli_reports_a_grammar_that_failed_mid_way_as_incomplete_and_exits_1(tmp_path, capsys, tok_path):
    """A grammar whose Earley rows outgrow llguidance's limit after about 19 tokens (EOS held off by logit_bias): the
    output is the prefix it had, the summary says it is not complete, and one error line says why (it used to read
    "1 of 1 output(s) complete" with exit 0)."""
    from dgemma import cli

    (tmp_path / "g.lark").write_text('start: s\ns: ' + " | ".join(" ".join(["s"] * j) for j in range(16, 1, -1))
                                     + ' | "a"\n')
    code = cli.main(["generate", "--preset", "tiny", "--random-init", "--tokenizer", str(tok_path), "--prompt", "Hi",
                     "--grammar", str(tmp_path / "g.lark"), "--max-new-tokens", "32", "--max-denoising-steps", "2",
                     "--logit-bias", "1=-100,4=-100", "--seed", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-2].startswith("grammar: 0 of 1 output(s) complete"), err
    assert re.fullmatch(r"dgemma generate: error: --grammar: the grammar failed for 1 of 1 output\(s\), which are "
                        r"incomplete \(output 1: the grammar engine gave up: .*Current row has .*\)", err[-1]), err
