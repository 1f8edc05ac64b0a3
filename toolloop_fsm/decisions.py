"""A turn paused for approval, read from its snapshot (docs/behaviour.md §3.13): the calls it
waits on (`pending_approvals`), and the host's decisions applied to it (`decide`), each
checked against the call it names before anything runs.

Pure: both read and build snapshot values only. The resume functions call `decide`; the
Temporal workflow calls it on the decisions its signal brings.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping

import attrs

from toolloop_fsm.approvals import ApprovalError
from toolloop_fsm.approvals import ApprovalKey
from toolloop_fsm.approvals import Decision
from toolloop_fsm.approvals import PendingApproval
from toolloop_fsm.approvals import call_digest
from toolloop_fsm.ledger import ToolOutcome
from toolloop_fsm.snapshot import PausedCall
from toolloop_fsm.snapshot import TurnSnapshot


def _attempt(snapshot: TurnSnapshot) -> int:
    return snapshot.chain.attempts if snapshot.chain is not None else 1


def pending_approvals(snapshot: TurnSnapshot) -> tuple[PendingApproval, ...]:
    """The calls ``snapshot``'s turn waits on, in emitted order (empty: it waits on none)."""
    loop = snapshot.loop
    if loop is None:
        return ()
    attempt = _attempt(snapshot)
    pending = []
    for paused in loop.paused:
        if not paused.awaiting:
            continue
        where = (loop.request.turn_id, attempt, loop.iterations, paused.position)
        call = (paused.call_id, paused.name, paused.arguments)
        pending.append(
            PendingApproval(*where, *call, call_digest(*where, *call), paused.predicate_error)
        )
    return tuple(pending)


def denial_reason(reason: str) -> str:
    """What the model is told of a call a person denied."""
    return f"Not run: the user denied this call. {reason}"


def decide(
    snapshot: TurnSnapshot, decisions: Iterable[Decision], *, key: ApprovalKey | None = None
) -> TurnSnapshot:
    """``snapshot`` with ``decisions`` taken: each call it waits on is approved (to run with
    the model's arguments or the edited ones) or denied (its outcome is the denial). Every
    call must have exactly one decision, and each decision must name a call the snapshot
    waits on by its digest (another call, or a snapshot whose call was changed, gives
    another). With ``key``, every decision must be signed with it. Anything else raises
    `ApprovalError`, naming the call."""
    given = list(decisions)
    for decision in given:
        if not isinstance(decision, Decision):
            raise TypeError(f"decisions are Decision values, got {type(decision).__name__}")
    pending = pending_approvals(snapshot)
    if not pending:
        if given:
            raise ApprovalError("this turn waits on no approval: resume it without decisions")
        return snapshot
    by_digest: dict[str, Decision] = {}
    for decision in given:
        if decision.digest in by_digest:
            raise ApprovalError(
                f"two decisions on the call of {decision.tool!r} at position {decision.position}"
            )
        by_digest[decision.digest] = decision
    waiting = {call.digest: call for call in pending}
    strangers = [d for d in given if d.digest not in waiting]
    if strangers:
        stranger = strangers[0]
        raise ApprovalError(
            f"the decision on {stranger.tool!r} at position {stranger.position} answers no call "
            "this turn waits on (another turn's, pass's or call's, or the snapshot's call was "
            f"changed); it waits on {_names(pending)}"
        )
    missing = [call for call in pending if call.digest not in by_digest]
    if missing:
        raise ApprovalError(
            f"no decision on {_names(missing)}: every call the turn waits on needs one"
        )
    for call in pending:
        decision = by_digest[call.digest]
        if (decision.tool, decision.position, decision.call_id) != (
            call.tool,
            call.position,
            call.call_id,
        ):
            raise ApprovalError(
                f"the decision on {call.tool!r} at position {call.position} names another "
                f"call ({decision.tool!r} at position {decision.position})"
            )
        if key is not None and not decision.signed_by(key):
            unsigned = "is not signed" if decision.signature is None else "has a bad signature"
            raise ApprovalError(
                f"the decision on {call.tool!r} at position {call.position} {unsigned}: "
                "decisions must be signed with the approval key"
            )
        if key is None and decision.signature is not None:
            raise ApprovalError(
                f"the decision on {call.tool!r} at position {call.position} is signed: give "
                "approval_key= to check it"
            )
    loop = snapshot.loop
    assert loop is not None
    decided = tuple(
        _decided(paused, by_digest[call.digest]) if call is not None else paused
        for paused, call in _with_pending(loop.paused, pending)
    )
    return attrs.evolve(snapshot, loop=attrs.evolve(loop, paused=decided))


def _with_pending(
    paused: tuple[PausedCall, ...], pending: tuple[PendingApproval, ...]
) -> Iterable[tuple[PausedCall, PendingApproval | None]]:
    by_position = {call.position: call for call in pending}
    for call in paused:
        yield call, by_position.get(call.position) if call.awaiting else None


def _decided(paused: PausedCall, decision: Decision) -> PausedCall:
    if decision.verdict == "deny":
        reason = decision.reason or "denied"
        outcome = ToolOutcome(
            success=False, reason=denial_reason(reason), dispatched=False, denied=True
        )
        return attrs.evolve(paused, awaiting=False, outcome=outcome)
    arguments: Mapping[str, object] = (
        decision.arguments if decision.arguments is not None else paused.arguments
    )
    return attrs.evolve(paused, awaiting=False, approved=dict(arguments))


def _names(calls: Iterable[PendingApproval]) -> str:
    return ", ".join(f"{call.tool!r} at position {call.position}" for call in calls)


__all__ = ["decide", "denial_reason", "pending_approvals"]
