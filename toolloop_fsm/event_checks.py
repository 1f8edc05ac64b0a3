"""Checks of an event's fields before a machine takes it: each field against its declared type
(or the type a machine reads it as), built once per event class when a machine module is
imported. A message names the field and the type it got, never the value."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import frozen

Accepts = Callable[[Any], bool]


@frozen
class FieldCheck:
    """What one event field accepts: an instance of ``classes`` (the quick check, enough for
    most fields) that ``refine``, when set, also accepts."""

    name: str
    classes: tuple[type, ...]
    refine: Accepts | None
    described: str

    def accepts(self, value: object) -> bool:
        return isinstance(value, self.classes) and (self.refine is None or self.refine(value))


@frozen
class AtLeast:
    """The least value of a whole-number event field, declared on the event as
    ``Annotated[int, AtLeast(n)]`` (a token count is never negative)."""

    minimum: int


def _not_bool(value: int) -> bool:
    return type(value) is not bool


def _finite(value: float) -> bool:
    # a clock time or a delay: NaN compares false with everything, so it is no time at all
    return type(value) is not bool and math.isfinite(value)


# the scalar types a field may be declared as: the classes taken, the refinement, the wording
_SCALARS: dict[type, tuple[tuple[type, ...], Accepts | None, str]] = {
    bool: ((bool,), None, "a bool"),
    int: ((int,), _not_bool, "an int"),
    float: ((int, float), _finite, "a finite number"),
}


def _field_check(name: str, hint: Any) -> FieldCheck | None:
    """The check of a field declared ``hint`` (``None``: it accepts anything)."""
    if hint is Any:
        return None
    if typing.get_origin(hint) is typing.Annotated:
        return _annotated_check(name, hint)
    if hint is None or hint is type(None):
        return FieldCheck(name, (type(None),), None, "None")
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return _union_check(name, hint)
    if isinstance(hint, type) and hint in _SCALARS:
        return FieldCheck(name, *_SCALARS[hint])
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return _mapping_check(name, hint)
    if origin is tuple:
        return FieldCheck(name, (tuple,), None, "a tuple")
    if isinstance(hint, type):
        return FieldCheck(name, (hint,), None, f"a {hint.__name__}")
    raise TypeError(f"an event field of type {hint!r} cannot be checked")


def _annotated_check(name: str, hint: Any) -> FieldCheck | None:
    """``Annotated[base, ...]``: the check of ``base``, bounded by each `AtLeast` it carries."""
    base, *extras = typing.get_args(hint)
    check = _field_check(name, base)
    for extra in extras:
        if isinstance(extra, AtLeast) and check is not None:
            check = _bounded(check, extra.minimum)
    return check


def _union_check(name: str, hint: Any) -> FieldCheck | None:
    """``A | B``: what any member accepts (anything, when one member accepts anything)."""
    options = [_field_check(name, arg) for arg in typing.get_args(hint)]
    members = [option for option in options if option is not None]
    if len(members) < len(options):
        return None
    classes = tuple(cls for member in members for cls in member.classes)
    refine: Accepts | None = None
    if any(member.refine is not None for member in members):

        def refine(value: object) -> bool:
            return any(member.accepts(value) for member in members)

    return FieldCheck(name, classes, refine, " or ".join(m.described for m in members))


def _mapping_check(name: str, hint: Any) -> FieldCheck:
    """``Mapping[K, V]``: a mapping whose every key and item its own check accepts."""
    keys, items = (_field_check(name, arg) for arg in typing.get_args(hint))

    def entries(value: Mapping[Any, Any]) -> bool:
        return all(
            (keys is None or keys.accepts(key)) and (items is None or items.accepts(item))
            for key, item in value.items()
        )

    key_type = keys.described if keys is not None else "anything"
    item_type = items.described if items is not None else "anything"
    return FieldCheck(name, (Mapping,), entries, f"a mapping of {key_type} to {item_type}")


def _bounded(check: FieldCheck, minimum: int) -> FieldCheck:
    inner = check.refine

    def refine(value: Any) -> bool:
        return (inner is None or inner(value)) and value >= minimum

    return FieldCheck(check.name, check.classes, refine, f"a whole number >= {minimum}")


def event_shapes(
    event_classes: Iterable[type], *, read_as: Mapping[tuple[type, str], Any] | None = None
) -> dict[type, tuple[FieldCheck, ...]]:
    """Per event class, a check of each field against its declared type, or against the
    type the machine reads it as (``read_as``: an event field declared ``Any`` that one
    machine reads as a result, say). Built once, when the machine module is imported.

    Events are built by shells and providers without checks of their own (they are made on
    the hot path), so a machine checks the fields it reads before it takes the event.
    """
    read_as = read_as or {}
    shapes: dict[type, tuple[FieldCheck, ...]] = {}
    for cls in event_classes:
        hints = typing.get_type_hints(cls, include_extras=True)
        checks = (
            _field_check(f.name, read_as.get((cls, f.name), hints[f.name]))
            for f in attrs.fields(cls)
        )
        shapes[cls] = tuple(check for check in checks if check is not None)
    return shapes


def malformation(shapes: Mapping[type, tuple[FieldCheck, ...]], event: object) -> str | None:
    """What is wrong with ``event``'s fields, or ``None``. The message names the field and
    the type it got, never a value (a shell's mistake may carry an API key)."""
    for check in shapes.get(type(event), ()):
        value = getattr(event, check.name)
        if not isinstance(value, check.classes) or (
            check.refine is not None and not check.refine(value)
        ):
            # a number of the right type but out of range is shown: a number holds no key
            number = isinstance(value, float) or (type(value) is int and check.refine is not None)
            got = repr(value) if number else type(value).__name__
            return f"{check.name} must be {check.described}, got {got}"
    return None
