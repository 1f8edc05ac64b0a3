"""The library's log records, as a host's logging configuration sees them: one DEBUG record per
transition on ``toolloop_fsm.machine``, WARNING records on ``toolloop_fsm.turn`` for what
failed (with the provider's HTTP status and wait hint), and never an API key in any of them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Provider
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.testing import EchoKey
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import HostileProvider
from toolloop_fsm.testing import KeyEcho
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import leaked_runs

REQUEST = TurnRequest([{"role": "user", "content": "hello"}])
KEYS = ("sk-live-0123456789abcdefSECRET", "sk-live-fedcba9876543210SECRET")


def rate_limited(retry_after: float | None = 30.0) -> ProviderError:
    return ProviderError(
        "429 too many requests",
        kind="rate_limit",
        retryable=True,
        status_code=429,
        retry_after=retry_after,
    )


def records_of(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == logger]


# --------------------------------------------------------------------------- transitions
async def test_every_transition_is_a_debug_record_naming_state_event_next_state_and_guard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello there.")]], clock=clock)
    with caplog.at_level(logging.DEBUG, logger="toolloop_fsm"):
        result = await run_tool_loop(
            provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock
        )
    records = records_of(caplog, "toolloop_fsm.machine")
    assert [r.levelno for r in records] == [logging.DEBUG] * len(result.trace)
    fields = [
        (r.machine, r.state, r.event, r.next_state, r.guard)  # type: ignore[attr-defined]
        for r in records
    ]
    assert fields == [
        ("ToolLoopMachine", s.state, s.event, s.next_state, s.guard) for s in result.trace
    ]
    messages = [r.getMessage() for r in records]
    assert "ToolLoopMachine: ready --start--> starting_pass" in messages
    assert (
        "ToolLoopMachine: ending_pass --advance--> building_result [guard pass_has_text]"
        in messages
    )


async def test_a_generation_turn_logs_both_machines_and_names_each_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    first = ScriptedProvider([[Fail(rate_limited())]], clock=clock)
    second = ScriptedProvider([[TextDelta("fine")]], clock=clock)
    with caplog.at_level(logging.DEBUG, logger="toolloop_fsm"):
        result = await run_generation_turn(
            [Attempt(first, label="main"), Attempt(second, label="backup")],
            [],
            RecordingChannel(clock=clock),
            REQUEST,
            clock=clock,
        )
    assert result.status is TurnStatus.COMPLETED
    records = records_of(caplog, "toolloop_fsm.machine")
    outer = [r for r in records if r.machine == "GenerationTurnMachine"]  # type: ignore[attr-defined]
    # every transition; the trace's notes (an attempt superseded) are not transitions
    assert len(outer) == len([s for s in result.trace if s.event != "attempt_superseded"])
    inner_attempts = {r.attempt for r in records if r.machine == "ToolLoopMachine"}  # type: ignore[attr-defined]
    assert inner_attempts == {1, 2}
    assert any(
        r.getMessage().startswith("ToolLoopMachine (attempt 2): ready --start-->") for r in records
    )


async def test_no_transition_is_logged_when_the_library_logs_above_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
    with caplog.at_level(logging.INFO, logger="toolloop_fsm"):
        await run_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    assert caplog.records == []


# --------------------------------------------------------------------------- failures
async def test_a_429_is_a_warning_with_its_status_and_retry_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("par"), Fail(rate_limited(30))]], clock=clock)
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_tool_loop(
            provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock
        )
    assert result.status is TurnStatus.ERROR
    [record] = records_of(caplog, "toolloop_fsm.turn")
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "provider scripted pass 1 failed (rate_limit, HTTP 429, retry after 30 s, retryable): "
        "429 too many requests"
    )
    assert (record.failure, record.status_code, record.retry_after) == (  # type: ignore[attr-defined]
        "provider",
        429,
        30.0,
    )


async def test_a_fallback_after_a_429_names_the_status_the_wait_and_the_next_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    keyed: dict[str, Provider] = {
        KEYS[0]: ScriptedProvider([[Fail(rate_limited(12))]], clock=clock),
        KEYS[1]: ScriptedProvider([[TextDelta("fine")]], clock=clock),
    }
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_generation_turn(
            [Attempt(lambda key: keyed[key or ""], keys=KEYS, label="main")],
            [],
            RecordingChannel(clock=clock),
            REQUEST,
            clock=clock,
        )
    assert result.status is TurnStatus.COMPLETED
    attempt = [r for r in records_of(caplog, "toolloop_fsm.turn") if r.failure == "attempt"]  # type: ignore[attr-defined]
    [record] = attempt
    assert record.getMessage() == (
        "attempt 1 (main, key 0) failed error (provider_error, rate_limit, HTTP 429, "
        "retry after 12 s): 429 too many requests; next: attempt 2 (main, key 1)"
    )
    assert (record.status_code, record.retry_after, record.key_index) == (429, 12.0, 0)  # type: ignore[attr-defined]


async def test_a_stream_that_never_starts_is_a_warning_naming_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[Pause(50), TextDelta("late")]], clock=clock)
    policy = LoopPolicy(first_token_timeout=10, inactivity_timeout=5)
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_tool_loop(
            provider, [], RecordingChannel(clock=clock), REQUEST, policy=policy, clock=clock
        )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "first_token_timeout")
    [record] = records_of(caplog, "toolloop_fsm.turn")
    assert record.getMessage() == ("provider scripted pass 1 timed out: no first chunk within 10 s")
    assert record.deadline == "first_token"  # type: ignore[attr-defined]


async def test_a_tool_past_its_deadline_is_a_warning_naming_the_tool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()

    async def slow(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await clock.sleep(100)
        return ToolResult(data="late")

    tool = Tool("lookup", "look up", {"type": "object"}, slow, timeout=7)
    provider = ScriptedProvider(
        [[FunctionCall("lookup", {}, "c1")], [TextDelta("sorry")]], clock=clock
    )
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        await run_tool_loop(provider, [tool], RecordingChannel(clock=clock), REQUEST, clock=clock)
    [record] = records_of(caplog, "toolloop_fsm.turn")
    assert record.getMessage() == (
        "tool lookup (dispatch 1) did not finish within 7 s; it was cancelled"
    )
    assert record.failure == "tool"  # type: ignore[attr-defined]


async def test_a_channel_that_raises_is_a_warning_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
    channel = RecordingChannel(clock=clock, fail_when=lambda text, _expression: True)
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_tool_loop(provider, [], channel, REQUEST, clock=clock)
    assert (result.status, result.reason) == (TurnStatus.ERROR, "host_error")
    [record] = records_of(caplog, "toolloop_fsm.turn")
    assert record.getMessage() == (
        "the host's channel failed on a delivery: ConnectionError: the channel refused the message"
    )
    assert record.failure == "host"  # type: ignore[attr-defined]


async def test_records_carry_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    clock = VirtualClock()

    class Broken:
        name = "broken"

        async def stream(self, _request: object) -> Any:
            raise RuntimeError("the client is closed")
            yield  # an async generator that fails as it is read

    with caplog.at_level(logging.DEBUG, logger="toolloop_fsm"):
        await run_tool_loop(Broken(), [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    assert caplog.records, "the failure was logged"
    assert all(r.exc_info is None and r.exc_text is None for r in caplog.records)


# --------------------------------------------------------------------------- secrecy
@pytest.mark.parametrize("echo", list(KeyEcho))
async def test_no_key_in_any_record_when_the_provider_echoes_it(
    echo: KeyEcho, caplog: pytest.LogCaptureFixture
) -> None:
    clock = VirtualClock()

    def provider_for(key: str | None) -> Provider:
        return HostileProvider([[TextDelta("par"), EchoKey(echo)]], clock=clock, api_key=key)

    with caplog.at_level(logging.DEBUG, logger="toolloop_fsm"):
        result = await run_generation_turn(
            [Attempt(provider_for, keys=KEYS, label="leaky")],
            [],
            RecordingChannel(clock=clock),
            REQUEST,
            clock=clock,
            policy=TurnPolicy(max_key_attempts_per_model=2),
        )
    assert result.status is TurnStatus.ERROR
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # each key: its pass, then its attempt
    text = "\n".join(
        f"{r.getMessage()} {sorted(vars(r).items(), key=lambda item: item[0])}"
        for r in caplog.records
    )
    assert leaked_runs(KEYS, {"the log records": text}) == []
    if echo is not KeyEcho.PREFIX:  # a 12-character prefix is masked by the adapters' rule
        assert "[REDACTED]" in text


async def test_a_failing_observer_is_a_warning_and_the_turn_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from toolloop_fsm.observation import PassStarted
    from toolloop_fsm.observation import TurnObserver

    class Broken(TurnObserver):
        def pass_started(self, event: PassStarted) -> None:
            raise ValueError("no display attached")

    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_tool_loop(
            provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock, observer=Broken()
        )
    assert result.status is TurnStatus.COMPLETED
    [record] = records_of(caplog, "toolloop_fsm.turn")
    assert record.getMessage() == (
        "turn observer Broken.pass_started raised ValueError: no display attached; the turn goes on"
    )


async def test_without_logging_configured_nothing_is_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a library's WARNING must not reach stderr through logging's last-resort handler
    clock = VirtualClock()
    provider = ScriptedProvider([[Fail(rate_limited())]], clock=clock)
    root = logging.getLogger()
    handlers = root.handlers[:]
    for handler in handlers:
        root.removeHandler(handler)
    try:
        await run_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    finally:
        for handler in handlers:
            root.addHandler(handler)
    await asyncio.sleep(0)
    assert capsys.readouterr().err == ""


async def test_deliveries_that_do_not_settle_are_a_host_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello"), Pause(100)]], clock=clock)
    channel = RecordingChannel(clock=clock, delivery_delay=50.0)
    policy = LoopPolicy(
        inactivity_timeout=2,
        abandoned_stream_settle=1,
        host_call_timeout=60,
        delivery_flush_chars=1,
    )
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_tool_loop(provider, [], channel, REQUEST, clock=clock, policy=policy)
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    [record] = [
        r for r in records_of(caplog, "toolloop_fsm.turn") if "did not settle" in r.getMessage()
    ]
    assert record.getMessage() == ("deliveries still in flight did not settle; they were abandoned")
    assert record.failure == "host"  # type: ignore[attr-defined]
