"""The bounded sandbox a chat template renders in. A checkpoint's template is untrusted code that runs on every chat
request; jinja2's `ImmutableSandboxedEnvironment` keeps it from the server's objects, not from unbounded work:
`{{ 'x' * 100000000 }}` or two nested `range(100000)` loops would hold a server thread and its memory for as long as
they like. Here a render is bounded three ways, each refused with `TemplateLimitError`:

- **Size before it is made.** `*`, `+`, `**` and `%` are intercepted (jinja2's `intercepted_binops`): a string or
  list repeated or joined past `MAX_RENDER_CHARS`, an integer power of more than that many bits, or a `%` format with
  a width or precision over it is refused before anything is allocated; so is a call or filter given a width or a
  count over it (`'x'.ljust(10**9)`, `center(10**9)`, a `str.format` field as wide). `range` is the sandbox's own,
  at most 100,000 items.
- **Output.** The text is rendered in chunks (`Template.generate`) and the render stops once it passes
  `MAX_RENDER_CHARS` characters.
- **Time.** A render that runs past `RENDER_SECONDS` stops at the template's next line or function call (a trace
  function on the rendering thread, set for the render only).
"""

from __future__ import annotations

import functools
import math
import re
import sys
import time
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_CHARS = 4 * 2**20  # the longest text a chat template may write (a prompt far beyond any model's context)
RENDER_SECONDS = 2.0  # the longest one render may take
TEMPLATE_FILE = "<template>"  # the file name of a template compiled from a string (jinja2's default)
_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")  # a printf-style conversion's width, precision


class TemplateLimitError(Exception):
    """A render that would write more than MAX_RENDER_CHARS or run longer than RENDER_SECONDS."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the size checks above on `*`, `+`, `**` and `%`."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = _result_size(operator, left, right)
        if size > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"'{operator}' would make a value of ~{size:,} characters (or bits); a render may "
                                     f"write at most {MAX_RENDER_CHARS:,}")
        return super().call_binop(context, operator, left, right)

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters = {name: bounded(f) for name, f in self.filters.items()}

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        """A call from the template: an int argument over MAX_RENDER_CHARS (a width, a count: `'x'.ljust(10**9)`)
        or a `str.format` field as wide is refused before the call makes anything; `range` keeps the sandbox's own
        limit."""
        if __obj is not __self.globals.get("range"):
            _check_arguments(args, kwargs)
        wrapped = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)  # the sandbox's str.format wrapper
        if isinstance(wrapped, str):
            _check_arguments([int(x) for x in re.findall(r"\d+", wrapped)], {})
        return super().call(__context, __obj, *args, **kwargs)


def bounded(f: Any) -> Any:
    """Filter `f` with its arguments after the value checked as `BoundedSandbox.call` checks a call's
    (`center(10**9)`, `batch(10**9, 'x')`); jinja2's pass_context / pass_environment marks are kept."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # the context or environment, the value

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[skip:], kwargs)
        return f(*args, **kwargs)

    return checked


def _check_arguments(args: Any, kwargs: dict[str, Any]) -> None:
    big = max((abs(a) for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)), default=0)
    if big > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"a width or count of {big:,}; a render may write at most {MAX_RENDER_CHARS:,} "
                                 "characters")


def _result_size(operator: str, left: Any, right: Any) -> int:
    """The size of `left operator right` before it is computed: characters or items of a repeated or joined
    sequence, bits of an integer power, the widest field of a `%` format; 0 where it is small by nature."""
    seq = (str, list, tuple)
    if operator == "*":
        n, s = (right, left) if isinstance(left, seq) else (left, right)
        return len(s) * n if isinstance(s, seq) and isinstance(n, int) else 0
    if operator == "+":
        return len(left) + len(right) if isinstance(left, seq) and isinstance(right, seq) else 0
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            return int(right * math.log2(abs(left)))
        return 0
    if operator == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        widest = max((int(x) for m in _WIDTH.finditer(left) for x in m.groups() if x and x != "*"), default=0)
        if "*" in "".join(x or "" for m in _WIDTH.finditer(left) for x in m.groups()):
            widest = max([widest, *(abs(a) for a in args if isinstance(a, int))])
        return widest
    return 0


def render(template: Any, variables: dict[str, Any]) -> str:
    """`template` (compiled by a `BoundedSandbox`) rendered with `variables`, within MAX_RENDER_CHARS and
    RENDER_SECONDS (TemplateLimitError otherwise)."""
    deadline = time.monotonic() + RENDER_SECONDS

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"rendering took longer than {RENDER_SECONDS:g} s")
        return trace if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        chunks, written = [], 0
        for chunk in template.generate(**variables):
            written += len(chunk)
            if written > MAX_RENDER_CHARS:
                raise TemplateLimitError(f"its output passed {MAX_RENDER_CHARS:,} characters")
            chunks.append(chunk)
        return "".join(chunks)
    finally:
        sys.settrace(previous)
