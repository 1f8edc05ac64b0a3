"""How a machine's run state is copied for a fork (`DeclaredMachine.fork`): what a fork
shares with its original and what it gets its own copy of.

A run state is a tree of mutable ``attrs`` records (the run state and its sub-records) and
the containers they own. A fork gets its own copy of every such record and container, all
the way down; it shares everything else: the configuration (marked `SHARED` on its field:
the policy, the tool registry, the request, the compiled tables, none of which a run
changes) and every immutable value (frozen records, strings, numbers, tuples, frozen sets).
A list whose items are values no one changes — the conversation's messages, which the
machine only appends to — is marked `ITEMS_SHARED`: the fork gets its own list of the same
items. So feeding one machine never changes the other, at the cost of copying what a run
can change and nothing more (`copy.deepcopy` also copies the configuration and the tables).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any
from typing import TypeVar

import attrs

#: field metadata: the fork shares the field's value with its original (configuration)
SHARED = {"fork": "shared"}
#: field metadata: the fork gets its own list, holding the same items (values)
ITEMS_SHARED = {"fork": "items"}

RecordT = TypeVar("RecordT")

# how a value of each type is copied, found once per type
_COPIERS: dict[type, Callable[[Any], Any]] = {}
_IMMUTABLE = (str, int, float, bool, bytes, type(None), tuple, frozenset, Enum)


def forked(record: RecordT) -> RecordT:
    """A copy of the mutable ``attrs`` record ``record`` for a fork (see the module)."""
    twin: RecordT = _copier(type(record))(record)
    return twin


def _same(value: Any) -> Any:
    return value


def _copy_list(value: list[Any]) -> list[Any]:
    return [_copier(type(item))(item) for item in value]


def _copy_dict(value: dict[Any, Any]) -> dict[Any, Any]:
    return {key: _copier(type(item))(item) for key, item in value.items()}


def _copy_set(value: set[Any]) -> set[Any]:
    return set(value)  # the items of a set are hashable: values


def _copier(kind: type) -> Callable[[Any], Any]:
    copier = _COPIERS.get(kind)
    if copier is None:
        copier = _COPIERS[kind] = _copier_of(kind)
    return copier


def _copier_of(kind: type) -> Callable[[Any], Any]:
    if kind is list:
        return _copy_list
    if kind is dict:
        return _copy_dict
    if kind is set:
        return _copy_set
    if issubclass(kind, _IMMUTABLE):
        return _same
    if attrs.has(kind):
        if kind.__setattr__ is _FROZEN_SETATTR:
            return _same  # a frozen record holds values only (the house's rule for values)
        return _record_copier(kind, attrs.fields(kind))
    # anything else (a host's object, a callable) is the host's: shared, as configuration
    return _same


@attrs.frozen
class _FrozenProbe:
    """What attrs makes of a frozen record: its ``__setattr__`` refuses every change."""


_FROZEN_SETATTR = _FrozenProbe.__setattr__


def _record_copier(kind: type, fields: tuple[attrs.Attribute[Any], ...]) -> Callable[[Any], Any]:
    shared = tuple(f.name for f in fields if f.metadata.get("fork") == "shared")
    items = tuple(f.name for f in fields if f.metadata.get("fork") == "items")
    owned = tuple(f.name for f in fields if f.metadata.get("fork") is None)
    new = object.__new__
    put = object.__setattr__

    def copy(record: Any) -> Any:
        twin: Any = new(kind)
        for name in shared:
            put(twin, name, getattr(record, name))
        for name in items:
            value = getattr(record, name)
            put(twin, name, None if value is None else list(value))
        for name in owned:
            value = getattr(record, name)
            put(twin, name, _copier(type(value))(value))
        return twin

    return copy
