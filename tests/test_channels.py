"""The ready channels (`toolloop_fsm.channels`): one made of plain functions, whose left-out
methods show the user what the channel is given; one that prints; one that collects — each a
full channel, so a turn's guarantees hold with it."""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any

import pytest

from toolloop_fsm import CallbackChannel
from toolloop_fsm import CollectingChannel
from toolloop_fsm import ConsoleChannel
from toolloop_fsm import FinishKind
from toolloop_fsm import FinishReason
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import Channel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

REQUEST = TurnRequest([{"role": "user", "content": "hello"}])


async def _sticker(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"sent": True}, expression="wave")


async def _broken(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    raise RuntimeError("the lookup service is down")


TOOLS = [
    Tool("send_sticker", "Send a sticker", {"type": "object"}, _sticker),
    Tool("lookup", "Look something up", {"type": "object"}, _broken),
]


def _answer(text: str) -> list[Any]:
    return [TextDelta(text), FinishReason(FinishKind.STOP, "stop")]


def _calling(name: str, text: str = "") -> list[Any]:
    return [TextDelta(text), FunctionCall(name, {}, "c1"), FinishReason(FinishKind.TOOL_CALLS)]


async def _turn(
    channel: Channel,
    *passes: list[Any],
    policy: LoopPolicy | None = None,
    signals: TurnSignals | None = None,
) -> GenerationTurnResult:
    return await run_tool_loop(
        ScriptedProvider(passes),
        TOOLS,
        channel,
        REQUEST,
        policy=policy or LoopPolicy(),
        signals=signals,
        clock=VirtualClock(),
    )


# --------------------------------------------------------------------------- CallbackChannel
async def test_a_channel_of_one_plain_function_delivers_the_text() -> None:
    shown: list[str] = []
    result = await _turn(CallbackChannel(shown.append), _answer("Hi there!"))

    assert result.status is TurnStatus.COMPLETED
    assert "".join(shown) == "Hi there!" == result.delivered_text


async def test_an_async_function_is_awaited() -> None:
    shown: list[str] = []

    async def send(text: str) -> None:
        await asyncio.sleep(0)
        shown.append(text)

    await _turn(CallbackChannel(send), _answer("Hi there!"))
    assert "".join(shown) == "Hi there!"


async def test_an_expression_is_shown_as_its_name_when_the_host_gives_no_function() -> None:
    shown: list[str] = []
    result = await _turn(CallbackChannel(shown.append), _calling("send_sticker"), _answer("Done."))

    assert "[wave]" in shown
    assert [d.expression for d in result.delivered if d.expression] == ["wave"]


async def test_a_visible_notice_is_shown_as_text_and_a_hidden_one_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shown: list[str] = []
    caplog.set_level(logging.INFO, logger="toolloop_fsm.channels")
    result = await _turn(
        CallbackChannel(shown.append),
        _calling("lookup", "Let me look. "),
        policy=LoopPolicy(max_function_call_iterations=1),
    )

    assert [n.key for n in result.notices] == ["tool_failed", "max_iterations"]
    assert "\n(max_iterations: {'iterations': 1})\n" in shown
    assert not any("tool_failed" in text for text in shown)  # hidden: for logs, not the user
    assert "hidden notice tool_failed" in caplog.text


async def test_the_stop_message_is_sent_as_text_when_the_host_gives_no_function() -> None:
    shown: list[str] = []
    signals = TurnSignals()
    signals.request_stop("Stopped — ask me again any time.")
    result = await _turn(CallbackChannel(shown.append), _answer("never"), signals=signals)

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert shown == ["Stopped — ask me again any time."]


async def test_the_functions_the_host_gives_replace_the_defaults() -> None:
    calls: list[tuple[str, object]] = []
    channel = CallbackChannel(
        lambda text: calls.append(("text", text)),
        send_expression=lambda expression: calls.append(("expression", expression)),
        send_notice=lambda notice: calls.append(("notice", notice.key)),
        queue_front=lambda message: calls.append(("front", message)),
    )
    await _turn(channel, _calling("send_sticker"), _answer("Done."))

    assert ("expression", "wave") in calls
    assert ("text", "[wave]") not in calls


def test_a_callback_that_is_not_a_function_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="CallbackChannel: send_notice must be a function, got str"):
        CallbackChannel(print, send_notice="log")  # type: ignore[arg-type]


async def test_a_callback_that_raises_ends_the_turn_as_any_channel_does() -> None:
    def refuse(_text: str) -> None:
        raise ConnectionError("the chat is gone")

    result = await _turn(CallbackChannel(refuse), _answer("Hi there!"))

    assert result.status is TurnStatus.ERROR
    assert result.delivered == ()
    assert isinstance(result.exception, ConnectionError)


async def test_an_async_callback_that_never_returns_is_bounded_by_the_host_call_timeout() -> None:
    async def hang(_text: str) -> None:
        await asyncio.Event().wait()

    result = await _turn(
        CallbackChannel(hang), _answer("Hi there!"), policy=LoopPolicy(host_call_timeout=5)
    )

    assert (result.status, result.reason) == (TurnStatus.ERROR, "host_timeout")


# --------------------------------------------------------------------------- the ready ones
async def test_the_console_channel_prints_the_text_as_it_arrives_and_the_notices_on_their_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    await _turn(
        ConsoleChannel(),
        _calling("lookup", "Let me look. "),
        policy=LoopPolicy(max_function_call_iterations=1),
    )
    assert capsys.readouterr().out == "Let me look. \n(max_iterations: {'iterations': 1})\n"


async def test_the_console_channel_writes_to_the_stream_it_is_given() -> None:
    out = io.StringIO()
    await _turn(ConsoleChannel(out), _calling("send_sticker", "Here. "), _answer("Done."))
    assert out.getvalue() == "Here. [wave]Done."


async def test_the_collecting_channel_keeps_everything_in_order() -> None:
    channel = CollectingChannel()
    signals = TurnSignals()
    await _turn(channel, _calling("send_sticker", "Here. "), _answer("Done."))
    signals.request_stop("Stopped.")
    await _turn(channel, _answer("never"), signals=signals)

    assert (channel.text, channel.expressions) == ("Here. Done.", ["wave"])
    assert channel.stop_messages == ["Stopped."]
