"""The gate a requested call passes before anything runs (docs/behaviour.md §3.1–§3.5,
§3.11, §3.12, §3.13), and
whether a running call cut off at its deadline is settled before the loop goes on (§3.9)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.guards.ceilings import tool_call_limit_reached
from toolloop_fsm.turn import TurnState
from toolloop_fsm.turn import call_key_of_pending
from toolloop_fsm.turn import call_with_deadline
from toolloop_fsm.turn import next_occurrence

if TYPE_CHECKING:
    from toolloop_fsm.provider import ToolSpec


def call_pending(turn: TurnState) -> bool:
    """The pass ended with tool calls: a batch (docs/behaviour.md §3.10)."""
    return bool(turn.tool_round.calls)


def batch_has_nameless_call(turn: TurnState) -> bool:
    """A call of the batch has no name, or a blank one: a protocol failure (§3.1)."""
    return any(
        not isinstance(c.call.name, str) or not c.call.name.strip() for c in turn.tool_round.calls
    )


def calls_left_at_gate(turn: TurnState) -> bool:
    """The batch has calls the gate has not decided yet."""
    tool_round = turn.tool_round
    return tool_round.gated + 1 < len(tool_round.calls)


def calls_admitted(turn: TurnState) -> bool:
    """The gate admitted calls of the batch: they run."""
    return turn.tool_round.queued > 0


def batch_finishes(turn: TurnState) -> bool:
    """The outcome being taken is the batch's last: no other call runs or waits."""
    tool_round = turn.tool_round
    return tool_round.running == 1 and tool_round.queued == 0


def cut_off_call_is_settled(turn: TurnState) -> bool:
    """The expired call's tool has a reconcile hook: cut off at its deadline, it gets its
    grace to stop, and one that does not is settled by the hook before the loop goes on
    (docs/behaviour.md §3.9 rule 2)."""
    event = turn.current_event
    if not isinstance(event, DeadlineExpired):
        return False
    batch_call = call_with_deadline(turn, event.token)
    tool = turn.registry.get(batch_call.call.name) if batch_call is not None else None
    return tool is not None and tool.reconcile is not None


def call_arguments_not_object(turn: TurnState) -> bool:
    """The (parsed, complete) arguments are not a JSON object: refused (§3.10 rule 1)."""
    call = turn.tool_round.pending_call
    if call is None or call.parse_error is not None or call.truncated:
        return False
    return not isinstance(call.arguments, Mapping)


def call_arguments_truncated(turn: TurnState) -> bool:
    """The adapter had to repair a cut-off JSON payload (docs/behaviour.md §3.2)."""
    return turn.tool_round.pending_call is not None and turn.tool_round.pending_call.truncated


def call_arguments_unparseable(turn: TurnState) -> bool:
    """The arguments were malformed (not truncated) JSON: a failure shown to the model."""
    return (
        turn.tool_round.pending_call is not None
        and turn.tool_round.pending_call.parse_error is not None
    )


def call_outside_allowlist(turn: TurnState) -> bool:
    """Unknown tool, a tool outside the turn's allowlist, or one disabled for the turn."""
    call = turn.tool_round.pending_call
    if call is None:
        return False
    return call.name not in allowed_tool_names(turn)


def call_already_recorded(turn: TurnState) -> bool:
    """A replay: this call is the n-th identical call of its scope (the attempt, or the
    passes since a context restart), and the n-th identical call recorded earlier in the
    turn succeeded, or is in doubt (it may have taken effect, §3.9) — reuse it, never run
    it twice. A tool marked ``replay="rerun"`` always runs; a deliberate repeat inside one
    scope is a new occurrence and runs."""
    call = turn.tool_round.pending_call
    if call is None or not turn.ledger:
        return False
    tool = turn.registry.get(call.name)
    if tool is not None and tool.replay == "rerun":
        return False
    entry = turn.ledger.get(next_occurrence(turn, call_key_of_pending(turn, call)))
    return entry is not None and (entry.outcome.success or entry.outcome.in_doubt)


def call_repeats_too_often(turn: TurnState) -> bool:
    """The repeated-call guard (docs/behaviour.md §3.11): the call would be an occurrence of
    its identity past ``max_identical_calls`` — as many identical calls of its replay scope
    already ran or were reused — and its tool is not ``repeatable``. A replay of a recorded
    occurrence is decided before this (it is no repeat); a refusal takes no occurrence."""
    call = turn.tool_round.pending_call
    occurrences = turn.occurrences
    if call is None or not occurrences:
        return False
    seen = occurrences.get(call_key_of_pending(turn, call), 0)
    if seen < turn.policy.max_identical_calls:
        return False
    tool = turn.registry.get(call.name)
    return tool is not None and not tool.repeatable


def call_over_tool_call_limit(turn: TurnState) -> bool:
    """The tool-call limit (docs/behaviour.md §3.12): the turn has admitted as many calls as
    ``max_tool_calls`` allows — counting the calls of this batch admitted before this one,
    in emitted order — so this one does not run."""
    return tool_call_limit_reached(turn)


def call_needs_approval(turn: TurnState) -> bool:
    """The call's tool needs a person's approval (docs/behaviour.md §3.13): always, or as its
    ``needs_approval`` predicate says of these arguments. A predicate that raises holds the
    call too (what it raised is kept for the host). Asked after every refusal, so a call
    that would not run anyway waits on no one."""
    tool_round = turn.tool_round
    call = tool_round.pending_call
    tool_round.approval_error = None
    if call is None:
        return False
    tool = turn.registry.get(call.name)
    if tool is None or tool.needs_approval is False:
        return False
    if tool.needs_approval is True:
        return True
    try:
        return bool(tool.needs_approval(call.arguments))
    except Exception as err:  # host code: the call waits, and the host is told why
        tool_round.approval_error = f"{type(err).__name__}: {err}"
        return True


def calls_await_approval(turn: TurnState) -> bool:
    """Calls of the batch wait for approval, and none runs: the turn pauses."""
    return turn.tool_round.awaiting > 0


def batch_finishes_awaiting_approval(turn: TurnState) -> bool:
    """The batch's last running call finishes, and other calls of it wait for approval."""
    return turn.tool_round.awaiting > 0 and batch_finishes(turn)


def resumes_paused_batch(turn: TurnState) -> bool:
    """A resumed turn paused for approval: it goes on with its batch, decided."""
    return bool(turn.tool_round.calls)


def allowed_tool_names(turn: TurnState) -> tuple[str, ...]:
    """The tools the turn offers: the registry's, within the request's allowlist, less those
    disabled. Kept on the turn until `disabled_tools` is replaced (the registry and the
    request do not change within a turn)."""
    disabled = turn.disabled_tools
    allowlist = turn.request.tools_allowed
    if allowlist is None and not disabled:
        return turn.registry.names  # the whole registry: one tuple shared by every turn
    cached = turn.allowed_tools
    if cached is not None and cached[0] is disabled:
        return cached[1]
    allowed = tuple(
        name
        for name in turn.registry.names
        if (allowlist is None or name in allowlist) and name not in disabled
    )
    turn.allowed_tools = (disabled, allowed)
    return allowed


def offered_tools(turn: TurnState) -> tuple[ToolSpec, ...]:
    """The specs of the tools the turn offers (`allowed_tool_names`): one tuple while the
    set is the same, so what is computed from it once (its size in the usage estimate) is
    known to still hold."""
    names = allowed_tool_names(turn)
    cached = turn.offered_specs
    if cached is not None and cached[0] is names:
        return cached[1]
    specs = turn.registry.specs(names)
    turn.offered_specs = (names, specs)
    return specs
