"""Approval on a real Temporal dev server (docs/behaviour.md §3.13): a durable turn whose call
needs approval runs the rest of its batch and then waits for the ``decide`` signal, with no
worker running at all; a new worker takes the decisions and the turn ends as the in-process
turn with the same decisions does; decisions that do not match are refused at the client and
nothing is sent; a stop while it waits ends it with the paused result; a predicate is refused
by the worker, by name; the finished history replays without a nondeterminism error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import resume_generation_turn
from toolloop_fsm import run_generation_turn
from toolloop_fsm import snapshot_from_json
from toolloop_fsm.approvals import ApprovalError
from toolloop_fsm.approvals import PendingApproval
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import real_time_limit

pytest.importorskip("temporalio")

from temporalio.client import Client

from tests.temporal.test_batches import replay
from tests.temporal.turns import LOOK_AGAIN
from tests.temporal.turns import POLICY
from tests.temporal.turns import start_turn
from toolloop_fsm.temporal import TurnHandle
from toolloop_fsm.temporal import TurnWorker

LIMIT = 60.0
REQUEST = TurnRequest([{"role": "user", "content": "Pay Bob 50 and tell me the weather."}])
ANY = {"type": "object"}
SCRIPT: list[list[ScriptItem]] = [
    [
        TextDelta("Paying and looking. "),
        FunctionCall("transfer", {"amount": 50, "to": "Bob"}, "t1"),
        FunctionCall("get_weather", {"city": "Oslo"}, "w1"),
    ],
    [TextDelta("Paid, and it is clear in Oslo.")],
]


class Bank:
    """The tools: a transfer that needs approval and a weather lookup, counting their runs."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, dict[str, Any]]] = []

    def tools(self) -> list[Tool]:
        async def transfer(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
            self.runs.append(("transfer", arguments))
            return ToolResult(data={"paid": arguments["amount"]})

        async def weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
            self.runs.append(("get_weather", arguments))
            return ToolResult(data={"sky": "clear"})

        return [
            Tool("transfer", "Send money.", ANY, transfer, needs_approval=True),
            Tool("get_weather", "The weather.", ANY, weather),
        ]


def _worker(client: Client, task_queue: str, bank: Bank, passes: list[list[ScriptItem]]) -> Any:
    provider = ScriptedProvider(passes)
    return TurnWorker(
        client,
        task_queue,
        providers={"main": Attempt(lambda key: provider)},
        tools=bank.tools(),
        channels={"chat": RecordingChannel()},
    )


async def _waiting(turn: TurnHandle) -> tuple[PendingApproval, ...]:
    """The calls the turn waits on, once it waits."""
    while True:
        pending = await turn.pending_approvals()
        if pending:
            return pending
        await asyncio.sleep(LOOK_AGAIN)


async def _in_process(decide: str) -> GenerationTurnResult:
    """The same turn in one process, paused and resumed with the same decision."""
    bank = Bank()
    channel = RecordingChannel()
    paused = await run_generation_turn(
        [Attempt(ScriptedProvider(SCRIPT), label="main")],
        bank.tools(),
        channel,
        REQUEST,
        policy=POLICY,
    )
    assert paused.approval is not None
    [pending] = paused.approval.calls
    decision = pending.approve() if decide == "approve" else pending.deny("Not today.")
    return await resume_generation_turn(
        snapshot_from_json(paused.approval.snapshot),
        [Attempt(ScriptedProvider(SCRIPT[1:]), label="main")],
        bank.tools(),
        channel,
        policy=POLICY,
        decisions=[decision],
    )


@pytest.mark.parametrize("verdict", ["approve", "deny"])
async def test_a_durable_turn_waits_without_a_worker_and_a_new_one_takes_the_decision(
    client: Client, task_queue: str, verdict: str
) -> None:
    bank = Bank()
    async with real_time_limit(LIMIT):
        async with _worker(client, task_queue, bank, SCRIPT):
            turn = await start_turn(client, task_queue, REQUEST)
            [pending] = await _waiting(turn)
        # no worker runs now: the turn waits in the server's history alone
        assert bank.runs == [("get_weather", {"city": "Oslo"})]
        assert (pending.tool, pending.arguments, pending.attempt) == (
            "transfer",
            {"amount": 50, "to": "Bob"},
            1,
        )
        decision = pending.approve() if verdict == "approve" else pending.deny("Not today.")
        await turn.decide([decision])
        async with _worker(client, task_queue, bank, SCRIPT[1:]):
            result = await turn.result()
    expected = await _in_process(verdict)
    assert (result.status, result.reason) == (expected.status, expected.reason)
    assert result.final_text == expected.final_text
    assert [(e.call.name, e.response.success, e.response.status) for e in result.history] == [
        (e.call.name, e.response.success, e.response.status) for e in expected.history
    ]
    ran = [name for name, _ in bank.runs]
    assert ran == (["get_weather", "transfer"] if verdict == "approve" else ["get_weather"])
    await replay(turn)


async def test_decisions_that_do_not_match_are_refused_at_the_client_and_a_stop_ends_the_wait(
    client: Client, task_queue: str
) -> None:
    bank = Bank()
    async with real_time_limit(LIMIT), _worker(client, task_queue, bank, SCRIPT):
        turn = await start_turn(client, task_queue, REQUEST)
        [pending] = await _waiting(turn)
        with pytest.raises(ApprovalError, match="no decision on 'transfer'"):
            await turn.decide([])
        with pytest.raises(ApprovalError, match="is not signed"):
            await turn.decide([pending.approve()], approval_key=b"k")
        assert await turn.pending_approvals() == (pending,)  # still waiting
        await turn.stop()
        result = await turn.result()
    assert result.status is TurnStatus.AWAITING_APPROVAL
    assert result.approval is not None and result.approval.calls == (pending,)
    assert bank.runs == [("get_weather", {"city": "Oslo"})]


def test_a_durable_worker_refuses_a_needs_approval_predicate_by_name(client: Client) -> None:
    async def pay(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult()

    over_100 = Tool("transfer", "Send money.", ANY, pay, needs_approval=lambda a: a["n"] > 100)
    with pytest.raises(ValueError, match="tool 'transfer': a durable turn takes needs_approval"):
        TurnWorker(client, "q", providers={}, tools=[over_100], channels={})
