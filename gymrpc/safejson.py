"""The one JSON parser for text that comes from a caller: bounded depth and number size.

Python's `json.loads` recurses once per nesting level (50,000 levels are a RecursionError) and
turns a number of more than 4,300 digits into a ValueError only after scanning it; neither is
the refusal the protocol promises. `loads` checks the nesting depth before parsing (strings are
skipped, so brackets inside them do not count), refuses integers and floats longer than
`MAX_NUMBER_LENGTH` characters and the non-JSON constants `NaN` / `Infinity`, and raises only
`ValueError`s: `json.JSONDecodeError` for malformed text, `JsonLimit` for text past a bound.
Every caller turns those into its own refusal (an `is_error` tool result, INVALID_ARGUMENT
naming the field, a corrupt snapshot).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 100
"""Nesting levels of arrays and objects; real tool arguments and schemas use a handful."""
MAX_NUMBER_LENGTH = 100
"""Characters of one number literal: far beyond any float, well below int()'s 4,300-digit limit."""

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class JsonLimit(ValueError):
    """The text is JSON (or may be) but exceeds a bound: too deep, a number too long, NaN."""


def loads(text: str | bytes | bytearray, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text within the bounds; ValueError (`JSONDecodeError` or `JsonLimit`) otherwise."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")  # UnicodeDecodeError is a ValueError
    depth = nesting_depth(text, stop_at=max_depth)
    if depth > max_depth:
        raise JsonLimit(f"JSON nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:  # not reached with the depth check; never let it escape as INTERNAL
        raise JsonLimit(f"JSON nests deeper than {max_depth} levels") from None


def nesting_depth(text: str, *, stop_at: int | None = None) -> int:
    """Deepest array/object nesting outside strings; counting ends once past `stop_at`."""
    depth = peak = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > peak:
                peak = depth
                if stop_at is not None and peak > stop_at:
                    break
        else:
            depth -= 1
    return peak


def _int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_LENGTH:
        raise JsonLimit(f"a JSON number has {len(literal)} digits; at most {MAX_NUMBER_LENGTH} are accepted")
    return int(literal)


def _float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_LENGTH:
        raise JsonLimit(f"a JSON number has {len(literal)} characters; at most {MAX_NUMBER_LENGTH} are accepted")
    return float(literal)


def _constant(name: str) -> Any:
    raise JsonLimit(f"{name} is not JSON")
