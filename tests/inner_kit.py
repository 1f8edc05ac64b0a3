"""Shared helpers for the inner-tier tests: a scripted turn on a virtual clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from attrs import define
from attrs import field

from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_tool_loop
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing.reference_model import check_ending
from toolloop_fsm.testing.reference_model import predict_ending
from toolloop_fsm.testing.strategies import TurnScript

USER = [{"role": "user", "content": "what's the weather in Paris?"}]


@define
class Executions:
    """Every tool execution, with the virtual instant it started."""

    calls: list[tuple[str, dict[str, Any], float]] = field(factory=list)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def make_tool(
    name: str,
    executions: Executions,
    clock: VirtualClock,
    behaviour: Callable[[dict[str, Any], ToolContext], Awaitable[ToolResult]] | None = None,
    **options: Any,
) -> Tool:
    async def handler(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        executions.calls.append((name, arguments, clock.now()))
        if behaviour is not None:
            return await behaviour(arguments, ctx)
        return ToolResult(data={"ok": True, "args": arguments}, message=f"{name} done")

    return Tool(name, f"the {name} tool", {"type": "object"}, handler, **options)


async def hang(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def fails(reason: str) -> Callable[[dict[str, Any], ToolContext], Awaitable[ToolResult]]:
    async def behaviour(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(success=False, message=reason)

    return behaviour


def succeeds(**result: Any) -> Callable[[dict[str, Any], ToolContext], Awaitable[ToolResult]]:
    async def behaviour(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(**result)

    return behaviour


@define
class Turn:
    clock: VirtualClock
    provider: ScriptedProvider
    channel: RecordingChannel
    signals: TurnSignals
    executions: Executions
    result: GenerationTurnResult | None = None

    @property
    def statuses(self) -> list[str]:
        return [step.next_state for step in self.result.trace] if self.result else []


def scripted_turn(
    passes: Sequence[Sequence[ScriptItem]],
    *,
    delivery_delay: float = 0.0,
    continuation_style: bool = False,
) -> Turn:
    clock = VirtualClock()
    return Turn(
        clock=clock,
        provider=ScriptedProvider(passes, clock=clock, continuation_style=continuation_style),
        channel=RecordingChannel(clock=clock, delivery_delay=delivery_delay),
        signals=TurnSignals(),
        executions=Executions(),
    )


async def run_turn(
    turn: Turn,
    tools: Sequence[Tool],
    *,
    policy: LoopPolicy | None = None,
    request: TurnRequest | None = None,
    at: Sequence[tuple[float, Callable[[TurnSignals], None]]] = (),
) -> GenerationTurnResult:
    """Run the turn; ``at`` schedules host signals at virtual instants."""
    for when, act in at:
        turn.clock.call_later(when, lambda act=act: act(turn.signals))
    turn.result = await run_tool_loop(
        turn.provider,
        tools,
        turn.channel,
        request if request is not None else TurnRequest(USER),
        policy=policy,
        signals=turn.signals,
        clock=turn.clock,
    )
    return turn.result


async def engine_and_model_end_alike(
    script: TurnScript, policy: LoopPolicy, expected: tuple[TurnStatus, str | None]
) -> None:
    """Run ``script`` under ``policy``: the engine keeps every invariant and ends as
    ``expected``, and the reference model, asked about the script alone, predicts the same."""
    run = await run_script(script, policy)
    run.check()  # the invariants, and the model's ending (invariant 10)
    check_ending(run)
    assert (run.result.status, run.result.reason) == expected
    predicted = predict_ending(script, policy, tools=run.tools)
    assert (predicted.status, predicted.reason) == expected
