"""Deliveries, notices and deadlines: the effects every stage emits the same way; and, when
drafting, holding text and expressions instead of delivering them (within the held-prose
ceiling)."""

from __future__ import annotations

from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import Notice
from toolloop_fsm.turn import BatchCall
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import HeldSegment
from toolloop_fsm.turn import PassRecord
from toolloop_fsm.turn import TurnState


def deliver_text(turn: TurnState, text: str) -> None:
    seq = turn.deliveries.next_seq
    turn.deliveries.next_seq = seq + 1
    turn.deliveries.in_flight[seq] = Delivered(seq, text=text, iteration=turn.iterations)
    if text.strip():
        turn.deliveries.visible_text_delivered = True
    turn.effects.append(Deliver(seq, text=text))


def deliver_expression(turn: TurnState, expression: str) -> None:
    seq = turn.deliveries.next_seq
    turn.deliveries.next_seq = seq + 1
    turn.deliveries.in_flight[seq] = Delivered(
        seq, expression=expression, iteration=turn.iterations
    )
    turn.expression_delivered = True
    turn.effects.append(Deliver(seq, expression=expression))


def flush_buffer(turn: TurnState, *, mid_stream: bool = False) -> None:
    """Hand the buffered visible text to the channel (unless text is suppressed), or hold
    it when drafting. ``mid_stream``: the pass is still streaming (a chunk filled the
    buffer), so a pass that reaches the held-prose ceiling is cut."""
    parts = turn.pass_text
    start = turn.buffer_start
    if start >= len(parts):
        return
    text = "".join(parts[start:])
    # the pieces give way to their joined text, which the delivery record shares: a pass
    # keeps one copy of what it delivered, not the pieces and the copy
    del parts[start:]
    parts.append(text)
    turn.buffer_start = start + 1
    turn.buffer_len = 0
    if turn.suppress_text:
        return
    if turn.draft is not None and turn.policy.drafting:
        hold_text(turn, text, mid_stream=mid_stream)
    else:
        deliver_text(turn, text)


def hold_text(turn: TurnState, text: str, *, mid_stream: bool = False) -> None:
    """Hold ``text`` instead of delivering it, within the room the ceiling leaves. Text
    that does not fit is cut on a character boundary; a pass still streaming is told to stop
    (`CutStream`), and nothing more is held in the turn."""
    draft = turn.draft
    assert draft is not None
    if draft.cut or not text:
        return
    policy = turn.policy
    limit = policy.held_prose_max_bytes
    by_send_limit = False
    if policy.send_message_limit is not None and policy.send_message_limit < limit:
        limit, by_send_limit = policy.send_message_limit, True
    room = limit - draft.held_bytes
    encoded = text.encode("utf-8")
    if len(encoded) <= room and draft.held_segments < policy.held_prose_max_segments:
        _hold(draft, HeldSegment(text=text), len(encoded))
        return
    if draft.held_segments >= policy.held_prose_max_segments:
        by_send_limit = False  # the segment ceiling is the library's own
    elif room > 0:
        kept = encoded[:room].decode("utf-8", errors="ignore")  # never half a character
        if kept:
            _hold(draft, HeldSegment(text=kept), len(kept.encode("utf-8")))
    draft.cut = True
    draft.cut_by_send_limit = by_send_limit
    if mid_stream:
        turn.effects.append(CutStream())


def hold_expression(turn: TurnState, expression: str) -> None:
    """Hold a tool's expression in its place in the presentation. It counts as the turn's
    one expression already (a second is never held or delivered)."""
    draft = turn.draft
    assert draft is not None
    turn.expression_delivered = True
    draft.expression_held = True
    if draft.cut or draft.held_segments >= turn.policy.held_prose_max_segments:
        return
    _hold(draft, HeldSegment(expression=expression), 0)


def _hold(draft: DraftState, segment: HeldSegment, size: int) -> None:
    draft.segments.append(segment)
    draft.held_bytes += size
    draft.held_segments += 1


def discard_buffer(turn: TurnState) -> None:
    draft = turn.draft
    if draft is not None and turn.policy.drafting:
        draft.discarded += "".join(turn.pass_text[turn.buffer_start :])
    turn.buffer_start = len(turn.pass_text)
    turn.buffer_len = 0


def record_delivery(turn: TurnState, event: DeliveryRecorded) -> None:
    delivered = turn.deliveries.in_flight.pop(event.seq, None)
    if delivered is not None:
        if turn.deliveries.delivered is None:
            turn.deliveries.delivered = []
        turn.deliveries.delivered.append(delivered)


def post_notice(turn: TurnState, notice: Notice) -> None:
    if turn.produced.notices is None:
        turn.produced.notices = []
    turn.produced.notices.append(notice)
    turn.effects.append(PostNotice(notice))


def _keeper(turn: TurnState, kind: DeadlineKind) -> PassRecord | None:
    """Who keeps the token of ``kind``'s armed deadline: the pass its stream deadline
    (`PassRecord.deadline`); ``None`` for the rarer kinds, kept by the turn
    (`TurnState.armed`: a turn waiting on its provider then holds no entry there). Each call
    of a tool batch keeps its own (`arm_call_deadline`)."""
    if kind is DeadlineKind.STREAM:
        return turn.current_pass
    assert kind is not DeadlineKind.TOOL, "a tool deadline belongs to its call"
    return None


def arm_call_deadline(turn: TurnState, call: BatchCall, seconds: float) -> None:
    """Arm the ``TOOL`` deadline of one running call of the batch: its token is the call's."""
    turn.next_token += 1
    call.deadline = turn.next_token
    turn.effects.append(ArmDeadline(DeadlineKind.TOOL, call.deadline, seconds))


def clear_call_deadline(turn: TurnState, call: BatchCall) -> None:
    """Clear the call's ``TOOL`` deadline, if it is armed."""
    token, call.deadline = call.deadline, None
    if token is not None:
        turn.effects.append(ClearDeadline(DeadlineKind.TOOL, token))


def arm_deadline(
    turn: TurnState,
    kind: DeadlineKind,
    seconds: float,
    *,
    rolling: bool = False,
    first_seconds: float | None = None,
    total_seconds: float | None = None,
) -> None:
    turn.next_token += 1
    token = turn.next_token
    keeper = _keeper(turn, kind)
    if keeper is not None:
        keeper.deadline = token
    else:
        turn.armed[kind] = token
    turn.effects.append(ArmDeadline(kind, token, seconds, rolling, first_seconds, total_seconds))


def clear_deadline(turn: TurnState, kind: DeadlineKind) -> None:
    token = disarm_deadline(turn, kind)
    if token is not None:
        turn.effects.append(ClearDeadline(kind, token))


def armed_tokens(turn: TurnState, kind: DeadlineKind) -> tuple[int, ...]:
    """The tokens of the armed deadlines of ``kind``: at most one for every kind (see
    `_keeper` for where it is kept) but ``TOOL``, of which each running call of the batch
    has its own."""
    if kind is DeadlineKind.TOOL:
        return tuple(c.deadline for c in turn.tool_round.calls if c.deadline is not None)
    keeper = _keeper(turn, kind)
    token = keeper.deadline if keeper is not None else turn.armed.get(kind)
    return () if token is None else (token,)


def disarm_deadline(turn: TurnState, kind: DeadlineKind) -> int | None:
    """Forget the armed deadline of ``kind`` (it expired, or is cleared); its token."""
    keeper = _keeper(turn, kind)
    if keeper is None:
        return turn.armed.pop(kind, None)
    token, keeper.deadline = keeper.deadline, None
    return token
