"""A key the model echoes, in a durable turn (issue #21, item 6; docs/behaviour.md §9.12):
the worker masks the turn's keys — every key of the chain's attempts and the running
provider's own — out of the provider's stream before it delivers or reports a chunk, and out
of what a tool returns, so the channel, the tool's arguments, the workflow's history and the
result hold no key nor an 8-character run of one, and ``result.delivered`` is what the
channel confirmed."""

from __future__ import annotations

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
from toolloop_fsm import result_to_json
from toolloop_fsm import run_generation_turn
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import real_time_limit
from toolloop_fsm.testing.hostile import leaked_runs

temporalio = pytest.importorskip("temporalio")

from temporalio.client import Client  # noqa: E402

from tests.temporal.test_durable_turns import comparable  # noqa: E402
from toolloop_fsm.temporal import TurnWorker  # noqa: E402
from toolloop_fsm.temporal import start_generation_turn  # noqa: E402

LIMIT = 60.0
#: the running attempt's key, a later attempt's key, and the provider's own
KEY = "sk-live-7Hq2Zp9WxR4mTn6Vb3Kc"
SPARE = "sk-spare-Lw3Pq8Xz2Rt5Yu7Io1"
OWN = "own-Mn4Bv6Cx8Zl2Kj5Hg9Fd"
KEYS = [KEY, SPARE, OWN]
REQUEST = TurnRequest([{"role": "user", "content": "what is my key?"}])
POLICY = TurnPolicy(loop=LoopPolicy(delivery_flush_chars=8))


class KeyedProvider(ScriptedProvider):
    """A scripted model holding a key of its own, as an adapter built with ``api_key=``."""

    api_key = OWN


def echoing_script() -> list[list[ScriptItem]]:
    """The keys echoed whole, split across two chunks, a character at a time, and in a
    tool call's arguments."""
    return [
        [
            TextDelta(f"Your key is {KEY}, "),
            TextDelta(f"again {KEY[:9]}"),
            TextDelta(f"{KEY[9:]}; the spare "),
            *(TextDelta(character) for character in SPARE),
            TextDelta(". "),
            FunctionCall("lookup", {"q": f"owner of {KEY}", "keys": [SPARE, OWN]}, "c1"),
            UsageReport(5, 5),
        ],
        [TextDelta(f"It said {OWN[:12]}"), TextDelta(f"{OWN[12:]}."), UsageReport(5, 5)],
    ]


class Lookup:
    """A tool that keeps the arguments it received and quotes the key in what it returns."""

    def __init__(self) -> None:
        self.arguments: list[dict[str, Any]] = []

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.arguments.append(arguments)
        return ToolResult(data={"owner": KEY, "spare": [SPARE]}, message=f"found {OWN}")

    def tool(self) -> Tool:
        return Tool("lookup", "look something up", {"type": "object"}, self)


async def test_a_durable_turn_masks_echoed_keys_and_delivers_what_the_result_says(
    client: Client, task_queue: str
) -> None:
    channel = RecordingChannel()
    lookup = Lookup()
    providers = {
        "main": Attempt(lambda key: KeyedProvider(echoing_script()), keys=(KEY,)),
        "spare": Attempt(lambda key: ScriptedProvider([]), keys=(SPARE,)),
    }
    async with TurnWorker(
        client, task_queue, providers=providers, tools=[lookup.tool()], channels={"chat": channel}
    ):
        handle = await start_generation_turn(
            client,
            task_queue=task_queue,
            attempts=["main", "spare"],
            channel="chat",
            request=REQUEST,
            policy=POLICY,
            heartbeat_timeout=2.0,
        )
        async with real_time_limit(LIMIT):
            result: GenerationTurnResult = await handle.result()
            history = await handle.handle.fetch_history()
    assert result.status is TurnStatus.COMPLETED
    recorded = b"".join(event.SerializeToString() for event in history.events)
    places = {
        "the channel": repr(channel.delivered) + repr(channel.notices),
        "the tool's arguments": repr(lookup.arguments),
        "result.delivered": repr(result.delivered),
        "the history": repr(result.history),
        "final_text": result.final_text or "",
        "the result": result_to_json(result),
        "the workflow's history": recorded.decode("utf-8", "replace"),
    }
    assert leaked_runs(KEYS, places) == []
    # masked, not dropped
    assert channel.text == (
        "Your key is [REDACTED], again [REDACTED]; the spare [REDACTED]. It said [REDACTED]."
    )
    assert lookup.arguments == [{"q": "owner of [REDACTED]", "keys": ["[REDACTED]"] * 2}]
    [round_] = result.history
    assert round_.response.data == {"owner": "[REDACTED]", "spare": ["[REDACTED]"]}
    assert round_.response.message == "found [REDACTED]"
    assert result.final_text == "It said [REDACTED]."
    # what the user saw is what the result says they saw
    confirmed = [(d.text, d.expression) for d in channel.delivered]
    assert confirmed == [(d.text, d.expression) for d in result.delivered]


async def test_a_pass_failing_after_a_possible_key_start_keeps_it_and_masks_the_failure(
    client: Client, task_queue: str
) -> None:
    """A chunk ending in ``sk-`` might begin the key, so the worker holds its tail back; the
    stream then fails with an error quoting the key: the held text is let through to the
    machine before the failure, the failure is masked, and the durable turn ends as the
    in-process one does (the same result, the same deliveries)."""
    failure = ProviderError(
        f"upstream rejected {KEY}", kind="server", retryable=True, status_code=503
    )
    failing: list[list[ScriptItem]] = [[TextDelta("Partial answer, see sk-"), Fail(failure)]]
    answering: list[list[ScriptItem]] = [[TextDelta("Here you are."), UsageReport(5, 5)]]
    channel = RecordingChannel()
    providers = {
        "flaky": Attempt(lambda key: ScriptedProvider(failing), keys=(KEY,)),
        "main": Attempt(lambda key: ScriptedProvider(answering), keys=(SPARE,)),
    }
    async with TurnWorker(client, task_queue, providers=providers, channels={"chat": channel}):
        handle = await start_generation_turn(
            client,
            task_queue=task_queue,
            attempts=["flaky", "main"],
            channel="chat",
            request=REQUEST,
            policy=POLICY,
            heartbeat_timeout=2.0,
        )
        async with real_time_limit(LIMIT):
            durable = await handle.result()
            history = await handle.handle.fetch_history()
    recorded = b"".join(event.SerializeToString() for event in history.events).decode(
        "utf-8", "replace"
    )
    local_channel = RecordingChannel()
    local = await run_generation_turn(
        [
            Attempt(lambda key: ScriptedProvider(failing), keys=(KEY,), label="flaky"),
            Attempt(lambda key: ScriptedProvider(answering), keys=(SPARE,), label="main"),
        ],
        [],
        local_channel,
        REQUEST,
        policy=POLICY,
    )
    assert durable.status is TurnStatus.COMPLETED
    assert channel.texts == ["Partial answer, see ", "Here you are."]
    # the failure the workflow was told of is masked, like everything else it recorded
    assert "upstream rejected [REDACTED]" in recorded
    places = {"the result": result_to_json(durable), "the workflow's history": recorded}
    assert leaked_runs(KEYS, places) == []
    assert comparable(durable) == comparable(local)
    assert channel.texts == local_channel.texts
