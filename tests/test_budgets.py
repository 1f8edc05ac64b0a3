"""Token and cost budgets (docs/behaviour.md §2.8): a pass that would break a ceiling does
not start, a pass is asked for no more than the budgets leave it, a pass that writes past its
room is cut there after delivering what fits, the chain's budget counts every attempt, and a
budget ending is final for the chain. Time is virtual."""

from __future__ import annotations

from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Turn
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm import snapshot_to_json
from toolloop_fsm.policy import Budget
from toolloop_fsm.policy import Price
from toolloop_fsm.result import BudgetExceeded
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import ReviewUsage
from toolloop_fsm.review import Revise
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptedReviewer
from toolloop_fsm.testing import VirtualClock

CALL = FunctionCall("get_weather", {"city": "Oslo"})
#: A reply far longer than any room these tests leave (about 130 tokens by the estimate).
LONG = "It is clear and mild in Oslo today, with a light breeze from the fjord. " * 8


def _weather(turn: Turn) -> Tool:
    return make_tool("get_weather", turn.executions, turn.clock)


async def _ok(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"sky": "clear"})


def _first_pass(read: int, wrote: int) -> list[Any]:
    return [TextDelta("Checking. "), CALL, UsageReport(read, wrote)]


# --------------------------------------------------------------------------- before a pass
async def test_a_pass_the_output_budget_cannot_cover_does_not_start() -> None:
    turn = scripted_turn([_first_pass(100, 40), [TextDelta("Clear."), UsageReport(150, 5)]])
    policy = LoopPolicy(budget=Budget(output_tokens=40))

    result = await run_turn(turn, [_weather(turn)], policy=policy)

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert result.iterations == 1 and len(turn.provider.requests) == 1  # never asked again
    assert turn.executions.names() == ["get_weather"]  # the call of the first pass ran
    assert result.budget_exceeded == BudgetExceeded("turn", "output_tokens", 40, 40, 1)
    assert [n.key for n in result.notices] == ["budget_exceeded"]
    assert result.notices[0].params == {"scope": "turn", "limit": "output_tokens", "allowed": 40}
    assert turn.channel.text == "Checking. "  # what was delivered stays delivered


async def test_the_next_pass_is_expected_to_read_what_the_last_one_read() -> None:
    # 100 read by the first pass: a second would read at least as much, past 150
    turn = scripted_turn([_first_pass(100, 10), [TextDelta("Clear."), UsageReport(120, 5)]])
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(input_tokens=150))
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert result.budget_exceeded == BudgetExceeded("turn", "input_tokens", 150, 100, 100)
    # with room for both reads the turn completes
    turn = scripted_turn([_first_pass(100, 10), [TextDelta("Clear."), UsageReport(120, 5)]])
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(input_tokens=220))
    )
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)


async def test_the_total_budget_counts_what_the_next_pass_reads() -> None:
    turn = scripted_turn([_first_pass(100, 10), [TextDelta("Clear."), UsageReport(100, 5)]])
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(total_tokens=210))
    )
    # 110 spent, 100 to read: no token left to write
    assert result.budget_exceeded == BudgetExceeded("turn", "total_tokens", 210, 110, 101)
    assert result.reason == "token_budget"


# --------------------------------------------------------------------------- the pass's room
async def test_each_pass_is_asked_for_no_more_than_the_budget_leaves() -> None:
    turn = scripted_turn([_first_pass(100, 30), [TextDelta("Clear."), UsageReport(150, 5)]])
    await run_turn(turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(output_tokens=100)))
    assert [r.max_output for r in turn.provider.requests] == [100, 70]
    # the request's own max_output stands where it is lower
    turn = scripted_turn([_first_pass(100, 30), [TextDelta("Clear."), UsageReport(150, 5)]])
    await run_turn(
        turn,
        [_weather(turn)],
        policy=LoopPolicy(budget=Budget(output_tokens=100)),
        request=TurnRequest(USER, max_output=50),
    )
    assert [r.max_output for r in turn.provider.requests] == [50, 50]


