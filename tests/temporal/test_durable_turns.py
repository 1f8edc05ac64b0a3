"""Durable turns on a real Temporal dev server, with a worker in the test's process: the
result is the in-process turn's on the same script (tools, fallback), a stop and a follow-up
arrive as signals, notices that hang share one host-call budget as in process, and what a
durable turn cannot do is refused by name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import LOOP_CLOCK
from toolloop_fsm.policy import Budget
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import converter
from toolloop_fsm.testing import ChannelAct
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import HostileChannel
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import Stragglers
from toolloop_fsm.testing import real_time_limit

temporalio = pytest.importorskip("temporalio")

from temporalio.client import Client  # noqa: E402

from tests.temporal.turns import POLICY  # noqa: E402
from tests.temporal.turns import start_turn  # noqa: E402
from toolloop_fsm.temporal import DATA_CONVERTER  # noqa: E402
from toolloop_fsm.temporal import TurnHandle  # noqa: E402
from toolloop_fsm.temporal import TurnWorker  # noqa: E402
from toolloop_fsm.temporal import start_generation_turn  # noqa: E402
from toolloop_fsm.temporal._values import CALL_CHANNEL  # noqa: E402
from toolloop_fsm.temporal._values import ChannelCall  # noqa: E402

LIMIT = 60.0
REQUEST = TurnRequest([{"role": "user", "content": "What is 2 + 3?"}])
TOOL_SCRIPT: list[list[ScriptItem]] = [
    [
        TextDelta("Let me add "),
        TextDelta("that up. "),
        FunctionCall("add", {"a": 2, "b": 3}, "c1"),
        UsageReport(12, 7),
    ],
    [TextDelta("The sum "), TextDelta("is 5."), UsageReport(30, 4)],
]
UPSTREAM_503 = ProviderError("upstream 503", kind="server", retryable=True, status_code=503)
FAILING: list[list[ScriptItem]] = [[TextDelta("Hel"), Fail(UPSTREAM_503)]]


async def _add(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(data=arguments["a"] + arguments["b"])


ADD = Tool(
    "add",
    "Adds two integers.",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    _add,
)


def comparable(result: GenerationTurnResult) -> Any:
    """The result as data, as results compare: without the clock readings its trace steps
    carry (a workflow's clock is not the process's) and the turn's id."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "at"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    data = strip(converter.unstructure(result))
    del data["turn_id"]
    return data


def scripted(script: list[list[ScriptItem]]) -> Attempt:
    return Attempt(lambda key: ScriptedProvider(script))


async def durable_turn(
    client: Client,
    task_queue: str,
    providers: dict[str, Attempt],
    chain: list[str],
    channel: RecordingChannel,
    *,
    request: TurnRequest = REQUEST,
    policy: TurnPolicy = POLICY,
) -> GenerationTurnResult:
    async with TurnWorker(
        client, task_queue, providers=providers, tools=[ADD], channels={"chat": channel}
    ):
        handle = await start_turn(
            client, task_queue, request, attempts=chain, policy=policy, heartbeat=2.0
        )
        async with real_time_limit(LIMIT):
            return await handle.result()


async def test_a_turn_with_tools_ends_as_the_in_process_turn_does(
    client: Client, task_queue: str
) -> None:
    channel = RecordingChannel()
    durable = await durable_turn(
        client, task_queue, {"main": scripted(TOOL_SCRIPT)}, ["main"], channel
    )
    local_channel = RecordingChannel()
    local = await run_generation_turn(
        [Attempt(lambda key: ScriptedProvider(TOOL_SCRIPT), label="main")],
        [ADD],
        local_channel,
        REQUEST,
        policy=POLICY,
    )
    assert durable.status is TurnStatus.COMPLETED
    assert durable.final_text == "The sum is 5."
    assert comparable(durable) == comparable(local)
    assert channel.texts == local_channel.texts  # delivered in the same pieces
    assert channel.duplicates_dropped == 0


