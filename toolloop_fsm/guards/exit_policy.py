"""Exit rules: when a pass or a tool round ends the turn (docs/behaviour.md §4.1, §4.4, §4.6 and
the empty-pass rules of §2.5)."""

from __future__ import annotations

from collections.abc import Callable

from toolloop_fsm.events import FinishKind
from toolloop_fsm.ledger import ToolOutcome
from toolloop_fsm.policy import ExitView
from toolloop_fsm.turn import TurnState


class ExitRuleError(TypeError):
    """A custom exit rule (`LoopPolicy.end_after_pre_tool_text`) answered with something that
    is not a bool: a bug in the policy. Read as truthy, ``"no"`` would end the turn, so the
    turn stops on it instead, the message naming the rule and its answer."""


_CUT_FINISHES = frozenset(
    {FinishKind.LENGTH, FinishKind.SPEAKER_GUARD, FinishKind.CONTINUATION_PENDING}
)


def _outcomes(turn: TurnState) -> list[ToolOutcome]:
    return [c.outcome for c in turn.tool_round.calls if c.outcome is not None]


def tool_requested_context_restart(turn: TurnState) -> bool:
    """A successful outcome of the batch carries a context-enrichment signal
    (docs/behaviour.md §5, §3.10 rule 4)."""
    return any(o.success and o.restart_item is not None for o in _outcomes(turn))


def tool_asked_to_end_turn(turn: TurnState) -> bool:
    """A call of the batch succeeded and asked to end the turn."""
    return any(o.success and o.end_turn for o in _outcomes(turn))


def exit_view(turn: TurnState, name: str | None = None) -> ExitView:
    """What the pre-tool-text rule sees of the call of tool ``name`` (default: the last
    tool)."""
    name = name if name is not None else turn.last_tool or ""
    tool = turn.registry.get(name)
    return ExitView(
        tool_name=name,
        pre_tool_text=turn.pre_tool_text,
        requires_follow_up=tool.requires_follow_up if tool is not None else True,
        continuation_style=turn.continuation_style,
        iteration=turn.iterations,
    )


def should_end_after_pre_tool_text(turn: TurnState) -> bool:
    """After visible pre-tool text, a batch of silent tools ends the turn ``completed``
    (docs/behaviour.md §4.6): the rule must hold for every call of the batch.

    The memory tool (``memory_tool_name``), as a member of
    ``suppress_followup_after_pre_tool_text`` (its default member), ends it whatever its
    ``requires_follow_up`` says: a memory update is silent by what it is, not by how it was
    registered. Other members, and on continuation-style providers any tool, end it only when
    they need no follow-up; a host that leaves the memory tool out of the set opts out.
    """
    if turn.pre_tool_text is None or not turn.pre_tool_text.strip():
        return False
    calls = turn.tool_round.calls
    if not calls:
        return False
    for batch_call in calls:
        outcome = batch_call.outcome
        if outcome is None or not outcome.success:
            return False
        if not _silent_after_pre_tool_text(turn, str(batch_call.call.name)):
            return False
    return True


def _silent_after_pre_tool_text(turn: TurnState, name: str) -> bool:
    policy = turn.policy
    if policy.end_after_pre_tool_text is not None:
        return ask_exit_rule(policy.end_after_pre_tool_text, exit_view(turn, name))
    # the default rule reads the same facts as the view, without building it (every round)
    silent = name in policy.suppress_followup_after_pre_tool_text
    if silent and name == policy.memory_tool_name:
        return True
    tool = turn.registry.get(name)
    if tool is None or tool.requires_follow_up:
        return False  # even a member of the suppress set continues when it needs a follow-up
    return silent or turn.continuation_style


def ask_exit_rule(rule: Callable[[ExitView], bool], view: ExitView) -> bool:
    """The custom exit rule's answer for ``view``; `ExitRuleError` when it is not a bool."""
    answer: object = rule(view)
    if not isinstance(answer, bool):
        raise ExitRuleError(
            f"LoopPolicy.end_after_pre_tool_text {rule_name(rule)} returned {answer!r} "
            f"(a {type(answer).__name__}), not a bool: return True to end the turn after the "
            f"tool {view.tool_name!r}, False to go on"
        )
    return answer


def rule_name(rule: Callable[..., object]) -> str:
    """A policy function as its author finds it: its name and where it is defined."""
    name = getattr(rule, "__qualname__", None) or repr(rule)
    code = getattr(rule, "__code__", None)
    if code is None:
        return name
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


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
    names = turn.last_tools or ((turn.last_tool,) if turn.last_tool is not None else ())
    if not names:
        return False
    # a batch settles only when none of its tools needs a follow-up
    for name in names:
        tool = turn.registry.get(name)
        if tool is None or tool.requires_follow_up:
            return False
    return True
