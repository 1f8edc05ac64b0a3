"""Every delivery carries a stable idempotency key (the turn's id, the attempt and the
delivery's sequence), so a channel can drop a delivery it already made when a turn is resumed
after a crash; a channel that takes no key is called as before."""

from __future__ import annotations

from typing import Any

from tests.inner_kit import USER
from toolloop_fsm import Attempt
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.events import TextDelta
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.result import Notice
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

SMALL_FLUSH = LoopPolicy(delivery_flush_chars=5)


class KeyLog:
    """A channel that notes the key of every delivery."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        self.keys.append(idempotency_key)

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        self.keys.append(idempotency_key)

    async def send_notice(self, notice: Notice) -> None:
        return None

    async def queue_front(self, stop_message: str) -> None:
        return None


class Keyless:
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def send_text(self, text: str) -> None:
        self.texts.append(text)

    async def send_expression(self, expression: str) -> None:
        self.texts.append(expression)

    async def send_notice(self, notice: Notice) -> None:
        return None

    async def queue_front(self, stop_message: str) -> None:
        return None


async def test_each_delivery_carries_the_turn_id_the_attempt_and_its_sequence() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello "), TextDelta("there!")]], clock=clock)
    channel = KeyLog()
    request = TurnRequest(USER, turn_id="turn-42")
    result = await run_tool_loop(provider, [], channel, request, policy=SMALL_FLUSH, clock=clock)
    assert channel.keys == ["turn-42:1:0", "turn-42:1:1"]
    assert result.turn_id == "turn-42"


async def test_a_turn_without_an_id_is_given_a_fresh_one_used_for_every_key() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello "), TextDelta("there!")]], clock=clock)
    channel = KeyLog()
    result = await run_tool_loop(
        provider, [], channel, TurnRequest(USER), policy=SMALL_FLUSH, clock=clock
    )
    assert result.turn_id is not None and len(result.turn_id) == 32
    assert channel.keys == [f"{result.turn_id}:1:0", f"{result.turn_id}:1:1"]


async def test_a_turn_given_a_fresh_id_keeps_everything_else_its_request_asked() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
    request = TurnRequest(
        USER, tools_allowed=[], prefill="Sure", thought_log_owner="reader", max_output=50
    )
    result = await run_tool_loop(provider, [], Keyless(), request, clock=clock)
    assert result.turn_id is not None and len(result.turn_id) == 32
    assert result.thought_log_owner == "reader"
    sent = provider.requests[0]
    assert (tuple(sent.context), sent.prefill, sent.max_output) == (tuple(USER), "Sure", 50)
    assert request.turn_id is None  # the host's request is left as it was


async def test_keys_of_a_generation_turn_name_the_attempt_that_delivered() -> None:
    clock = VirtualClock()
    failing = ScriptedProvider(
        [[TextDelta("Part one. "), Fail(ProviderError("down", kind="server", retryable=True))]],
        clock=clock,
    )
    answering = ScriptedProvider([[TextDelta("Part two.")]], clock=clock)
    channel = KeyLog()
    await run_generation_turn(
        [Attempt(failing, label="a"), Attempt(answering, label="b")],
        [],
        channel,
        TurnRequest(USER, turn_id="t"),
        policy=TurnPolicy(loop=LoopPolicy(delivery_flush_chars=5)),
        clock=clock,
    )
    assert channel.keys == ["t:1:0", "t:2:0"]


async def test_the_recording_channel_drops_a_delivery_whose_key_it_already_accepted() -> None:
    channel = RecordingChannel()
    await channel.send_text("Hello", idempotency_key="t:1:0")
    await channel.send_text("Hello", idempotency_key="t:1:0")
    await channel.send_text("again", idempotency_key="t:1:1")
    assert channel.texts == ["Hello", "again"]
    assert channel.duplicates_dropped == 1


async def test_a_channel_that_takes_no_key_is_called_without_one() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hi.")]], clock=clock)
    channel = Keyless()
    result = await run_tool_loop(provider, [], channel, TurnRequest(USER), clock=clock)
    assert channel.texts == ["Hi."]
    assert result.final_text == "Hi."


async def test_a_send_method_patched_onto_one_channel_is_read_for_that_channel() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hi.")]], clock=clock)
    channel = RecordingChannel()
    seen: list[Any] = []

    async def plain(text: str) -> None:
        seen.append(text)

    channel.send_text = plain  # type: ignore[method-assign, assignment]
    await run_tool_loop(provider, [], channel, TurnRequest(USER), clock=clock)
    assert seen == ["Hi."]