async def test_a_pass_writing_past_its_room_is_cut_there_and_its_request_aborted() -> None:
    # the provider ignores max_output: the room (60 - 20 = 40 tokens) is reached mid-reply,
    # and a stall after it shows the read stopped there
    turn = scripted_turn(
        [
            _first_pass(100, 20),
            [TextDelta(LONG), Pause(1000.0), TextDelta(" And tomorrow?"), CALL],
        ]
    )
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(output_tokens=60))
    )

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert turn.clock.now() < 1000.0  # the stall was never waited for
    assert turn.provider.streams_closed == 2
    written = turn.channel.text.removeprefix("Checking. ")
    assert LONG.startswith(written) and 35 <= estimate_tokens(written) <= 40
    assert "tomorrow" not in turn.channel.text
    assert result.budget_exceeded == BudgetExceeded("turn", "output_tokens", 60, 60, 0)
    assert turn.executions.names() == ["get_weather"]  # the cut pass's call never ran
    assert result.final_text == written  # the cut reply is what the user read


async def test_thoughts_are_written_output_too() -> None:
    turn = scripted_turn([[ThoughtDelta(LONG), TextDelta("Clear.")]])
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(output_tokens=30))
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert turn.channel.text == ""  # the reply after the thoughts was never reached


async def test_a_server_that_reports_no_usage_is_budgeted_by_estimates() -> None:
    turn = scripted_turn([[TextDelta("Checking. "), CALL], [TextDelta(LONG)]])
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(budget=Budget(output_tokens=20))
    )
    assert result.usage.has_estimates
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert result.usage.output_tokens <= 20


async def test_a_reviewers_usage_is_spent_from_the_budget_too() -> None:
    # the reply's pass wrote 5 tokens, the reviewer 45 of its own: the revision would start
    # with none of the 50 left
    clock = VirtualClock()
    provider = ScriptedProvider(
        [[TextDelta("Hi there."), UsageReport(10, 5)], [TextDelta("Hello!")]], clock=clock
    )
    flat = Finding(FindingCategory.VOICE, "The reply sounds flat.", "Answer warmly.")
    reviewer = ScriptedReviewer([Revise([flat], usage=ReviewUsage(100, 45))], clock=clock)
    channel = RecordingChannel(clock=clock)
    result = await run_tool_loop(
        provider,
        [],
        channel,
        TurnRequest(USER),
        policy=LoopPolicy(drafting=True, budget=Budget(output_tokens=50)),
        reviewer=reviewer,
        clock=clock,
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert result.budget_exceeded == BudgetExceeded("turn", "output_tokens", 50, 50, 1)
    assert len(provider.requests) == 1  # the revision never started
    assert channel.text == ""  # the held draft the reviewer sent back was never shown


# --------------------------------------------------------------------------- cost
PRICE = Price(input_per_million=1.0, output_per_million=4.0)


async def test_a_cost_ceiling_prices_the_ledger_and_ends_the_turn_as_cost_budget() -> None:
    turn = scripted_turn([_first_pass(1000, 20), [TextDelta("Clear."), UsageReport(1050, 10)]])
    result = await run_turn(
        turn, [_weather(turn)], policy=LoopPolicy(price=PRICE, budget=Budget(cost=0.0015))
    )
    # 0.00108 spent, the next pass reads about 0.001 more: past 0.0015
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "cost_budget")
    exceeded = result.budget_exceeded
    assert exceeded is not None and exceeded.limit == "cost"
    assert exceeded.spent == pytest.approx(0.00108)
    assert result.cost == pytest.approx(0.00108)
    # the first pass was asked for no more than the cost ceiling could pay for
    assert turn.provider.requests[0].max_output == 375


async def test_the_cost_of_a_turn_is_reported_with_a_price_and_without_a_budget() -> None:
    turn = scripted_turn([[TextDelta("Clear."), UsageReport(2000, 500)]])
    result = await run_turn(turn, [], policy=LoopPolicy(price=PRICE))
    assert result.cost == pytest.approx(0.004)
    assert turn.provider.requests[0].max_output is None  # a price alone clamps nothing
    result = await run_turn(scripted_turn([[TextDelta("Clear.")]]), [])
    assert result.cost is None