async def test_a_failing_model_falls_back_to_the_next_as_in_process(
    client: Client, task_queue: str
) -> None:
    channel = RecordingChannel()
    durable = await durable_turn(
        client,
        task_queue,
        {"flaky": scripted(FAILING), "main": scripted(TOOL_SCRIPT)},
        ["flaky", "main"],
        channel,
    )
    local = await run_generation_turn(
        [
            Attempt(lambda key: ScriptedProvider(FAILING), label="flaky"),
            Attempt(lambda key: ScriptedProvider(TOOL_SCRIPT), label="main"),
        ],
        [ADD],
        RecordingChannel(),
        REQUEST,
        policy=POLICY,
    )
    assert durable.status is TurnStatus.COMPLETED
    assert [a.label for a in durable.attempts] == ["flaky", "main"]
    assert comparable(durable) == comparable(local)
    assert channel.text == local.delivered_text


class WaitingProvider:
    """Streams a first piece of text, then waits until the turn cancels the pass."""

    name = "waiting"

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
        return self._play()

    async def _play(self) -> AsyncIterator[Any]:
        yield TextDelta("Counting the stars: ")
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        yield TextDelta("never")


async def _first_delivery(channel: RecordingChannel) -> None:
    delivered = asyncio.Event()
    channel.on_delivery = lambda _d: delivered.set()
    if not channel.delivered:
        await delivered.wait()


async def test_a_stop_signal_stops_the_streaming_pass_and_queues_the_stop_message(
    client: Client, task_queue: str
) -> None:
    channel = RecordingChannel()
    provider = WaitingProvider()
    async with TurnWorker(
        client, task_queue, providers={"main": provider}, channels={"chat": channel}
    ):
        handle = await start_turn(client, task_queue, REQUEST)
        async with real_time_limit(LIMIT):
            await _first_delivery(channel)
            await handle.stop("Stopped, as you asked.")
            result = await handle.result()
            await provider.cancelled.wait()  # the pass's stream was closed on the worker
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert channel.queued_front == ["Stopped, as you asked."]
    assert channel.text == "Counting the stars: "
    assert result.delivered_text == "Counting the stars: "  # what the pass delivered is kept


async def test_a_follow_up_signal_interrupts_the_streaming_pass(
    client: Client, task_queue: str
) -> None:
    channel = RecordingChannel()
    async with TurnWorker(
        client, task_queue, providers={"main": WaitingProvider()}, channels={"chat": channel}
    ):
        handle = await start_turn(client, task_queue, REQUEST)
        async with real_time_limit(LIMIT):
            await _first_delivery(channel)
            await handle.follow_up()
            result = await handle.result()
    assert result.status is TurnStatus.FOLLOW_UP_INTERRUPT
    assert result.delivered_text == "Counting the stars: "


async def _no_station(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    raise ConnectionError("no station")


WEATHER_TOOL = Tool("get_weather", "Current weather.", {"type": "object"}, _no_station)


async def notice_allowances(turn: TurnHandle) -> list[float]:
    """How long the turn let each notice it sent take, from its history."""
    allowed: list[float] = []
    async for event in turn.handle.fetch_history_events():
        if not event.HasField("activity_task_scheduled_event_attributes"):
            continue
        scheduled = event.activity_task_scheduled_event_attributes
        if scheduled.activity_type.name != CALL_CHANNEL:
            continue
        [call] = DATA_CONVERTER.payload_converter.from_payloads(
            scheduled.input.payloads, [ChannelCall]
        )
        if call.method == "send_notice":
            allowed.append(call.timeout)
    return allowed


@pytest.mark.parametrize("hanging", [ChannelAct.HANG, ChannelAct.IGNORE_CANCELLATION])
async def test_two_hanging_notices_delay_a_durable_turn_by_one_host_call_budget_not_two(
    client: Client, task_queue: str, hanging: ChannelAct
) -> None:
    # the primary's tool fails (its tool_failed notice hangs), then the primary fails and
    # the backup answers (its closing fallback_used notice would hang too): as in process,
    # the first is given up on at the budget and named, the second is never sent
    budget = 2.0
    policy = TurnPolicy(
        loop=LoopPolicy(host_call_timeout=budget, cancel_grace=1, delivery_flush_chars=1)
    )
    stragglers = Stragglers()
    channel = HostileChannel(
        clock=LOOP_CLOCK,
        host_call_timeout=budget,
        stragglers=stragglers,
        notices=(hanging, hanging),
    )
    primary: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Paris"}, "c1")],
        [Fail(UPSTREAM_503)],
    ]
    backup: list[list[ScriptItem]] = [[TextDelta("No weather today.")]]
    providers = {"primary": scripted(primary), "backup": scripted(backup)}
    try:
        async with TurnWorker(
            client,
            task_queue,
            providers=providers,
            tools=[WEATHER_TOOL],
            channels={"chat": channel},
        ):
            handle = await start_turn(
                client,
                task_queue,
                REQUEST,
                attempts=["primary", "backup"],
                policy=policy,
                heartbeat=2.0,
            )
            async with real_time_limit(LIMIT):
                result = await handle.result()
    finally:
        stragglers.release()

    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert channel.text == "No weather today."
    # the primary ended on its provider's failure, not on the notice it could not post
    assert result.attempts[0].reason != "host_timeout"
    assert [notice.key for notice in result.notices][-1] == "fallback_used"
    notices_sent = [call for call in channel.calls if call.method == "send_notice"]
    assert [call.act for call in notices_sent] == [hanging]  # the second is not awaited
    assert result.abandoned_calls == ("channel.send_notice",)
    assert sum(await notice_allowances(handle)) <= budget


