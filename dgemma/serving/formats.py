"""What a request's output must be, as grammars (dgemma/sampling/constraint.py): `response_format` (json_object,
json_schema) and a forced `tool_choice` ("required", a named function) in the template's tool-call syntax; and the
`tools` a request gives its template. Pure functions: a body in, a Constraint (or None) out, or an APIError naming the
field (docs/serving.md)."""

from __future__ import annotations

from typing import Any

from dgemma.data.templates import ChatTemplate, tool_call_grammar
from dgemma.data.tokenizer import Tokenizer
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.errors import APIError, as_list


def response_constraint(fmt: Any, tokenizer: Tokenizer, base: GenerationConfig) -> Any:
    """The Constraint of a request's response_format, chat or completions (dgemma/sampling/constraint.py): None for none
    or {"type": "text"}; {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"name",
    "schema", "strict", "description"}}: JSON valid against the schema (always strictly: the grammar admits nothing
    else). A schema the grammar engine cannot compile is a 400 naming it."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    where = "response_format"
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(f"{where}: must be {{'type': 'text'}}, {{'type': 'json_object'}} or {{'type': 'json_schema', "
                       f"'json_schema': {{...}}}}, got {fmt!r}", param=where)
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra or (fmt["type"] != "json_schema" and "json_schema" in fmt):
        raise APIError(f"{where}: unknown field(s) {', '.join(extra or ['json_schema'])} for type "
                       f"{fmt['type']!r}", param=where)
    from dgemma.sampling.constraint import Constraint, ConstraintError

    common = {"eos_token_id": base.eos_token_id}
    try:
        if fmt["type"] == "json_object":
            return Constraint.json_object(tokenizer, **common)
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(f"{where}.json_schema: must be an object with a 'schema' object, got {spec!r}",
                           param=where)
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown:
            raise APIError(f"{where}.json_schema: unknown field(s) {', '.join(unknown)}", param=where)
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise APIError(f"{where}.json_schema.name: must be a non-empty string, got {spec.get('name')!r}",
                           param=where)
        if spec.get("strict") not in (None, True, False):
            raise APIError(f"{where}.json_schema.strict: must be true or false, got {spec['strict']!r}", param=where)
        return Constraint.json_schema(spec.get("schema", {}), tokenizer, **common)
    except ConstraintError as e:
        raise APIError(f"{where}: {e}", param=where) from None


def tools_of(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and not named_choice(choice):
        raise APIError(f"tool_choice: must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                       f"{{'name': NAME}}}}, got {choice!r}", param="tool_choice")
    tools = body.get("tools")
    if tools is None:
        return None
    for j, tool in enumerate(as_list(tools, "tools")):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("parameters", {}), dict):
            raise APIError(f"tools[{j}]: must be {{'type': 'function', 'function': {{'name', 'description', "
                           "'parameters': {...}}}}", param="tools")
    return None if choice == "none" or not tools else tools


def named_choice(choice: Any) -> bool:
    return isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "function"} \
        and isinstance(choice["function"], dict) and set(choice["function"]) == {"name"} \
        and isinstance(choice["function"]["name"], str)


def tool_constraint(body: dict[str, Any], tools: list[dict[str, Any]] | None, template: ChatTemplate,
                    tokenizer: Tokenizer, base: GenerationConfig) -> Any:
    """The Constraint of tool_choice "required" (one or more calls, one if parallel_tool_calls is false) or a named
    function (one call to it): the template's tool-call syntax as a grammar (templates.tool_call_grammar) with each
    function's parameters as its arguments' JSON Schema. None for "auto" and "none"."""
    choice = body.get("tool_choice")
    if choice not in ("required",) and not named_choice(choice):
        return None
    if not tools:
        raise APIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    convention = template.tool_convention  # the template's own, else the default tool prompt's
    if named_choice(choice):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise APIError(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    from dgemma.sampling.constraint import JSON_LAYOUT, Constraint, ConstraintError
    from dgemma.sampling.schema_rules import calendar_dates

    tools = calendar_dates(tools)  # each function's dates as validators read them, as for response_format
    specials = {text: i for i, text in tokenizer.special_tokens().items()}
    parallel = choice == "required" and body.get("parallel_tool_calls") is not False
    grammar = tool_call_grammar(convention, tools, parallel=parallel, special_ids=specials, json_layout=JSON_LAYOUT)
    try:
        return Constraint.lark(grammar, tokenizer, eos_token_id=base.eos_token_id)
    except ConstraintError as e:
        raise APIError(f"tools: {e}", param="tools") from None


MAX_CALL_SEARCH = 1 << 16  # tokens the shortest forced call is looked for within, to say how many it needs


def check_call_budget(forced: Any, max_new_tokens: int, field: str, *, given: bool = True) -> None:
    """A 400 naming the max_tokens `field` where a forced tool call cannot fit in `max_new_tokens` (the request's,
    or the server's default where not `given`): the budget must hold the shortest call the grammar's closer writes
    (`Constraint.shortest`), else the output would end inside the call's markup."""
    if forced.shortest(max_new_tokens) is None:
        need = forced.shortest(MAX_CALL_SEARCH)
        at_least = f"at least {need:,} tokens" if need is not None else f"over {MAX_CALL_SEARCH:,} tokens"
        got = f"{max_new_tokens:,}" if given else f"the server's default {max_new_tokens:,}"
        raise APIError(f"{field}: a forced tool_choice needs {at_least} here (the shortest call to these tools, EOS "
                       f"included), got {got}", param=field)
