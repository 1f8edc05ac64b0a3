"""Exit rules: when a pass or a tool round ends the turn (docs/behaviour.md §4.1, §4.4, §4.6 and
the empty-pass rules of §2.5)."""

from __future__ import annotations

from toolloop_fsm.events import FinishKind
from toolloop_fsm.policy import ExitView
from toolloop_fsm.turn import TurnState

_CUT_FINISHES = frozenset(
    {FinishKind.LENGTH, FinishKind.SPEAKER_GUARD, FinishKind.CONTINUATION_PENDING}
)


def tool_requested_context_restart(turn: TurnState) -> bool:
    """The successful outcome carries a context-enrichment signal (docs/behaviour.md §5)."""
    outcome = turn.tool_round.outcome
    return outcome is not None and outcome.success and outcome.restart_item is not None


def tool_asked_to_end_turn(turn: TurnState) -> bool:
    outcome = turn.tool_round.outcome
    return outcome is not None and outcome.success and outcome.end_turn


def exit_view(turn: TurnState) -> ExitView:
    name = turn.last_tool or ""
    tool = turn.registry.get(name)
    return ExitView(
        tool_name=name,
        pre_tool_text=turn.pre_tool_text,
        requires_follow_up=tool.requires_follow_up if tool is not None else True,
        continuation_style=turn.continuation_style,
        iteration=turn.iterations,
    )


def should_end_after_pre_tool_text(turn: TurnState) -> bool:
    """After visible pre-tool text, a silent tool ends the turn ``completed``
    (docs/behaviour.md §4.6).

    The memory tool (``memory_tool_name``), as a member of
    ``suppress_followup_after_pre_tool_text`` (its default member), ends it whatever its
    ``requires_follow_up`` says: a memory update is silent by what it is, not by how it was
    registered. Other members, and on continuation-style providers any tool, end it only when
    they need no follow-up; a host that leaves the memory tool out of the set opts out.
    """
    outcome = turn.tool_round.outcome
    if outcome is None or not outcome.success:
        return False
    if turn.pre_tool_text is None or not turn.pre_tool_text.strip():
        return False
    policy = turn.policy
    if policy.end_after_pre_tool_text is not None:
        return bool(policy.end_after_pre_tool_text(exit_view(turn)))
    # the default rule reads the same facts as the view, without building it (every round)
    name = turn.last_tool or ""
    silent = name in policy.suppress_followup_after_pre_tool_text
    if silent and name == policy.memory_tool_name:
        return True
    tool = turn.registry.get(name)
    if tool is None or tool.requires_follow_up:
        return False  # even a member of the suppress set continues when it needs a follow-up
    return silent or turn.continuation_style


def pass_has_text(turn: TurnState) -> bool:
    """The pass produced visible, non-blank text."""
    return any(part.strip() for part in turn.pass_text)


def is_settled_after_tool(turn: TurnState) -> bool:
    """An empty pass is a finished reply when it was not cut (length limit, speaker guard,
    pending continuation fragment) and either a tool already delivered its own response
    (a message it sent, an expression), or visible text or an expression was delivered and
    the last tool needs no follow-up."""
    if turn.current_pass.finish in _CUT_FINISHES:
        return False
    if turn.tool_response_delivered:
        return True
    if not (turn.deliveries.visible_text_delivered or turn.expression_delivered):
        return False
    if turn.last_tool is None:
        return False
    tool = turn.registry.get(turn.last_tool)
    return tool is not None and not tool.requires_follow_up
