"""Decoding a tool call's accumulated argument text, shared by every adapter.

`decode_arguments(text, cut=…)` returns ``(arguments, truncated, parse_error)``:

* blank text → ``{}`` (a call without parameters) — unless ``cut``: a call cut off before
  its first argument byte is a truncated call, not a call with no arguments;
* a complete JSON document → its value (whatever its type; the loop validates that it is
  an object);
* an incomplete JSON document — it is a valid *prefix* of some JSON text but ends early,
  because the stream ended, finish was ``length``/``max_tokens``, or the model simply stopped
  — is repaired by dropping the incomplete tail (a half key, a half value, a number or
  literal that could still go on, a dangling ``,`` or ``:`` and the key before it) and
  closing the open containers; ``truncated=True``. Nothing is ever invented: the result is a
  "sub-object" of every completion of the text (same keys with sub-object values, or fewer;
  a list prefix; equal scalars). A cut payload with no complete member decodes to ``{}``;
* malformed text (a bad token, trailing garbage, bad escape) → ``parse_error`` is the
  ``json`` module's message and ``arguments`` is the raw text.

Callers decode once, when the call is known to be over (finish chunk, block stop, stream
end) — never because the text seen so far happens to parse.
"""

from __future__ import annotations

import json
import re
from typing import Any

_WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_CLOSER = {"{": "}", "[": "]"}

# Parser states inside a container.
_OBJ_KEY_OR_END = 0  # just after "{"
_OBJ_KEY = 1  # after ","
_OBJ_COLON = 2
_OBJ_VALUE = 3
_OBJ_COMMA_OR_END = 4
_ARR_VALUE_OR_END = 5  # just after "["
_ARR_VALUE = 6  # after ","
_ARR_COMMA_OR_END = 7


class _Malformed(Exception):
    pass


def decode_arguments(text: str, *, cut: bool) -> tuple[Any, bool, str | None]:
    """Decode a tool call's argument text; see the module docstring for the rules."""
    if not text.strip():
        return {}, cut, None
    try:
        return json.loads(text), False, None
    except ValueError as exc:
        error = str(exc)
    repaired = _repair_prefix(text)
    if repaired is None:
        return text, False, error
    try:
        return json.loads(repaired), True, None
    except ValueError:  # pragma: no cover - the scanner only emits valid prefixes
        return text, False, error


def _string_end(text: str, start: int) -> int | None:
    """Index just past the string opening at ``start``; None if the text ends inside it."""
    i = start + 1
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            return i + 1
        if ch == "\\":
            if i + 1 >= n:
                return None
            escape = text[i + 1]
            if escape not in _ESCAPES:
                raise _Malformed
            if escape == "u":
                digits = text[i + 2 : i + 6]
                if any(d not in _HEX for d in digits):
                    raise _Malformed
                if len(digits) < 4:
                    return None
                i += 6
            else:
                i += 2
            continue
        if ch < " ":
            raise _Malformed  # raw control characters are invalid in JSON strings
        i += 1
    return None


def _repair_prefix(text: str) -> str | None:
    """The longest complete-member cut of ``text`` with containers closed.

    Returns None when ``text`` is malformed (no JSON text starts with it) or when it is a
    complete document followed by garbage.
    """
    stack: list[str] = []
    states: list[int] = []
    # (cut position, closers) at the last point where a valid document could be formed.
    safe: tuple[int, str] | None = None
    top_done = False
    n = len(text)
    i = 0

    def closers() -> str:
        return "".join(_CLOSER[c] for c in reversed(stack))

    def value_done(end: int) -> None:
        nonlocal safe, top_done
        if not states:
            top_done = True
            return
        states[-1] = _OBJ_COMMA_OR_END if stack[-1] == "{" else _ARR_COMMA_OR_END
        safe = (end, closers())

    try:
        while i < n:
            ch = text[i]
            if ch in _WHITESPACE:
                i += 1
                continue
            if top_done:
                return None  # trailing garbage after a complete document
            state = states[-1] if states else None
            expecting_value = state in (None, _OBJ_VALUE, _ARR_VALUE, _ARR_VALUE_OR_END)
            if ch in "{[":
                if not expecting_value:
                    return None
                stack.append(ch)
                states.append(_OBJ_KEY_OR_END if ch == "{" else _ARR_VALUE_OR_END)
                safe = (i + 1, closers())
                i += 1
            elif ch in "}]":
                allowed = (
                    (_OBJ_KEY_OR_END, _OBJ_COMMA_OR_END)
                    if ch == "}"
                    else (_ARR_VALUE_OR_END, _ARR_COMMA_OR_END)
                )
                if state not in allowed:
                    return None
                stack.pop()
                states.pop()
                i += 1
                value_done(i)
            elif ch == ",":
                if state == _OBJ_COMMA_OR_END:
                    states[-1] = _OBJ_KEY
                elif state == _ARR_COMMA_OR_END:
                    states[-1] = _ARR_VALUE
                else:
                    return None
                i += 1
            elif ch == ":":
                if state != _OBJ_COLON:
                    return None
                states[-1] = _OBJ_VALUE
                i += 1
            elif ch == '"':
                end = _string_end(text, i)
                if end is None:
                    break  # a half key or half string value: dropped
                if state in (_OBJ_KEY_OR_END, _OBJ_KEY):
                    states[-1] = _OBJ_COLON
                elif expecting_value:
                    value_done(end)
                else:
                    return None
                i = end
            elif ch == "-" or ch.isdigit():
                if not expecting_value:
                    return None
                end = i
                while end < n and text[end] in _NUMBER_CHARS:
                    end += 1
                if end == n:
                    # A number at the very end could still go on ("12" of "123"): dropped,
                    # unless it cannot even begin a number.
                    if not _NUMBER.fullmatch(text[i:end]) and not _number_prefix(text[i:end]):
                        return None
                    break
                if not _NUMBER.fullmatch(text[i:end]):
                    return None
                i = end
                value_done(end)
            elif ch.isalpha():
                if not expecting_value:
                    return None
                end = i
                while end < n and text[end].isalpha():
                    end += 1
                word = text[i:end]
                if end == n:
                    if not any(lit.startswith(word) for lit in _LITERALS):
                        return None
                    if word not in _LITERALS:
                        break  # a half literal: dropped
                elif word not in _LITERALS:
                    return None
                i = end
                value_done(end)
            else:
                return None
    except _Malformed:
        return None
    if top_done:
        return None  # complete (json.loads would have accepted it) or garbage after it
    if safe is None:
        # Nothing complete: a cut before or inside the first token of the document.
        return "{}"
    position, closing = safe
    return text[:position] + closing


def _number_prefix(fragment: str) -> bool:
    """Whether ``fragment`` can begin a JSON number (e.g. ``-``, ``1.``, ``2e``, ``2e-``)."""
    return _NUMBER.fullmatch(fragment + "0") is not None or (
        _NUMBER.fullmatch(fragment + "1") is not None
    )


__all__ = ["decode_arguments"]
