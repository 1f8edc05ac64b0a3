"""The one contract by which every shell carries out the machines' effects: a protocol per
tier, one method per `Effect` class the tier's machine emits, named after the class, and the
table of handlers each shell's dispatch looks effects up in, built from that protocol.

The inner pump, the outer pump, the Temporal workflow's two shells and the test kit's
simulated world each subclass their tier's protocol (`InnerEffectShell`, `OuterEffectShell`)
and so say, by a method of the protocol's name, what they do with every effect class of the
tier. mypy refuses a shell whose method takes the wrong effect, or one that leaves a method
out (the class stays abstract); the table refuses it too, as it is built, naming the classes
(`tests/test_effect_handlers.py`), so a new effect cannot be added to a machine without every
shell saying what it does with it. Dispatch is one dict lookup by the effect's exact class
(the effects are final, frozen values).

A shell made many times over (the inner pump: one per turn, and thousands of turns may wait
at once) builds its table once, for its class: a `ShellEffectHandlers`, called with the shell
and the effect. (A table of bound methods per turn would be a quarter of the memory of a
waiting turn.) The others build an `EffectHandlers` of their own bound methods.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Generic
from typing import Protocol
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
    "InnerEffectShell",
    "OuterEffectShell",
    "ShellEffectHandlers",
]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S")
H = TypeVar("H", bound=Callable[..., Any])


class _EndingEffectShell(Protocol[R_co]):
    """The effects both tiers emit: the host's calls the turn queues, and the end."""

    __slots__ = ()

    def post_notice(self, effect: PostNotice, /) -> R_co: ...
    def queue_stop_response(self, effect: QueueStopResponse, /) -> R_co: ...
    def finish(self, effect: Finish, /) -> R_co: ...


class InnerEffectShell(_EndingEffectShell[R_co], Protocol[R_co]):
    """A shell of `ToolLoopMachine`: a method for every effect class it emits."""

    __slots__ = ()

    def start_stream(self, effect: StartStream, /) -> R_co: ...
    def cancel_stream(self, effect: CancelStream, /) -> R_co: ...
    def cut_stream(self, effect: CutStream, /) -> R_co: ...
    def request_review(self, effect: RequestReview, /) -> R_co: ...
    def cancel_review(self, effect: CancelReview, /) -> R_co: ...
    def run_tool(self, effect: RunTool, /) -> R_co: ...
    def cancel_tool(self, effect: CancelTool, /) -> R_co: ...
    def deliver(self, effect: Deliver, /) -> R_co: ...
    def arm_deadline(self, effect: ArmDeadline, /) -> R_co: ...
    def clear_deadline(self, effect: ClearDeadline, /) -> R_co: ...
    def offer_snapshot(self, effect: OfferSnapshot, /) -> R_co: ...


class OuterEffectShell(_EndingEffectShell[R_co], Protocol[R_co]):
    """A shell of `GenerationTurnMachine`: a method for every effect class it emits."""

    __slots__ = ()

    def start_attempt(self, effect: StartAttempt, /) -> R_co: ...
    def ask_admission(self, effect: AskAdmission, /) -> R_co: ...
    def supersede_attempt(self, effect: SupersedeAttempt, /) -> R_co: ...
    def update_key_health(self, effect: UpdateKeyHealth, /) -> R_co: ...


def _methods_by_effect(protocol: type) -> dict[type, str]:
    """The protocol's method for each effect class, read off the methods' annotations."""
    methods: dict[type, str] = {}
    for name in dir(protocol):
        if name.startswith("_"):
            continue
        effect_class = typing.get_type_hints(getattr(protocol, name))["effect"]
        if effect_class in methods:
            raise TypeError(f"{protocol.__name__} has two methods for {effect_class.__name__}")
        methods[effect_class] = name
    return methods


_INNER_METHODS = _methods_by_effect(InnerEffectShell)
_OUTER_METHODS = _methods_by_effect(OuterEffectShell)
#: Every effect class `ToolLoopMachine` emits.
INNER_EFFECTS: tuple[type, ...] = tuple(_INNER_METHODS)
#: Every effect class `GenerationTurnMachine` emits.
OUTER_EFFECTS: tuple[type, ...] = tuple(_OUTER_METHODS)
_TIERS: dict[type, dict[type, str]] = {
    InnerEffectShell: _INNER_METHODS,
    OuterEffectShell: _OUTER_METHODS,
}


def _checked(shell: str, shell_class: type, read: Callable[[str], H]) -> dict[type, H]:
    """The handler ``read`` gives for each effect class of the tier ``shell_class`` subclasses,
    refused unless the class carries out every one of them."""
    tiers = [tier for tier in _TIERS if tier in shell_class.__mro__]
    if len(tiers) != 1:
        which = "both" if tiers else "neither"
        raise TypeError(f"{shell} subclasses {which} of InnerEffectShell and OuterEffectShell")
    (tier,) = tiers
    methods = _TIERS[tier]
    missing = [
        cls.__name__
        for cls, name in methods.items()
        if getattr(shell_class, name) is getattr(tier, name)
    ]
    if missing:
        raise TypeError(f"{shell} has no handler for {', '.join(missing)}")
    return {cls: read(name) for cls, name in methods.items()}


class EffectHandlers(Generic[R]):
    """A shell's handlers, its own bound methods, one per effect class of its tier; calling
    the table carries out one effect."""

    __slots__ = ("_handlers", "shell")

    def __init__(
        self, shell: str, carried_out_by: InnerEffectShell[R] | OuterEffectShell[R]
    ) -> None:
        self.shell = shell
        self._handlers: dict[type, Callable[[Any], R]] = _checked(
            shell, type(carried_out_by), lambda name: getattr(carried_out_by, name)
        )

    def __call__(self, effect: object) -> R:
        return self._handlers[type(effect)](effect)

    def handles(self) -> frozenset[type]:
        return frozenset(self._handlers)


class ShellEffectHandlers(Generic[S, R]):
    """The handlers of a shell class, its methods, one per effect class of its tier, built
    once for every instance; calling the table with a shell and an effect carries the effect
    out by that shell."""

    __slots__ = ("by_class", "shell")

    def __init__(self, shell_class: type[S]) -> None:
        self.shell = shell_class.__name__
        #: The handlers by effect class, for a shell whose every effect counts (the inner
        #: pump's batches): looked up there directly, without this table's own call.
        self.by_class: Mapping[type, Callable[[S, Any], R]] = _checked(
            self.shell, shell_class, lambda name: getattr(shell_class, name)
        )

    def __call__(self, shell: S, effect: object) -> R:
        return self.by_class[type(effect)](shell, effect)

    def handles(self) -> frozenset[type]:
        return frozenset(self.by_class)