async def test_a_chain_naming_a_provider_the_worker_lacks_ends_with_host_error_naming_it(
    client: Client, task_queue: str
) -> None:
    result = await durable_turn(
        client, task_queue, {"main": scripted(TOOL_SCRIPT)}, ["mian"], RecordingChannel()
    )
    assert result.status is TurnStatus.ERROR
    assert result.reason == "host_error"
    assert "unknown providers ['mian']" in (result.error_message or "")
    assert "main" in (result.error_message or "")


_BUDGET = Budget(output_tokens=100)


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        (TurnPolicy(loop=LoopPolicy(drafting=True)), "LoopPolicy.drafting"),
        (TurnPolicy(loop=LoopPolicy(review_tool_calls=True)), "LoopPolicy.review_tool_calls"),
        # a durable pass cannot yet be cut where a budget's room ends (docs/behaviour.md §2.8)
        (TurnPolicy(loop=LoopPolicy(budget=_BUDGET)), "LoopPolicy.budget is set"),
        (TurnPolicy(budget=_BUDGET), "TurnPolicy.budget is set"),
    ],
    ids=["drafting", "review_tool_calls", "loop-budget", "chain-budget"],
)
async def test_what_a_durable_turn_cannot_carry_is_refused_by_name(
    client: Client, task_queue: str, policy: TurnPolicy, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        await start_generation_turn(
            client,
            task_queue=task_queue,
            attempts=["main"],
            channel="chat",
            request=REQUEST,
            policy=policy,
        )


async def test_a_tool_outcome_that_is_not_json_is_a_failed_call_naming_why(
    client: Client, task_queue: str
) -> None:
    async def clock(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"now": object()})

    script: list[list[ScriptItem]] = [
        [FunctionCall("clock", {}, "c1")],
        [TextDelta("I could not read the clock.")],
    ]
    clock_tool = Tool("clock", "Tells the time.", {"type": "object"}, clock)
    channel = RecordingChannel()
    async with TurnWorker(
        client,
        task_queue,
        providers={"main": scripted(script)},
        tools=[clock_tool],
        channels={"chat": channel},
    ):
        handle = await start_turn(client, task_queue, REQUEST, heartbeat=2.0)
        async with real_time_limit(LIMIT):
            result = await handle.result()
    assert result.status is TurnStatus.COMPLETED
    [round_] = result.history
    assert "cannot be recorded as JSON" in str(converter.unstructure(round_.response))
    assert result.final_text == "I could not read the clock."


async def test_a_custom_exit_rule_is_refused_by_name(client: Client, task_queue: str) -> None:
    policy = TurnPolicy(loop=LoopPolicy(end_after_pre_tool_text=lambda view: True))
    with pytest.raises(ValueError, match=r"LoopPolicy\.end_after_pre_tool_text"):
        await start_generation_turn(
            client,
            task_queue=task_queue,
            attempts=["main"],
            channel="chat",
            request=REQUEST,
            policy=policy,
        )
