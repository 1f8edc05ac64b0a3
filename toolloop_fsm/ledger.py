"""The turn-scoped tool ledger's values: a call's identity (`canonical_call_key`), the key
of its n-th occurrence, a tool's outcome as the loop sees it (`ToolOutcome`) and a recorded
call (`LedgerEntry`).

Plain values that depend on the events only: the machines' run state (`toolloop_fsm.turn`)
and the snapshots (`toolloop_fsm.snapshot`) both hold them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from attrs import frozen

from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind


def canonical_call_key(name: str, arguments: Any) -> str:
    """The engine's own identity of a call: name + canonical JSON arguments (every object's
    keys sorted, no whitespace, and each number as the JSON number it is: JSON has one number
    type, so ``1``, ``1.0`` and ``1e0`` are one value — docs/behaviour.md §3.11 rule 1).

    A model's call ids change between attempts, so they cannot identify a call. The
    arguments themselves are not changed: the tool gets them as the model wrote them.
    """
    try:
        if _holds_whole_float(arguments):
            arguments = _as_json_numbers(arguments)
        canonical = _CANONICAL_JSON.encode(arguments)
    except (TypeError, ValueError, RecursionError):
        canonical = repr(arguments)
    return f"{name}:{canonical}"


def _holds_whole_float(value: Any) -> bool:
    """Whether a float holding a whole number is anywhere in ``value`` (most arguments hold
    none: they are then encoded as they are, without a copy)."""
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list | tuple):
        return False
    for item in value:
        kind = type(item)
        if kind is not str and kind is not int and kind is not bool and _holds_whole_float(item):
            return True
    return False


def _as_json_numbers(value: Any) -> Any:
    """``value`` with every float that holds a whole number written as that integer (a float
    past 2**53 holds the whole number its binary value is, and compares as that number, never
    as a nearby integer)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {key: _as_json_numbers(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_as_json_numbers(item) for item in value]
    return value


#: What `json.dumps` builds on every call when given options, built once (it keeps no state
#: between calls): a call key is computed for every tool call
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def occurrence_key(call_key: str, occurrence: int) -> str:
    """The ledger's key for the ``occurrence``-th identical call (1-based) of a replay scope:
    the n-th identical call of an attempt, or of the passes after a context restart, matches
    the n-th one recorded earlier in the turn."""
    return f"{call_key}#{occurrence}"


@frozen
class ToolOutcome:
    """A tool's outcome as the loop sees it (a real dispatch, a reuse, or a refusal)."""

    success: bool
    data: Any = None
    message: str | None = None
    reason: str | None = None
    end_turn: bool = False
    delivered: bool = False
    expression: str | None = None
    restart_item: Mapping[str, Any] | None = None
    restart_kinds: tuple[str, ...] = ()
    dispatched: bool = True
    reused: bool = False
    #: the tool checkpoint's reviewer rejected the call: it did not run, and it counts as
    #: no failure (no failure notice, no error counted)
    rejected: bool = False
    #: refused by the tool-call limit (docs/behaviour.md §3.12): it did not run, and it
    #: counts as no failure (no failure notice, no error counted) — the limit ends the loop
    #: its own way, with the answer pass
    limited: bool = False
    #: denied by a person (docs/behaviour.md §3.13): it did not run, and it counts as no
    #: failure (no failure notice, no error counted)
    denied: bool = False
    #: a failure whose call may have taken effect (docs/behaviour.md §3.9): reused on a
    #: replay, never rerun
    in_doubt: bool = False

    @property
    def is_failure(self) -> bool:
        """A failure the error counter counts and a notice reports: not a refusal that is
        no failure (a rejection, the tool-call limit, a denial)."""
        return not self.success and not self.rejected and not self.limited and not self.denied

    @classmethod
    def from_event(cls, event: ToolFinished) -> ToolOutcome:
        if event.kind is ToolOutcomeKind.SUCCEEDED:
            restart = event.context_restart
            return cls(
                success=True,
                data=event.data,
                message=event.message,
                end_turn=event.end_turn,
                delivered=event.delivered,
                expression=event.expression,
                restart_item=restart.item if restart is not None else None,
                restart_kinds=restart.disable_kinds if restart is not None else (),
            )
        reason = event.error or event.message or "the tool reported a failure"
        return cls(
            success=False,
            data=event.data,
            message=event.message,
            reason=reason,
            expression=event.expression if event.kind is ToolOutcomeKind.FAILED else None,
            in_doubt=event.in_doubt,
        )


@frozen
class LedgerEntry:
    """A completed call recorded in the turn-scoped ledger, under its occurrence key. Failed
    calls are recorded too (so that occurrences line up); only a success, or a call in doubt,
    is reused."""

    call_key: str
    outcome: ToolOutcome
