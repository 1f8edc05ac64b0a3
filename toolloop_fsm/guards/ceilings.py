"""Ceilings: how many passes, calls, failures and retries a turn may take."""

from __future__ import annotations

from toolloop_fsm.budgets import Room
from toolloop_fsm.budgets import expected_reads
from toolloop_fsm.budgets import pass_allowance
from toolloop_fsm.guards.exit_policy import pass_has_text
from toolloop_fsm.result import BudgetExceeded
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.turn import TurnState


def iteration_ceiling_reached(turn: TurnState) -> bool:
    """Another pass would exceed ``max_function_call_iterations``."""
    return turn.iterations >= turn.policy.max_function_call_iterations


def allowance_of_next_pass(turn: TurnState) -> BudgetExceeded | Room | None:
    """What the budgets allow the pass about to open (docs/behaviour.md §2.8): the ceiling
    it would break, the room it may write in, or ``None`` without a budget."""
    policy = turn.policy
    if policy.budget is None and turn.attempt_budget is None:
        return None  # the usual case, decided without reading the ledger
    entries = turn.produced.usage or ()
    return pass_allowance(policy, turn.attempt_budget, entries, expected_reads(entries))


def held_messages_wait_for_answer(turn: TurnState) -> bool:
    """The turn would end ``completed`` holding messages (docs/behaviour.md §8.5 rule 3), as
    it decides so (a message that comes while its deliveries settle comes too late), and its
    ceilings leave one more pass to answer them: the iteration ceiling, and the token and
    cost budgets (a pass they would refuse is not opened; the messages go unanswered)."""
    return (
        bool(turn.held_messages)
        and turn.status is TurnStatus.COMPLETED
        and not turn.settle_started
        and not iteration_ceiling_reached(turn)
        and not isinstance(allowance_of_next_pass(turn), BudgetExceeded)
    )


def token_budget_reached(turn: TurnState) -> bool:
    """The pass about to open would break a token ceiling (§2.8 rule 2)."""
    found = allowance_of_next_pass(turn)
    return isinstance(found, BudgetExceeded) and found.reason == "token_budget"


def cost_budget_reached(turn: TurnState) -> bool:
    """The pass about to open would break the cost ceiling (§2.8 rule 2)."""
    found = allowance_of_next_pass(turn)
    return isinstance(found, BudgetExceeded) and found.reason == "cost_budget"


def pass_cut_at_token_budget(turn: TurnState) -> bool:
    """The pass was cut as its output reached a token ceiling (§2.8 rule 4)."""
    cut = turn.budget_exceeded
    return cut is not None and cut.reason == "token_budget"


def pass_cut_at_cost_budget(turn: TurnState) -> bool:
    """The pass was cut as its output reached the cost ceiling (§2.8 rule 4)."""
    cut = turn.budget_exceeded
    return cut is not None and cut.reason == "cost_budget"


def tool_call_limit_reached(turn: TurnState) -> bool:
    """The turn ran as many calls as ``max_tool_calls`` allows (docs/behaviour.md §3.12)."""
    limit = turn.policy.max_tool_calls
    return limit is not None and turn.tool_calls_used >= limit


def tools_withdrawn_by(turn: TurnState) -> str | None:
    """Whether the pass about to open is the final answer pass, offered no tools, and the
    ceiling that makes it one: the tool-call limit once reached (§3.12), else — with
    ``at_ceiling="answer"`` — the iteration ceiling, on the last pass it allows (§2.1)."""
    if tool_call_limit_reached(turn):
        return "tool_call_limit"
    policy = turn.policy
    if policy.at_ceiling == "answer" and turn.iterations + 1 >= policy.max_function_call_iterations:
        return "iteration_ceiling"
    return None


def final_answer_pass_due(turn: TurnState) -> bool:
    """The pass about to open is the final answer pass (`tools_withdrawn_by`)."""
    return tools_withdrawn_by(turn) is not None


def calls_after_tool_call_limit(turn: TurnState) -> bool:
    """The final answer pass the tool-call limit gave still asked for tools (§3.12)."""
    return turn.tools_withdrawn == "tool_call_limit" and bool(turn.tool_round.calls)


def calls_at_iteration_ceiling(turn: TurnState) -> bool:
    """The final answer pass at the iteration ceiling still asked for tools (§2.1)."""
    return turn.tools_withdrawn == "iteration_ceiling" and bool(turn.tool_round.calls)


def answers_at_tool_call_limit(turn: TurnState) -> bool:
    """The final answer pass the tool-call limit gave answered with text (§3.12)."""
    return turn.tools_withdrawn == "tool_call_limit" and pass_has_text(turn)


def answers_at_iteration_ceiling(turn: TurnState) -> bool:
    """The final answer pass at the iteration ceiling answered with text (§2.1)."""
    return turn.tools_withdrawn == "iteration_ceiling" and pass_has_text(turn)


def consecutive_error_ceiling_reached(turn: TurnState) -> bool:
    """``max_consecutive_tool_errors`` tool failures in a row (docs/behaviour.md §4.3)."""
    return turn.consecutive_tool_errors >= turn.policy.max_consecutive_tool_errors


def continuation_retries_exhausted(turn: TurnState) -> bool:
    """A continuation-style provider failed after visible text too often in a row
    (docs/behaviour.md §4.5)."""
    return (
        turn.continuation_style
        and turn.continuation_failures >= turn.policy.continuation_tool_failure_threshold
    )
