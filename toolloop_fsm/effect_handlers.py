"""The one contract by which every shell carries out the machines' effects: a table with one
handler per `Effect` class of the tier the shell drives, checked whole when it is built.

The inner pump, the outer pump, the Temporal workflow's two shells and the test kit's
simulated world each build an `EffectHandlers` from `handled(...)` entries. A shell that
lacks a handler for an effect class of its tier (or names one its tier never emits) fails as
it is built, with the classes named, so a new effect cannot be added to a machine without
every shell saying what it does with it. Dispatch is one dict lookup by the effect's exact
class (the effects are final, frozen values).

A shell made many times over (the inner pump: one per turn, and thousands of turns may wait
at once) builds its table once, for its class, from `handled_by(...)` entries naming its
methods: a `ShellEffectHandlers`, called with the shell and the effect. (A table of bound
methods per turn would be a quarter of the memory of a waiting turn.) It is checked whole
exactly as an `EffectHandlers` is.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Generic
from typing import TypeVar

from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import AskAdmission
from toolloop_fsm.effects import CancelReview
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import OfferSnapshot
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartAttempt
from toolloop_fsm.effects import StartStream
from toolloop_fsm.effects import SupersedeAttempt
from toolloop_fsm.effects import UpdateKeyHealth

__all__ = [
    "INNER_EFFECTS",
    "OUTER_EFFECTS",
    "EffectHandlers",
    "ShellEffectHandlers",
    "handled",
    "handled_by",
]

#: Every effect class `ToolLoopMachine` emits.
INNER_EFFECTS: tuple[type, ...] = (
    StartStream, CancelStream, CutStream, RequestReview, CancelReview, RunTool, CancelTool,
    Deliver, PostNotice, QueueStopResponse, ArmDeadline, ClearDeadline, Finish, OfferSnapshot,
)  # fmt: skip
#: Every effect class `GenerationTurnMachine` emits.
OUTER_EFFECTS: tuple[type, ...] = (
    StartAttempt, AskAdmission, SupersedeAttempt, UpdateKeyHealth, PostNotice,
    QueueStopResponse, Finish,
)  # fmt: skip

E = TypeVar("E")
R = TypeVar("R")
S = TypeVar("S")
H = TypeVar("H", bound=Callable[..., Any])


def handled(effect_class: type[E], handler: Callable[[E], R]) -> tuple[type, Callable[[Any], R]]:
    """One entry of a table: ``handler`` carries out effects of ``effect_class`` (mypy
    checks that it takes that class)."""
    return effect_class, handler


def handled_by(
    effect_class: type[E], handler: Callable[[S, E], R]
) -> tuple[type, Callable[[S, Any], R]]:
    """One entry of a shell class's table: ``handler``, a method of the shell taken from its
    class, carries out effects of ``effect_class`` (mypy checks that it takes that class)."""
    return effect_class, handler


def _checked(shell: str, tier: Iterable[type], entries: Iterable[tuple[type, H]]) -> dict[type, H]:
    """The table of ``entries`` by effect class, refused unless it has exactly one handler for
    each class of ``tier``."""
    handlers: dict[type, H] = {}
    for effect_class, handler in entries:
        if effect_class in handlers:
            raise TypeError(f"{shell} has two handlers for {effect_class.__name__}")
        handlers[effect_class] = handler
    expected = tuple(tier)
    missing = [cls.__name__ for cls in expected if cls not in handlers]
    foreign = [cls.__name__ for cls in handlers if cls not in expected]
    if missing or foreign:
        problems = []
        if missing:
            problems.append(f"no handler for {', '.join(missing)}")
        if foreign:
            problems.append(f"handlers for {', '.join(foreign)}, which its tier never emits")
        raise TypeError(f"{shell} has {'; '.join(problems)}")
    return handlers


class EffectHandlers(Generic[R]):
    """A shell's handlers, one per effect class of its tier (``tier``: `INNER_EFFECTS` or
    `OUTER_EFFECTS`); calling the table carries out one effect."""

    __slots__ = ("_handlers", "shell")

    def __init__(
        self, shell: str, tier: Iterable[type], entries: Iterable[tuple[type, Callable[[Any], R]]]
    ) -> None:
        self.shell = shell
        self._handlers = _checked(shell, tier, entries)

    def __call__(self, effect: object) -> R:
        return self._handlers[type(effect)](effect)

    def handles(self) -> frozenset[type]:
        return frozenset(self._handlers)


class ShellEffectHandlers(Generic[S, R]):
    """The handlers of a shell class, one per effect class of its tier, built once for every
    instance; calling the table with a shell and an effect carries the effect out by that
    shell."""

    __slots__ = ("by_class", "shell")

    def __init__(
        self,
        shell: str,
        tier: Iterable[type],
        entries: Iterable[tuple[type, Callable[[S, Any], R]]],
    ) -> None:
        self.shell = shell
        #: The handlers by effect class, for a shell whose every effect counts (the inner
        #: pump's batches): looked up there directly, without this table's own call.
        self.by_class: Mapping[type, Callable[[S, Any], R]] = _checked(shell, tier, entries)

    def __call__(self, shell: S, effect: object) -> R:
        return self.by_class[type(effect)](shell, effect)

    def handles(self) -> frozenset[type]:
        return frozenset(self.by_class)
