"""A pass that ends early gives its HTTP connection back to a shared client's pool
(`docs/behaviour.md` §10.5).

Issue #21 item 4: with one shared ``httpx.AsyncClient``, turns stopped while other turns held
every connection left connections checked out for good, and once the pool was full every
later turn on that client ended ``first_token_timeout``. The campaign here runs, for every
adapter, more turns than the pool has connections against a real loopback server that
streams one text event and then stalls (or, for the cut turns, drops the connection). Once
the stalled turns hold every connection (each has delivered its text), every turn still
waiting is ended at the same instant, each its own way — a stop, a follow-up, its deadline
(the turns' `VirtualClock` is moved past it), or the cancellation of its caller — while the
cut turns end on their own. Afterwards a further turn on the same client completes, and the
pool holds no checked-out connection.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.providers.replay import FINISHED_PASS
from tests.providers.replay import NDJSON
from tests.providers.replay import SSE
from tests.providers.replay import _sse
from tests.providers.replay import adapter
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_tool_loop
from toolloop_fsm.provider import Provider
from toolloop_fsm.providers import OpenAICompletionsProvider
from toolloop_fsm.providers import VerbatimToolCalls
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import VirtualClock

SEED = 21_04
KEY = "sk-pool-0123456789abcdef"
QUESTION = TurnRequest([{"role": "user", "content": "Say something, slowly."}])
CONNECTIONS = 4
#: Turns per way of ending; with five ways, many more turns than connections.
TURNS_PER_ENDING = 4
ENDINGS = ("stop", "follow_up", "deadline", "cancel", "cut")
#: The turns' deadlines, on the virtual clock: they pass only when the campaign moves it.
POLICY = LoopPolicy(
    first_token_timeout=30,
    inactivity_timeout=30,
    host_call_timeout=5,
    cancel_grace=1,
    delivery_flush_chars=1,
)

# One text event ("ok") in each adapter's framing: what a stalled or cut stream sends first.
_FIRST_EVENT: dict[str, tuple[tuple[tuple[str, str], ...], bytes]] = {
    "openai-chat": (SSE, _sse((None, {"choices": [{"index": 0, "delta": {"content": "ok"}}]}))),
    "openai-completions": (SSE, _sse((None, {"choices": [{"index": 0, "text": "ok"}]}))),
    "openai-responses": (
        SSE,
        _sse(("response.output_text.delta", {"type": "response.output_text.delta", "delta": "ok"})),
    ),
    "anthropic": (
        SSE,
        _sse(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "ok"},
                },
            )
        ),
    ),
    "gemini": (
        SSE,
        _sse((None, {"candidates": [{"index": 0, "content": {"parts": [{"text": "ok"}]}}]})),
    ),
    "ollama": (NDJSON, b'{"message": {"role": "assistant", "content": "ok"}, "done": false}\n'),
}
KINDS = (*_FIRST_EVENT, "verbatim")


def _wire_kind(kind: str) -> str:
    """The wire format ``kind`` speaks: `VerbatimToolCalls` wraps the chat adapter."""
    return "openai-chat" if kind == "verbatim" else kind


def _provider(kind: str, url: str, client: httpx.AsyncClient) -> Provider:
    if kind == "openai-completions":
        return OpenAICompletionsProvider(f"{url}/v1", "gpt-x", api_key=KEY, client=client)
    if kind == "verbatim":
        return VerbatimToolCalls(adapter("openai-chat", url, KEY, client))
    return adapter(kind, url, KEY, client)


def checked_out(transport: httpx.AsyncHTTPTransport) -> list[str]:
    """The pool's connections that are not idle, as httpcore describes them. (httpx exposes
    no pool state; the transport's httpcore pool and its connections' ``is_idle`` are
    httpcore's public interface.)"""
    pool = transport._pool
    return [repr(connection) for connection in pool.connections if not connection.is_idle()]


