"""Key redaction: of a whole result (every text holding a key, or an 8-character run of one,
redacted before a result leaves the outer tier), and of every text a log record or an
observed event carries (`Secrets`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import (
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any

import attrs

from toolloop_fsm.providers._secrecy import FRAGMENT, fragment_pattern, redact


class Secrets:
    """The API keys of one turn, for the texts that leave it other than the result: a log
    record, an observed event. Under the outer tier they are every key of the chain; a
    `run_tool_loop` turn knows none (its adapters redact their own), so only ``key=`` query
    values and URL passwords are masked there."""

    __slots__ = ("_leak", "keys")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = tuple(key for key in keys if key)
        self._leak = fragment_pattern(self.keys)

    def clean(self, text: str) -> str:
        """``text`` with every key, every 8-character run of one, every ``key=`` query value
        and every URL password replaced by ``[REDACTED]``."""
        return redact(text, self.keys)

    def holds_any(self, text: str) -> bool:
        """Whether ``text`` holds a key or a run of one (a quick test before `clean`)."""
        return self._leak is not None and self._leak.search(text) is not None


#: A turn that knows no keys.
NO_SECRETS = Secrets()


class RedactedError(Exception):
    """Stands in for a host exception whose message quoted an API key."""


def _scrub(value: Any, keys: Sequence[str], leak: re.Pattern[str]) -> Any:
    """Every text in ``value`` with every key, and every 8-character run of one, redacted
    (the adapters' own rule: a server may quote a key cut short or partly masked). ``leak``
    finds the texts that need it."""
    if isinstance(value, str):
        return redact(value, keys) if leak.search(value) else value
    if isinstance(value, dict):
        return {name: _scrub(item, keys, leak) for name, item in value.items()}
    if isinstance(value, list):
        return [_scrub(item, keys, leak) for item in value]
    return value


#: Declared field types that hold no text: a number, a flag (``None`` or not), written out or
#: resolved (the converter resolves a class's annotations in place). Result values are built
#: by the engine with these types, so such fields are never read for keys.
_TEXTLESS: frozenset[object] = frozenset(
    {
        *("int", "float", "bool", "int | None", "float | None", "bool | None"),
        *(int, float, bool, int | None, float | None, bool | None),
    }
)
#: Values that hold no text, passed over without a question.
_LEAVES: frozenset[type] = frozenset({int, float, bool})
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {}
#: Joins a value's texts for one search: a match cannot span two texts unless a key holds it.
_SEPARATOR = "\x00"
_BLOCK = FRAGMENT // 2


def _text_fields(kind: type) -> tuple[str, ...]:
    """The fields of an attrs or dataclass class that can hold text, computed once a class."""
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        declared = attrs.fields(kind) if attrs.has(kind) else dataclasses.fields(kind)
        names = tuple(field.name for field in declared if field.type not in _TEXTLESS)
        _TEXT_FIELDS[kind] = names
    return names


def _gather_texts(value: Any, texts: list[str]) -> None:
    """Append every text reachable from ``value`` — strings (enum values too), in sequences,
    sets, mappings (names and values), attrs and dataclass instances — to ``texts``. These are
    at least every text the result converter would hand `_scrub`."""
    kind = type(value)
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        if kind in _LEAVES:
            return
        if isinstance(value, str):
            texts.append(value)
            return
        if isinstance(value, list | tuple | set | frozenset):
            for item in value:
                if type(item) is str:  # the common case, spared a call
                    texts.append(item)
                elif item is not None:
                    _gather_texts(item, texts)
            return
        if isinstance(value, Mapping):
            for name, item in value.items():
                _gather_texts(name, texts)
                _gather_texts(item, texts)
            return
        if not attrs.has(kind) and not (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            return
        names = _text_fields(kind)
    for name in names:
        item = getattr(value, name)
        if type(item) is str:
            texts.append(item)
        elif item is not None:
            _gather_texts(item, texts)


def _blocks(keys: Sequence[str]) -> set[str]:
    """Texts of which any piece of a key `redact` replaces holds at least one: each key's
    aligned 4-character blocks (any 8-character run of a key covers a whole one), or the key
    itself when shorter than 8 characters (only then matched whole)."""
    blocks: set[str] = set()
    for key in keys:
        if len(key) < FRAGMENT:
            blocks.add(key)
        else:
            blocks.update(key[i : i + _BLOCK] for i in range(0, len(key) - _BLOCK + 1, _BLOCK))
    return blocks


def may_hold_key(value: Any, keys: Sequence[str], leak: re.Pattern[str]) -> bool:
    """Whether any text in ``value`` holds a piece of a key ``leak`` finds — the quick test
    that spares a clean result the conversion and walk of `_scrub`. Never wrong when it
    answers no: every text is searched, joined into one; a plain substring test for the keys'
    blocks first, the pattern only if one is there."""
    texts: list[str] = []
    _gather_texts(value, texts)
    joined = _SEPARATOR.join(texts)
    if not any(block in joined for block in _blocks(keys)):
        return False
    if any(_SEPARATOR in key for key in keys):  # a piece could span two texts: one by one
        return any(leak.search(text) is not None for text in texts)
    return leak.search(joined) is not None
