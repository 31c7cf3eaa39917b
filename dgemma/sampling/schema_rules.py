"""The JSON Schema rules applied before llguidance compiles a schema (docs/sampling.md, "Structured output"): a
calendar "date" as validators read it, and the refusal of a `minProperties` that llguidance would meet with repeated
keys. Pure Python: no llguidance needed to check or rewrite a schema. Apart from constraint.py (the grammar that
runs while sampling) because these are rules about the schema document alone, checked before any grammar exists."""

from __future__ import annotations

from typing import Any


class ConstraintError(ValueError):
    """A constraint that cannot be built: llguidance missing, or a schema, pattern or grammar it cannot compile, too
    large, with an empty language, or one llguidance gives up on at its start (the message names which, and why)."""


def distinct_keys(schema: Any, where: str = "") -> None:
    """Refuse an object schema whose `minProperties` its `required` keys do not cover: llguidance does not keep
    the keys of additional properties distinct, so it would meet the count with repeated keys (`{"": {}, "": {}}`),
    which a JSON reader collapses into fewer properties than asked."""
    if isinstance(schema, list):
        for i, x in enumerate(schema):
            distinct_keys(x, f"{where}[{i}]")
    elif isinstance(schema, dict):
        least, required = schema.get("minProperties"), schema.get("required")
        named = len(set(required)) if isinstance(required, list) else 0
        if isinstance(least, int) and not isinstance(least, bool) and least > named:
            raise ConstraintError(f"{where.lstrip('.') or 'the schema'}: minProperties {least} is more than its "
                                  f"{named} required key(s); the grammar engine cannot keep further keys distinct, "
                                  "so list them in properties and required instead")
        for k, v in schema.items():
            if k not in ("const", "enum", "default", "examples"):  # values, not schemas
                distinct_keys(v, f"{where}.{k}")


# A calendar date of years 0001-9999 (leap days included), what validators accept as a JSON Schema "date" (Python's
# date.fromisoformat, which jsonschema's FormatChecker uses); llguidance's own "date" also takes 0000 and 02-31.
_YEAR = r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
DATE_PATTERN = (rf"^(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
                rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)$")


def calendar_dates(schema: Any) -> Any:
    """`schema` with each string `"format": "date"` (without its own pattern) as DATE_PATTERN."""
    if isinstance(schema, list):
        return [calendar_dates(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: calendar_dates(v) for k, v in schema.items()}
    if out.get("format") == "date" and "pattern" not in out:
        del out["format"]
        out["pattern"] = DATE_PATTERN
    return out