class _Trigger:
    """Calls ``fire`` once ``needed`` stalled turns have delivered their text: then every
    connection is held by a stalled turn and the other turns wait for one."""

    def __init__(self, needed: int, fire: Callable[[], None]) -> None:
        self._needed = needed
        self._fire = fire
        self.fired = False

    def delivered(self) -> None:
        self._needed -= 1
        if self._needed == 0 and not self.fired:
            self.fired = True
            self._fire()


class _SignallingChannel(RecordingChannel):
    def __init__(self, trigger: _Trigger | None) -> None:
        super().__init__()
        self._trigger = trigger
        self._told = False

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        await super().send_text(text, idempotency_key=idempotency_key)
        if self._trigger is not None and not self._told:
            self._told = True
            self._trigger.delivered()


@pytest.mark.parametrize("kind", KINDS)
async def test_turns_ended_every_way_under_pool_contention_give_every_connection_back(
    kind: str,
) -> None:
    headers, first = _FIRST_EVENT[_wire_kind(kind)]
    stalling, cutting = WireServer(), WireServer()
    await stalling.start()
    await cutting.start()
    stalling.serve(Scripted(headers=headers, chunks=(first,), stall_after=1))
    cutting.serve(Scripted(headers=headers, chunks=(first,), drop_after=1))
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=CONNECTIONS))
    plans = [ending for ending in ENDINGS for _ in range(TURNS_PER_ENDING)]
    clocks = [VirtualClock() for _ in plans]
    signals = [TurnSignals() for _ in plans]
    tasks: list[asyncio.Task[GenerationTurnResult]] = []

    def end(index: int) -> None:
        ending, signal, task = plans[index], signals[index], tasks[index]
        if ending == "stop":
            signal.request_stop()
        elif ending == "follow_up":
            signal.follow_up()
        elif ending == "cancel":
            task.cancel()
        elif ending == "deadline":
            clocks[index].advance(POLICY.inactivity_timeout + 1)

    def end_the_turns() -> None:
        # one turn each pass of the event loop, in a seeded order: the ends land at every
        # point of the others' closing and of the pool handing their connections on
        order = [i for i, ending in enumerate(plans) if ending != "cut"]
        random.Random(SEED).shuffle(order)
        loop = asyncio.get_running_loop()

        def next_end(position: int) -> None:
            if position < len(order):
                end(order[position])
                loop.call_soon(next_end, position + 1)

        next_end(0)

    # every turn but the cut ones stalls: the trigger needs as many of them as connections
    trigger = _Trigger(CONNECTIONS, end_the_turns)
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            for ending, signal, clock in zip(plans, signals, clocks, strict=True):
                url = cutting.url if ending == "cut" else stalling.url
                channel = _SignallingChannel(None if ending == "cut" else trigger)
                run = run_tool_loop(
                    _provider(kind, url, client),
                    [],
                    channel,
                    QUESTION,
                    policy=POLICY,
                    signals=signal,
                    clock=clock,
                )
                tasks.append(asyncio.ensure_future(run))
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert trigger.fired
            statuses = _statuses(plans, outcomes)
            assert statuses["cancel"] == {"cancelled"}
            assert statuses["stop"] == {TurnStatus.STOPPED_BY_USER.value}

            stalling.serve(FINISHED_PASS[_wire_kind(kind)])
            after = await run_tool_loop(
                _provider(kind, stalling.url, client),
                [],
                RecordingChannel(),
                QUESTION,
                policy=POLICY,
                clock=VirtualClock(),
            )
            assert after.reason != "first_token_timeout"
            assert after.status is TurnStatus.COMPLETED, (after.status, after.reason)
            assert checked_out(transport) == []
    finally:
        await stalling.close()
        await cutting.close()


def _statuses(plans: list[str], outcomes: list[Any]) -> dict[str, set[str]]:
    by_ending: dict[str, set[str]] = {}
    for ending, outcome in zip(plans, outcomes, strict=True):
        if isinstance(outcome, asyncio.CancelledError):
            status = "cancelled"
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            status = outcome.status.value
        by_ending.setdefault(ending, set()).add(status)
    return by_ending