# --------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Budget(), "at least one ceiling"),
        (lambda: Budget(output_tokens=0), "output_tokens"),
        (lambda: Budget(cost=-1.0), "cost"),
        (lambda: Budget(cost=float("nan")), "cost"),
        (lambda: Budget(input_tokens=True), "input_tokens"),
        (lambda: Price(input_per_million=-1, output_per_million=1), "input_per_million"),
        (lambda: LoopPolicy(budget=Budget(cost=1.0)), "needs the model's price"),
        (lambda: LoopPolicy(budget={"cost": 1.0}), "budget"),  # type: ignore[arg-type]
        (lambda: Attempt(ScriptedProvider([]), price=1.5), "price"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_budget_or_price_is_refused_where_it_is_built(build: Any, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        build()


async def test_a_chain_cost_ceiling_with_an_unpriced_model_is_refused_at_the_call() -> None:
    attempts = [
        Attempt(ScriptedProvider([]), label="priced", price=PRICE),
        Attempt(ScriptedProvider([]), label="unpriced"),
    ]
    with pytest.raises(ValueError, match="unpriced"):
        await run_generation_turn(
            attempts,
            [],
            RecordingChannel(),
            TurnRequest(USER),
            policy=TurnPolicy(budget=Budget(cost=0.01)),
            clock=VirtualClock(),
        )


# --------------------------------------------------------------------------- the chain
async def _chain(
    first: list[list[Any]], second: list[list[Any]], policy: TurnPolicy
) -> tuple[Any, ScriptedProvider, ScriptedProvider, RecordingChannel]:
    clock = VirtualClock()
    one = ScriptedProvider(first, clock=clock)
    two = ScriptedProvider(second, clock=clock)
    channel = RecordingChannel(clock=clock)
    result = await run_generation_turn(
        [
            Attempt(one, label="first", price=PRICE),
            Attempt(two, label="second", price=Price(2.0, 8.0)),
        ],
        [],
        channel,
        TurnRequest(USER),
        policy=policy,
        clock=clock,
    )
    return result, one, two, channel


FAILING = ProviderError("overloaded", kind="server", retryable=True)


async def test_the_chains_budget_counts_what_earlier_attempts_spent() -> None:
    # the first model spends 90 of 100 output tokens, then fails; the second is left 10
    result, _one, two, _channel = await _chain(
        [[TextDelta("Thinking"), UsageReport(50, 90), Fail(FAILING)]],
        [[TextDelta("Clear."), UsageReport(60, 4)]],
        TurnPolicy(budget=Budget(output_tokens=100)),
    )
    assert two.requests[0].max_output == 10
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    # each attempt is priced at its own model's price
    assert result.cost == pytest.approx(PRICE.cost(50, 90) + Price(2.0, 8.0).cost(60, 4))


async def test_a_budget_ending_is_final_for_the_chain() -> None:
    result, _one, two, _channel = await _chain(
        [[TextDelta(LONG)]],
        [[TextDelta("Clear.")]],
        TurnPolicy(loop=LoopPolicy(budget=Budget(output_tokens=10))),
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert two.requests == []  # no fallback spends more
    assert [a.label for a in result.attempts] == ["first"]


async def test_a_chain_budget_spent_by_one_attempt_stops_the_next_before_its_first_pass() -> None:
    result, _one, two, _channel = await _chain(
        [[TextDelta("Thinking"), UsageReport(50, 100), Fail(FAILING)]],
        [[TextDelta("Clear.")]],
        TurnPolicy(budget=Budget(output_tokens=100)),
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert two.requests == []
    assert result.budget_exceeded == BudgetExceeded("chain", "output_tokens", 100, 100, 1)


# --------------------------------------------------------------------------- snapshots
async def test_a_resumed_turn_keeps_its_budget_and_what_it_spent() -> None:
    snapshots: list[Any] = []
    clock = VirtualClock()
    provider = ScriptedProvider([_first_pass(100, 30)], clock=clock)
    weather = Tool("get_weather", "w", {"type": "object"}, _ok)
    policy = LoopPolicy(price=PRICE, budget=Budget(output_tokens=50))
    await run_tool_loop(
        provider,
        [weather],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        policy=policy,
        clock=clock,
        on_snapshot=snapshots.append,
    )
    taken = snapshot_from_json(snapshot_to_json(snapshots[-1]))  # before the second pass
    resumed = ScriptedProvider([[TextDelta(LONG)]], clock=clock)
    result = await resume_tool_loop(
        taken, resumed, [weather], RecordingChannel(clock=clock), policy=policy, clock=clock
    )
    assert resumed.requests[0].max_output == 20  # 30 of 50 were spent before the snapshot
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    assert result.cost is not None and result.cost > PRICE.cost(100, 30)
