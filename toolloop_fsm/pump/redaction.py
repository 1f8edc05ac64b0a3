"""Key redaction: of a whole result (every text holding a key, or an 8-character run of one,
redacted before a result leaves the outer tier), and of every text a log record or an
observed event carries (`Secrets`)."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
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
#: Values that hold no text, passed over without a question; an enumeration's members (a
#: status, a kind) are added as they are met: declared names, nothing from outside the turn.
_LEAVES: set[type] = {int, float, bool}
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {}
#: Joins a value's texts for one search: a match cannot span two texts unless a key holds it.
_SEPARATOR = "\x00"
_BLOCK = FRAGMENT // 2


def _text_fields(kind: type) -> tuple[str, ...]:
    """The fields of an attrs or dataclass class that can hold text from outside the turn,
    computed once a class: not a number or flag, not an enumeration, not a name the library
    declares (`VOCABULARY` metadata)."""
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        if attrs.has(kind):
            # the types written out as names are resolved (the result converter does it too),
            # so that an enumeration-typed field is seen as one; a name that cannot be
            # resolved leaves its field read
            with contextlib.suppress(Exception):
                attrs.resolve_types(kind)
        declared = attrs.fields(kind) if attrs.has(kind) else dataclasses.fields(kind)
        names = tuple(
            field.name
            for field in declared
            if field.type not in _TEXTLESS
            and not (isinstance(field.type, type) and issubclass(field.type, enum.Enum))
            and not field.metadata.get("vocabulary", False)
        )
        _TEXT_FIELDS[kind] = names
    return names


def _gather_texts(value: Any, texts: list[str]) -> None:
    """Append every text reachable from ``value`` that can carry something from outside the
    turn — strings, in sequences, sets, mappings (names and values), attrs and dataclass
    instances — to ``texts``. Passed over: enumeration members and fields the library fills
    with its own declared names (`_text_fields`); a key cannot reach those, and a name that
    happened to match a run of a key would tell nothing of it."""
    kind = type(value)
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        if kind in _LEAVES:
            return
        if isinstance(value, enum.Enum):
            _LEAVES.add(kind)
            return
        if isinstance(value, str):
            texts.append(value)
            return
        if isinstance(value, list | tuple | set | frozenset):
            for item in value:
                if type(item) is str:  # the common cases, spared a call: a text, or a value
                    texts.append(item)  # of a class already met (a trace step, a delivery)
                elif (fields := _TEXT_FIELDS.get(type(item))) is not None:
                    _gather_fields(item, fields, texts)
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
    _gather_fields(value, names, texts)


def _gather_fields(value: Any, names: tuple[str, ...], texts: list[str]) -> None:
    """`_gather_texts` of the fields ``names`` of ``value``."""
    for name in names:
        item = getattr(value, name)
        if type(item) is str:
            texts.append(item)
        elif item is not None:
            _gather_texts(item, texts)


@functools.lru_cache(maxsize=64)
def _blocks(keys: tuple[str, ...]) -> frozenset[str]:
    """Texts of which any piece of a key `redact` replaces holds at least one: each key's
    aligned 4-character blocks (any 8-character run of a key covers a whole one), or the key
    itself when shorter than 8 characters (only then matched whole)."""
    blocks: set[str] = set()
    for key in keys:
        if len(key) < FRAGMENT:
            blocks.add(key)
        else:
            blocks.update(key[i : i + _BLOCK] for i in range(0, len(key) - _BLOCK + 1, _BLOCK))
    return frozenset(blocks)


def may_hold_key(
    value: Any, keys: Sequence[str], leak: re.Pattern[str], clean: dict[int, str] | None = None
) -> bool:
    """Whether any text in ``value`` holds a piece of a key ``leak`` finds — the quick test
    that spares a clean result the conversion and walk of `_scrub`. Never wrong when it
    answers no: every distinct text that can carry a key (`_gather_texts`) is searched,
    joined into one; a plain substring test for the keys' blocks first, the pattern only if
    one is there.

    ``clean`` holds the texts earlier looks of the same turn found clean, by identity (it
    keeps them alive, so an id is not reused): a turn's result shares most of its texts with
    its attempts' results, already looked at, so only the texts new to it are searched (a
    text made by joining two clean ones is a new text). A look that answers no adds the
    texts it searched."""
    texts: list[str] = []
    _gather_texts(value, texts)
    # one search per text object: a result holds the same text in several places
    fresh = {id(text): text for text in texts}
    if clean:
        fresh = {ident: text for ident, text in fresh.items() if clean.get(ident) is not text}
    joined = _SEPARATOR.join(fresh.values())
    if any(block in joined for block in _blocks(tuple(keys))):
        if any(_SEPARATOR in key for key in keys):  # a piece could span two texts: one by one
            if any(leak.search(text) is not None for text in fresh.values()):
                return True
        elif leak.search(joined) is not None:
            return True
    if clean is not None:
        clean.update(fresh)
    return False
