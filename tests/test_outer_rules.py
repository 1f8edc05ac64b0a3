"""The outer tier's exact rules, each pinned where a one-token slip would change what a user
or host sees: which failure rotates a key and which moves on to the next model, what text a
reply that continued a failed attempt ends with, who consumes a stop, and which events the
machine refuses. Time is virtual (`VirtualClock`)."""

from __future__ import annotations

import asyncio

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import make_tool
from tests.test_outer_cases import SECRET_KEYS
from tests.test_outer_cases import KeyedProviders
from tests.test_outer_cases import generate
from tests.test_outer_cases import server_error
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Provider
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.pump import RedactedError
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.sansio import InvalidEvent
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock


# --------------------------------------------------------------------------- rotation and fallback
async def test_a_model_the_provider_cannot_find_moves_on_without_trying_its_other_keys() -> None:
    clock = VirtualClock()
    missing = ProviderError("404 no such model", kind="not_found", retryable=False, status_code=404)
    keyed = KeyedProviders(clock, {key: [[Fail(missing)]] for key in SECRET_KEYS})
    backup = ScriptedProvider([[TextDelta("fine")]], clock=clock)
    result, _ = await generate(
        [Attempt(keyed, keys=SECRET_KEYS, label="main"), Attempt(backup, label="b")], clock
    )
    assert keyed.used == [SECRET_KEYS[0]]
    assert result.final_text == "fine"


async def test_a_fallback_reply_that_used_a_tool_ends_with_its_own_last_text() -> None:
    clock = VirtualClock()
    executions = Executions()
    first = ScriptedProvider([[TextDelta("Let me "), Fail(server_error())]], clock=clock)
    second = ScriptedProvider(
        [[FunctionCall("get_weather", {"city": "Paris"})], [TextDelta("Sunny in Paris.")]],
        clock=clock,
    )
    result, channel = await generate(
        [Attempt(first, label="primary"), Attempt(second, label="backup")],
        clock,
        tools=[make_tool("get_weather", executions, clock)],
    )
    assert result.status is TurnStatus.COMPLETED
    assert channel.delivered_text == "Let me Sunny in Paris."
    # the backup's reply came after a tool round: it does not continue the carried words
    assert result.final_text == "Sunny in Paris."


async def test_a_host_failure_ends_the_turn_even_when_the_model_has_another_key() -> None:
    clock = VirtualClock()
    keyed = KeyedProviders(
        clock,
        {SECRET_KEYS[0]: [[TextDelta("Hello")]], SECRET_KEYS[1]: [[TextDelta("Hello")]]},
    )
    channel = RecordingChannel(clock=clock, fail_when=lambda text, _expression: text is not None)
    result, _ = await generate(
        [Attempt(keyed, keys=SECRET_KEYS[:2], label="main")], clock, channel=channel
    )
    assert result.status is TurnStatus.ERROR
    assert result.reason == "host_error"
    assert keyed.used == [SECRET_KEYS[0]]  # the host's own code failed: no key can help


# --------------------------------------------------------------------------- stops
async def test_a_stop_during_a_completed_replys_settle_window_is_consumed_by_the_turn() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    provider = ScriptedProvider([[TextDelta("Hello")]], clock=clock)
    channel = RecordingChannel(clock=clock, delivery_delay=12)  # still in flight at the end
    clock.call_later(5, signals.request_stop)
    result, _ = await generate(
        [Attempt(provider)],
        clock,
        channel=channel,
        signals=signals,
        turn_policy=TurnPolicy(loop=LoopPolicy(delivery_flush_chars=1, inactivity_timeout=30)),
    )
    assert result.status is TurnStatus.COMPLETED  # it had already ended that way
    assert clock.now() == pytest.approx(5)  # the stop cut the settle window short
    assert not signals.stop_requested  # and was honoured: the next turn is not stopped


# --------------------------------------------------------------------------- refused events
def _single_attempt_machine() -> GenerationTurnMachine:
    machine = GenerationTurnMachine(plans=[AttemptPlan("m0")])
    machine.start(TurnRequest(USER))
    return machine


def test_starting_a_generation_turn_twice_is_refused() -> None:
    machine = _single_attempt_machine()
    with pytest.raises(InvalidEvent, match="already started"):
        machine.start(TurnRequest(USER))
    assert machine.state == "attempting"
    assert machine.generation.attempts == 1


def test_the_outcome_of_an_attempt_that_is_not_running_is_refused() -> None:
    machine = _single_attempt_machine()
    stale = AttemptFinished(7, GenerationTurnResult(status=TurnStatus.COMPLETED), {}, 1.0)
    with pytest.raises(InvalidEvent, match="attempt 7 is not the running one"):
        machine.feed(stale)
    assert machine.state == "attempting"
    assert machine.generation.results == []


# --------------------------------------------------------------------------- keys never leak
class _ClientRefused(Exception):
    """A client library's error: a plain message, but its repr shows the key it was given."""

    def __init__(self, key: str | None) -> None:
        super().__init__("the client refused the configuration")
        self.key = key

    def __repr__(self) -> str:
        return f"_ClientRefused(key={self.key!r})"


async def test_a_host_exception_whose_repr_quotes_a_key_is_replaced() -> None:
    def factory(key: str | None) -> Provider:
        raise _ClientRefused(key)

    clock = VirtualClock()
    result, _ = await generate([Attempt(factory, keys=SECRET_KEYS[:1], label="main")], clock)
    assert result.reason == "host_error"
    assert isinstance(result.exception, RedactedError)
    assert SECRET_KEYS[0] not in f"{result.exception!s}{result.exception!r}"
    assert "the client refused the configuration" in str(result.exception)


# the final result reuses the attempts' texts, already searched for keys, and adds its own: a
# text the final result makes by joining two clean ones, or one the host gave, is searched too
_LONG_KEY = "sk-live-Q7mZ2xLp9VtR4wKc"


async def test_a_key_joined_from_two_attempts_texts_is_redacted_in_the_final_text() -> None:
    clock = VirtualClock()
    # each attempt's own text holds 7 characters of the key, under the 8 that count; the
    # reply continued across the failure holds 14
    keyed = KeyedProviders(
        clock,
        {
            _LONG_KEY: [[TextDelta(f"the code is {_LONG_KEY[:7]}"), Fail(server_error())]],
        },
    )
    backup = ScriptedProvider([[TextDelta(f"{_LONG_KEY[7:14]} and that is all")]], clock=clock)
    result, _ = await generate(
        [Attempt(keyed, keys=(_LONG_KEY,), label="main"), Attempt(backup, label="b")], clock
    )
    assert result.status is TurnStatus.COMPLETED
    assert _LONG_KEY[:8] not in result.final_text
    assert "[REDACTED]" in result.final_text
    assert result.final_text.endswith(" and that is all")


async def test_a_stop_message_quoting_a_key_is_redacted_in_the_final_result() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    keyed = KeyedProviders(clock, {_LONG_KEY: [[TextDelta("Hello"), Pause(5.0), TextDelta("!")]]})

    async def stop_soon() -> None:
        await clock.sleep(1.0)
        signals.request_stop(f"stopped by the admin of {_LONG_KEY}")

    stopper = asyncio.ensure_future(stop_soon())
    result, _ = await generate(
        [Attempt(keyed, keys=(_LONG_KEY,), label="main")], clock, signals=signals
    )
    await stopper
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.stop_message is not None
    assert _LONG_KEY[:8] not in result.stop_message
    assert "[REDACTED]" in result.stop_message
