"""The random-instant stop campaign: 1,000 turns over real loopback HTTP, each stopped at a
seeded random instant, none may lose a delivery its channel confirmed or fail to return.

Each turn streams a Chat Completions answer of 24 text frames from the loopback
`WireServer` through `OpenAICompatibleProvider`; a pacing transport hands the body on one
SSE event at a time, a few real milliseconds apart, so a stop can land before the first
token, between any two frames, while a delivery is in flight, or after the end. The channel
confirms each delivery (and queues the stop message) after a small real delay, and records
a delivery only once its send returned. Turns run 100 at a time on one loop; every wait is
bounded (each turn by `asyncio.timeout`). The instants, delays and stop messages come from
one seeded `random.Random`, so the campaign is the same on every run (the interleavings
the real network makes of it may differ; the assertions hold for all of them).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from collections.abc import Callable

import httpx
import pytest
from attrs import frozen

from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import Notice

pytestmark = pytest.mark.slow

TURNS = 1_000
BATCH = 100
SEED = 20_240_229
FRAMES = 24
#: Real seconds one turn may take before it counts as hung (a turn takes ~0.1 s).
TURN_GUARD = 10.0
QUESTION = TurnRequest([{"role": "user", "content": "Count to twenty-four, slowly."}])
POLICY = LoopPolicy(
    first_token_timeout=5,
    inactivity_timeout=5,
    host_call_timeout=5,
    cancel_grace=1,
    delivery_flush_chars=1,
)


def _frame(delta: dict[str, object], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-campaign",
        "object": "chat.completion.chunk",
        "model": "campaign-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


STREAM = (
    _frame({"role": "assistant", "content": ""}),
    *(_frame({"content": f"{n} "}) for n in range(1, FRAMES + 1)),
    _frame({}, "stop"),
    b"data: [DONE]\n\n",
)


@frozen
class TurnPlan:
    """One turn of the campaign: when the stop comes, with which message, and the pace of
    the stream and of the channel (real seconds).

    The stop comes ``stop_delay`` seconds after the body's ``stop_after``-th SSE event was
    handed to the client (counting from 1, so that the instants spread over the whole
    stream however loaded the machine is); ``stop_after=0`` stops the turn as it starts,
    before any answer.
    """

    stop_after: int
    stop_delay: float
    stop_message: str | None
    frame_gaps: tuple[float, ...]
    confirm_delays: tuple[float, ...]


def campaign(rng: random.Random) -> list[TurnPlan]:
    plans = []
    for _ in range(TURNS):
        gaps = tuple(rng.uniform(0.001, 0.006) for _ in range(len(STREAM)))
        plans.append(
            TurnPlan(
                stop_after=rng.randint(0, len(STREAM)),
                # up to a gap and a half: some stops land while a delivery is in flight
                stop_delay=rng.uniform(0.0, 0.009),
                stop_message=rng.choice((None, None, "Stopped, as you asked.")),
                frame_gaps=gaps,
                confirm_delays=tuple(rng.uniform(0.0, 0.004) for _ in range(FRAMES + 2)),
            )
        )
    return plans


class _PacedBody(httpx.AsyncByteStream):
    """A response body handed on one SSE event at a time, each after its gap; ``handed``
    is told the count of events handed on so far."""

    def __init__(
        self,
        inner: httpx.AsyncByteStream,
        gaps: tuple[float, ...],
        handed: Callable[[int], None],
    ) -> None:
        self._inner = inner
        self._gaps = gaps
        self._handed = handed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        count = 0
        async for received in self._inner:
            for event in received.split(b"\n\n"):
                if not event:
                    continue
                await asyncio.sleep(self._gaps[count % len(self._gaps)])
                count += 1
                self._handed(count)
                yield event + b"\n\n"

    async def aclose(self) -> None:
        await self._inner.aclose()


class PacedTransport(httpx.AsyncBaseTransport):
    """Real loopback HTTP; each response's body is paced by the gaps of the turn that asked
    (named in the request's ``x-campaign-turn`` header), and that turn's watcher in
    ``watchers`` is told of each event handed on."""

    def __init__(self, plans: list[TurnPlan]) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=BATCH))
        self._plans = plans
        self.watchers: dict[int, Callable[[int], None]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        turn = int(request.headers["x-campaign-turn"])
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_PacedBody(
                response.stream,
                self._plans[turn].frame_gaps,
                self.watchers.get(turn, lambda _count: None),
            ),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class ConfirmingChannel:
    """A channel that takes a few real milliseconds to confirm each delivery and to queue a
    stop message; a delivery is recorded once its send has returned."""

    def __init__(self, delays: tuple[float, ...]) -> None:
        self._delays = delays
        self._calls = 0
        self.confirmed: list[str] = []
        self.notices: list[Notice] = []
        self.queued_front: list[str] = []

    async def _take_a_moment(self) -> None:
        delay = self._delays[self._calls % len(self._delays)]
        self._calls += 1
        await asyncio.sleep(delay)

    async def send_text(self, text: str) -> None:
        await self._take_a_moment()
        self.confirmed.append(text)

    async def send_expression(self, expression: str) -> None:
        await self._take_a_moment()
        self.confirmed.append(expression)

    async def send_notice(self, notice: Notice) -> None:
        self.notices.append(notice)

    async def queue_front(self, stop_message: str) -> None:
        await self._take_a_moment()
        self.queued_front.append(stop_message)


@frozen
class Outcome:
    turn: int
    hung: bool
    confirmed: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def _texts(delivered: tuple[Delivered, ...]) -> tuple[str, ...]:
    return tuple(d.text if d.text is not None else (d.expression or "") for d in delivered)


async def run_one(
    index: int, plan: TurnPlan, client: httpx.AsyncClient, transport: PacedTransport, url: str
) -> Outcome:
    provider = OpenAICompatibleProvider(
        url + "/v1",
        "campaign-model",
        api_key="sk-campaign",
        client=client,
        headers={"x-campaign-turn": str(index)},
    )
    channel = ConfirmingChannel(plan.confirm_delays)
    signals = TurnSignals()
    loop = asyncio.get_running_loop()
    timers: list[asyncio.Handle] = []

    def stop() -> None:
        signals.request_stop(plan.stop_message)

    if plan.stop_after == 0:
        timers.append(loop.call_soon(stop))
    else:

        def handed(count: int) -> None:
            if count == plan.stop_after:
                timers.append(loop.call_later(plan.stop_delay, stop))

        transport.watchers[index] = handed
    try:
        async with asyncio.timeout(TURN_GUARD):
            result = await run_tool_loop(
                provider,
                [],
                channel,
                QUESTION,
                policy=POLICY,
                signals=signals,
                clock=LoopClock(),
            )
    except TimeoutError:
        return Outcome(index, hung=True)
    finally:
        transport.watchers.pop(index, None)
        for timer in timers:
            timer.cancel()
    # snapshot what the channel had confirmed when the turn returned
    return Outcome(index, False, tuple(channel.confirmed), _texts(result.delivered))


async def test_a_thousand_stops_at_random_instants_lose_no_confirmed_delivery_and_hang_nothing() -> (  # noqa: E501
    None
):
    plans = campaign(random.Random(SEED))
    server = WireServer()
    await server.start()
    server.serve(Scripted(chunks=STREAM))
    transport = PacedTransport(plans)
    outcomes: list[Outcome] = []
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            for start in range(0, TURNS, BATCH):
                batch = range(start, min(start + BATCH, TURNS))
                outcomes += await asyncio.gather(
                    *(run_one(i, plans[i], client, transport, server.url) for i in batch)
                )
    finally:
        await server.close()

    hung = [o.turn for o in outcomes if o.hung]
    lost = [o for o in outcomes if not o.hung and o.confirmed != o.kept]
    assert len(outcomes) == TURNS
    assert hung == [], f"{len(hung)} turns did not return within {TURN_GUARD:g} s: {hung[:10]}"
    assert lost == [], (
        f"{len(lost)} turns lost a confirmed delivery (or claimed an unconfirmed one); first: "
        f"turn {lost[0].turn} confirmed {lost[0].confirmed} but kept {lost[0].kept}"
    )
    # the campaign reached every phase: stopped before any text, mid-stream, and not at all
    assert any(not o.confirmed for o in outcomes)
    assert any(0 < len(o.confirmed) < FRAMES for o in outcomes)
    assert any(len(o.confirmed) == FRAMES for o in outcomes)
