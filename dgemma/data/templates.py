"""Chat templates and the output parser of `dgemma serve`.

`load_chat_template(dir, ...)` finds the checkpoint's template (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`) and renders it as transformers' `apply_chat_template` does: jinja2's `ImmutableSandboxedEnvironment`
(a template is untrusted code) with `trim_blocks`, `lstrip_blocks`, `loopcontrols`, `raise_exception`, `tojson` and
`strftime_now`. Without one, dgemma's own Gemma turn template (`tokenizer.format_chat`) is used.

`OutputParser` splits generated text by the conventions a template uses for thinking (`<|channel>thought\\n...
<channel|>`, `<think>...</think>`) and tool calls (`<|tool_call>call:NAME{...}<tool_call|>`,
`<tool_call>{json}</tool_call>`), incrementally, so a stream can send `reasoning_content` and `tool_calls` as they
close instead of plain text.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dgemma.data.tokenizer import BOS, Tokenizer, encode_template, format_chat
from dgemma.data.tool_prompt import needs_tool_prompt, tool_prompt_messages
from dgemma.io import fsio

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """A chat template cannot be read, or refuses the messages (its `raise_exception`); the message says which."""


@dataclass(frozen=True)
class Convention:
    """One way a template marks a span of the output: thinking ("reasoning") or a tool call ("tool")."""

    name: str
    kind: str  # "reasoning" or "tool"
    open: str
    close: str
    detect: str  # a template whose source contains this uses the convention


GEMMA_THOUGHT = Convention("gemma-thought", "reasoning", "<|channel>thought", "<channel|>", "<|channel>")
THINK = Convention("think", "reasoning", "<think>", "</think>", "<think>")
GEMMA_TOOL_CALL = Convention("gemma-tool-call", "tool", "<|tool_call>", "<tool_call|>", "<|tool_call>")
JSON_TOOL_CALL = Convention("json-tool-call", "tool", "<tool_call>", "</tool_call>", "<tool_call>")
CONVENTIONS = (GEMMA_THOUGHT, THINK, GEMMA_TOOL_CALL, JSON_TOOL_CALL)
BUILTIN_CONVENTIONS = (GEMMA_THOUGHT, GEMMA_TOOL_CALL)  # Gemma 4's, for dgemma's built-in Gemma template
DEFAULT_TOOL_CALL = JSON_TOOL_CALL  # the format of dgemma's tool prompt, for a template with no tool-call syntax


class ChatTemplate:
    """A chat template: `source` (Jinja) from `origin`, or None for dgemma's built-in Gemma template. `tool_source`
    is the `tool_use` variant of a tokenizer_config.json that names one."""

    def __init__(self, source: str | None, *, origin: str = "dgemma's Gemma template",
                 special_tokens: dict[str, str] | None = None, tool_source: str | None = None):
        self.source, self.origin, self.tool_source = source, origin, tool_source
        self.special_tokens = {"bos_token": BOS, **(special_tokens or {})}
        self._compiled = {s: _compile(s, origin) for s in (source, tool_source) if s is not None}
        text = (source or "") + (tool_source or "")
        self.conventions = BUILTIN_CONVENTIONS if source is None else tuple(c for c in CONVENTIONS if c.detect in text)
        # the format of a tool call: the template's own, else dgemma's default tool prompt's (data/tool_prompt.py),
        # which describes the tools, calls and results to a template that writes none (the built-in one included)
        own = next((c for c in self.conventions if c.kind == "tool"), None) if source is not None else None
        self.tool_prompt = own is None
        self.tool_convention = own or DEFAULT_TOOL_CALL
        if self.tool_convention not in self.conventions:
            self.conventions += (self.tool_convention,)
        # the variables the template reads that its caller may set (enable_thinking, reasoning_effort, ...)
        self.variables = frozenset(v for t in self._compiled.values() for v in _undeclared(t)) - self.reserved
        self._check_bounded()

    @property
    def reserved(self) -> frozenset[str]:
        """The variables `render` sets itself: a caller's template kwargs may not."""
        return frozenset({"messages", "tools", "add_generation_prompt", "raise_exception", "strftime_now",
                          *self.special_tokens})

    @property
    def builtin(self) -> bool:
        return self.source is None

    def _check_bounded(self) -> None:
        """Refuse, when it loads, a template that passes the render limits (dgemma/data/template_sandbox.py) on the
        plainest conversation: it would fail every request. (Other errors may depend on the messages, and wait.)"""
        if self.source is None:
            return
        from dgemma.data.template_sandbox import TemplateLimitError

        try:
            self.render([{"role": "user", "content": "Hi"}])
        except ChatTemplateError as e:
            if isinstance(e.__context__, TemplateLimitError):
                raise ChatTemplateError(f"{self.origin}: unusable chat template: {e}") from None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of `messages` (with the generation prompt, unless `add_generation_prompt` is False: the
        conversation as history, which fine-tuning cuts answers from); `kwargs`: more variables for the template
        (a request's chat_template_kwargs: enable_thinking, ...), none of `reserved`. A template's refusal raises
        ChatTemplateError."""
        clash = sorted(set(kwargs or {}) & self.reserved)
        if clash:
            raise ChatTemplateError(f"template kwargs may not set {', '.join(clash)} (the renderer sets them)")
        if self.tool_prompt and needs_tool_prompt(messages, tools):
            messages, tools = tool_prompt_messages(messages, tools), None
        if self.source is None:
            try:
                return _builtin_format(messages, add_generation_prompt)
            except ValueError as e:
                raise ChatTemplateError(f"messages: {e}") from None
        import jinja2

        from dgemma.data.template_sandbox import TemplateLimitError, render

        template = self._compiled[self.tool_source if tools and self.tool_source is not None else self.source]
        try:  # within the sandbox's size and time limits
            text = render(template, {**(kwargs or {}), "messages": messages, "tools": tools or None,
                                     "add_generation_prompt": add_generation_prompt, **self.special_tokens})
            text.encode("utf-8")  # a lone surrogate the template wrote ("\ud800") is no text a tokenizer takes
            return text
        except TemplateLimitError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) passed a render limit: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}): {e}") from None
        except Exception as e:  # untrusted code tripping on the request's messages (any error: OverflowError, ...)
            raise ChatTemplateError(f"chat template ({self.origin}) cannot render these messages: "
                                    f"{type(e).__name__}: {e}") from None

    def encode(self, tokenizer: Tokenizer, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt token ids: the rendered text with its control tokens as single ids and no second <bos>."""
        return encode_template(tokenizer, self.render(messages, tools, kwargs=kwargs))

    def opened(self, prompt: str) -> Convention | None:
        """The thinking convention whose span the rendered `prompt` leaves open (a template that starts the answer
        inside `<think>`, say): the output then begins inside it. None where every span is closed."""
        for c in self.conventions:
            if c.kind == "reasoning" and prompt.rfind(c.open) > max(prompt.rfind(c.close), -1):
                return c
        return None

    def continuation(self, history: list[dict[str, Any]], user: str) -> str | None:
        """The text that follows a model answer to `history` when the user answers with `user`: what the template
        renders after the answer for [*history, answer, user turn] (closing the answer's turn, the user turn, the
        next generation prompt). A multi-turn chat appends it to the tokens it generated instead of re-encoding the
        conversation. None when the template does not render the history it was given unchanged followed by the
        answer (one that drops earlier thinking, say): the conversation must then be encoded whole."""
        answer = f"DGEMMA{secrets.token_hex(8)}ANSWER"  # a word no template rewrites (trim, escaping)
        before = self.render(history)
        after = self.render([*history, {"role": "assistant", "content": answer}, {"role": "user", "content": user}])
        if not after.startswith(before + answer):
            return None
        return after[len(before) + len(answer):]


def _builtin_message(m: dict[str, Any]) -> dict[str, str]:
    return {"role": m.get("role", ""), "content": m.get("content") or ""}


def _builtin_format(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    return format_chat([_builtin_message(m) for m in messages], add_generation_prompt)


def _compile(source: str, origin: str) -> Any:
    """The template compiled as transformers' `_compile_jinja_template` does (sandboxed), in a sandbox that bounds
    what a render may cost (dgemma/data/template_sandbox.py)."""
    try:
        import jinja2
        import jinja2.ext

        from dgemma.data.template_sandbox import BoundedSandbox, bounded
    except ImportError:
        raise ChatTemplateError(f"{origin}: rendering a checkpoint's chat template needs jinja2 (pip install "
                                "'dgemma[serve]')") from None

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # jinja's own escapes HTML characters, which a prompt must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = bounded(tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
        template._dgemma_source = source  # for `_undeclared`
        return template
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: not a valid Jinja template (line {e.lineno}: {e.message})") from None


def _undeclared(template: Any) -> set[str]:
    """The variables a compiled template reads without setting them."""
    import jinja2.meta

    env = template.environment
    source = getattr(template, "_dgemma_source", None)
    return set(jinja2.meta.find_undeclared_variables(env.parse(source))) if source is not None else set()


def load_chat_template(*dirs: Path | None) -> ChatTemplate:
    """The first template found in `dirs` (each: `chat_template.jinja`, then `tokenizer_config.json`'s
    `chat_template`, a string or a list of {"name", "template"}), with the special tokens tokenizer_config.json
    names; dgemma's built-in Gemma template when there is none."""
    specials: dict[str, str] = {}
    for d in dirs:
        if d is None:
            continue
        config = d / "tokenizer_config.json"
        cfg = _read_json_object(config) if os.path.lexists(config) else {}
        for key in SPECIAL_TOKEN_KEYS:
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                specials.setdefault(key, tok)
        jinja = d / "chat_template.jinja"
        if os.path.lexists(jinja):  # there: it must be readable (a FIFO or a dangling link is an error, not "none")
            try:
                text = fsio.read_text(jinja)
            except (OSError, UnicodeDecodeError, fsio.UnsafeFileError) as e:
                raise ChatTemplateError(f"{jinja}: not a readable template ({e})") from None
            return ChatTemplate(text, origin=str(jinja), special_tokens=specials)
        template = cfg.get("chat_template")
        if isinstance(template, str):
            return ChatTemplate(template, origin=f"{config} chat_template", special_tokens=specials)
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if not all(isinstance(v, str) for v in named.values()) or "default" not in named:
                raise ChatTemplateError(f"{config}: chat_template must be a string or a list of "
                                        "{name, template} with a 'default'")
            return ChatTemplate(named["default"], origin=f"{config} chat_template", special_tokens=specials,
                                tool_source=named.get("tool_use"))
        if template is not None:
            raise ChatTemplateError(f"{config}: chat_template must be a string or a list, got "
                                    f"{type(template).__name__}")
    return ChatTemplate(None, special_tokens=specials)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(fsio.read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, fsio.UnsafeFileError) as e:
        raise ChatTemplateError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


# --- the output parser -------------------------------------------------------------------------------------------

Piece = tuple[str, Any]  # ("content" | "reasoning", str) or ("tool_call", OpenAI tool call dict)


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, pieces: list[Piece]) -> ParsedOutput:
        for kind, value in pieces:
            if kind == "tool_call":
                self.tool_calls.append(value)
            elif kind == "reasoning":
                self.reasoning += value
            else:
                self.content += value
        return self


class OutputParser:
    """Splits text fed in pieces into content, reasoning and tool calls by `conventions`. Text that might be the
    start of a marker is held back until the next piece decides it; a tool call is emitted when it closes (one whose
    body does not parse is returned as content, markers included); `finish()` flushes what is left (an unclosed
    thinking span as reasoning, an unclosed call as content)."""

    def __init__(self, conventions: tuple[Convention, ...], start: Convention | None = None):
        """`start`: the span the output begins inside (the prompt opened it: `ChatTemplate.opened`)."""
        self.conventions = conventions
        self.mode: Convention | None = start
        self.buf = ""
        # Gemma writes "<|channel>thought\n": the newline is part of the marker
        self.skip_newline = start is GEMMA_THOUGHT

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            if self.mode is None:
                hits = [(i, c) for c in self.conventions if (i := self.buf.find(c.open)) >= 0]
                if not hits:
                    keep = partial_suffix(self.buf, [c.open for c in self.conventions])
                    _emit(out, "content", self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                i, c = min(hits, key=lambda h: h[0])
                _emit(out, "content", self.buf[:i])
                self.buf, self.mode = self.buf[i + len(c.open):], c
                self.skip_newline = c is GEMMA_THOUGHT
                continue
            c = self.mode
            if self.skip_newline:
                self.skip_newline = False
                if self.buf.startswith("\n"):
                    self.buf = self.buf[1:]
                    continue
            j = self.buf.find(c.close)
            if j < 0:
                if c.kind == "reasoning":
                    keep = partial_suffix(self.buf, [c.close])
                    _emit(out, "reasoning", self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            body, self.buf, self.mode = self.buf[:j], self.buf[j + len(c.close):], None
            if c.kind == "reasoning":
                _emit(out, "reasoning", body)
            else:
                call = parse_tool_call(c, body)
                out.append(("tool_call", call) if call is not None else ("content", c.open + body + c.close))
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.mode is None or self.mode.kind == "reasoning":
            _emit(out, "content" if self.mode is None else "reasoning", self.buf)
        else:
            _emit(out, "content", self.mode.open + self.buf)
        self.buf, self.mode = "", None
        return out


def parse_output(text: str, conventions: tuple[Convention, ...]) -> ParsedOutput:
    """The whole-text form of OutputParser."""
    parser = OutputParser(conventions)
    return ParsedOutput().add(parser.feed(text)).add(parser.finish())


def _emit(out: list[Piece], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `markers` (what streaming holds
    back until the next text decides it). Only the places of the text's last len(m) - 1 characters where `m`'s first
    character occurs are tried, longest first: a few per marker, so many stop strings stay cheap per canvas."""
    best = 0
    for m in markers:
        start = max(len(text) - len(m) + 1, 0)
        i = text.find(m[:1], start) if m else -1
        while 0 <= i and len(text) - i > best:
            if m.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(m[0], i + 1)
    return best


def parse_tool_call(convention: Convention, body: str) -> dict[str, Any] | None:
    """An OpenAI tool call ({"id", "type": "function", "function": {"name", "arguments": JSON text}}) from the
    body of a call span, or None if it does not parse."""
    try:
        if convention is GEMMA_TOOL_CALL:
            m = re.match(r"\s*call:\s*([A-Za-z_][\w.\-]*)\s*", body)
            if m is None:
                return None
            args, end = _gemma_value(body, m.end())
            if not isinstance(args, dict) or body[end:].strip():
                return None
            name = m.group(1)
        else:
            data = json.loads(body)
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                return None
            args = data.get("arguments", data.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                return None
            name = data["name"]
    except (ValueError, IndexError, RecursionError):  # the model wrote something else (or nested it too deep)
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def tool_call_grammar(convention: Convention, tools: Sequence[dict[str, Any]], *, parallel: bool = True,
                      special_ids: dict[str, int] | None = None, json_layout: dict[str, Any] | None = None) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` for a JSON Schema, `<[id]>` for a special token) of
    tool calls in `convention`'s syntax, one call (`parallel=False`) or more, each to one of `tools` (OpenAI's
    {"type": "function", "function": {"name", "parameters"}}) with arguments valid against its parameters:

        gemma-tool-call   <|tool_call>call:NAME{"arg": ...}<tool_call|>          (JSON, which its parser also reads)
        json-tool-call    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>

    A marker that is one special token of the tokenizer (`special_ids`: text -> id) is that token, else its text.
    `json_layout`: llguidance's JSON options for the arguments (whitespace, separators)."""
    def marker(text: str) -> str:
        sid = (special_ids or {}).get(text)
        return f"<[{sid}]>" if sid is not None else json.dumps(text)

    if convention.kind != "tool":
        raise ValueError(f"{convention.name} is not a tool-call convention")
    layout = {"x-guidance": json_layout} if json_layout else {}
    rules = []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        params = {"type": "object", **(fn.get("parameters") or {})}
        # the arguments' schema is always a root of its own, so that its "$ref": "#/$defs/..." (pydantic's nested
        # models) resolve as they do in response_format; the JSON call's envelope is literal text around it
        arguments = f"%json {json.dumps({**params, **layout})}"
        if convention is GEMMA_TOOL_CALL:
            body = f'{json.dumps("call:" + fn["name"])} {arguments}'
        else:
            envelope = '{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
            body = f'{json.dumps(envelope)} {arguments} "}}"'
        rules.append(f"call_{k}: {marker(convention.open)} {body} {marker(convention.close)}")
    calls = " | ".join(f"call_{k}" for k in range(len(tools)))
    return "\n".join([f"start: call{'+' if parallel else ''}", f"call: {calls}", *rules]) + "\n"


GEMMA_QUOTE = '<|"|>'  # Gemma 4 writes string values between these, unescaped
_JSON = json.JSONDecoder()
_BARE_END = re.compile(r"[,:{}\[\]]|\s*$")


def _gemma_value(s: str, i: int) -> tuple[Any, int]:
    """One value of Gemma 4's tool-call argument syntax at s[i:] (JSON with bare keys and <|"|>-quoted strings):
    (value, end). Raises ValueError or IndexError when it does not parse."""
    while s[i].isspace():
        i += 1
    if s.startswith(GEMMA_QUOTE, i):
        j = s.index(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
        return s[i + len(GEMMA_QUOTE):j], j + len(GEMMA_QUOTE)
    if s[i] in "{[":
        close, out_obj, out_list = "}" if s[i] == "{" else "]", {}, []
        i += 1
        while True:
            while s[i].isspace():
                i += 1
            if s[i] == close:
                return (out_obj if close == "}" else out_list), i + 1
            if close == "}":
                key, i = _gemma_key(s, i)
                while s[i].isspace():
                    i += 1
                if s[i] != ":":
                    raise ValueError(f"expected ':' at {i}")
                out_obj[key], i = _gemma_value(s, i + 1)
            else:
                value, i = _gemma_value(s, i)
                out_list.append(value)
            while s[i].isspace():
                i += 1
            if s[i] == ",":
                i += 1
            elif s[i] != close:
                raise ValueError(f"expected ',' or {close!r} at {i}")
    if s[i] == '"':
        return _JSON.raw_decode(s, i)
    end = _BARE_END.search(s, i).start()  # type: ignore[union-attr]
    word = s[i:end].strip()
    if not word:
        raise ValueError(f"empty value at {i}")
    try:
        value, used = _JSON.raw_decode(word)
        if used == len(word):
            return value, end
    except ValueError:
        pass
    return word, end  # a bare word: a string


def _gemma_key(s: str, i: int) -> tuple[str, int]:
    if s.startswith(GEMMA_QUOTE, i) or s[i] == '"':
        key, i = _gemma_value(s, i)
        return str(key), i
    m = re.compile(r"[^\s:,{}\[\]]+").match(s, i)
    if m is None:
        raise ValueError(f"expected a key at {i}")
    return m.group(0), m.end()
