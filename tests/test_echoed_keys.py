"""A key the model echoes (issue #21, item 6): when a provider streams one of the turn's API
keys back — in its text, whole or split over chunks, in a tool call's arguments, in a drafted
reply — or a tool's own output quotes one, the user never sees it, and nothing the turn
hands out holds it: not the channel, the notices, the live events, the observers, the
tool's arguments, a snapshot taken mid-turn, the next request, the history or the result;
and what the result says was delivered is what the channel confirmed (docs/behaviour.md
§9.12, docs/invariants.md §5 and §9)."""

from __future__ import annotations

import asyncio
import datetime
import decimal
import itertools
import json
from collections.abc import AsyncIterator
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers.test_loop_over_http import text_stream
from tests.providers.test_loop_over_http import tool_call_stream
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import Attempt
from toolloop_fsm import ContextRestart
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import result_to_json
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.providers._secrecy import fragment_pattern
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.pump.redaction import may_hold_key
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.snapshot import snapshot_to_json
from toolloop_fsm.stream import stream_generation_turn
from toolloop_fsm.stream import stream_tool_loop
from toolloop_fsm.testing import EchoKey
from toolloop_fsm.testing import InvariantViolation
from toolloop_fsm.testing import KeyEcho
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import check_invariants
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing.hostile import leaked_runs
from toolloop_fsm.testing.reviewer import ScriptedReviewer

KEY = "sk-live-7Hq2Zp9WxR4mTn6Vb3Kc"
REQUEST = TurnRequest([{"role": "user", "content": "what is my key?"}])


class KeyedProvider(ScriptedProvider):
    """A scripted model that holds the turn's key, as an adapter built with ``api_key=``
    does (a `run_tool_loop` turn's keys are its provider's)."""

    api_key = KEY


class Everything(TurnObserver):
    """Every phase event and chunk a turn's observers are shown, as text."""

    wants_chunks = True

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name in {
            "turn_started",
            "turn_ended",
            "turn_aborted",
            "attempt_started",
            "attempt_ended",
            "pass_started",
            "pass_ended",
            "tool_started",
            "tool_ended",
            "chunk",
        }:
            return lambda event: object.__getattribute__(self, "seen").append(repr(event))
        return object.__getattribute__(self, name)


class Witnesses:
    """Everything the turn hands out, gathered for one search for the key."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.channel = RecordingChannel(clock=clock)
        self.observer = Everything()
        self.snapshots: list[str] = []
        self.tool_arguments: list[dict[str, Any]] = []

    def take_snapshot(self, snapshot: TurnSnapshot) -> None:
        self.snapshots.append(snapshot_to_json(snapshot))

    def lookup(self) -> Tool:
        async def handler(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
            self.tool_arguments.append(arguments)
            return ToolResult(data={"found": "nothing"}, message="looked up")

        return Tool("lookup", "look something up", {"type": "object"}, handler)

    def places(self, result: GenerationTurnResult, *extra: tuple[str, str]) -> dict[str, str]:
        return {
            "the channel": repr(self.channel.delivered) + repr(self.channel.notices),
            "the observers": "\n".join(self.observer.seen),
            "the snapshots": "\n".join(self.snapshots),
            "the tool's arguments": repr(self.tool_arguments),
            "result.delivered": repr(result.delivered),
            "the history": repr(result.history),
            "the result": result_to_json(result),
            **dict(extra),
        }

    def assert_nothing_holds_the_key(
        self, result: GenerationTurnResult, *extra: tuple[str, str]
    ) -> None:
        assert leaked_runs([KEY], self.places(result, *extra)) == []
        # what the user saw is what the result says they saw
        confirmed = [(d.text, d.expression) for d in self.channel.delivered]
        assert confirmed == [(d.text, d.expression) for d in result.delivered]


def whole_echo() -> list[list[ScriptItem]]:
    return [[TextDelta(f"Your key is {KEY}, keep it safe."), UsageReport(5, 5)]]


def split_echo() -> list[list[ScriptItem]]:
    """The key split over chunks: once across two, once a character at a time."""
    one_by_one = [TextDelta(character) for character in KEY]
    return [
        [
            TextDelta(f"Your key is {KEY[:9]}"),
            TextDelta(f"{KEY[9:]}. Again: "),
            *one_by_one,
            TextDelta("."),
            UsageReport(5, 5),
        ]
    ]


def call_echo() -> list[list[ScriptItem]]:
    return [
        [
            TextDelta("Let me look that up. "),
            FunctionCall("lookup", {"q": f"owner of {KEY}", "keys": [KEY]}, "call_1"),
            UsageReport(5, 5),
        ],
        [TextDelta("Nothing found."), UsageReport(5, 5)],
    ]


def drafted_echo() -> list[list[ScriptItem]]:
    return [
        [
            TextDelta("Here it is: "),
            TextDelta(f"{KEY[:5]}"),
            TextDelta(f"{KEY[5:]}."),
            UsageReport(5, 5),
        ]
    ]


SCRIPTS = {"whole": whole_echo, "split": split_echo, "tool call": call_echo}


# --------------------------------------------------------------------------- run_tool_loop
@pytest.mark.parametrize("echo", list(SCRIPTS))
async def test_a_key_the_model_echoes_reaches_nothing_a_tool_loop_hands_out(echo: str) -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    provider = KeyedProvider(SCRIPTS[echo](), clock=clock)
    result = await run_tool_loop(
        provider,
        [seen.lookup()],
        seen.channel,
        REQUEST,
        clock=clock,
        observer=seen.observer,
        on_snapshot=seen.take_snapshot,
    )
    assert result.status is TurnStatus.COMPLETED
    seen.assert_nothing_holds_the_key(result)
    assert "[REDACTED]" in seen.channel.text + repr(seen.tool_arguments)
    check_invariants(
        result, policy=LoopPolicy(), channel=seen.channel, provider=provider, keys=[KEY]
    )


async def test_a_key_split_over_chunks_is_masked_as_one_in_what_the_user_sees() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    result = await run_tool_loop(
        KeyedProvider(split_echo(), clock=clock), [], seen.channel, REQUEST, clock=clock
    )
    assert seen.channel.text == "Your key is [REDACTED]. Again: [REDACTED]."
    assert result.final_text == seen.channel.text


async def test_the_tool_receives_the_echoed_key_masked() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    await run_tool_loop(
        KeyedProvider(call_echo(), clock=clock),
        [seen.lookup()],
        seen.channel,
        REQUEST,
        clock=clock,
    )
    assert seen.tool_arguments == [{"q": "owner of [REDACTED]", "keys": ["[REDACTED]"]}]


@pytest.mark.parametrize("echo", ["whole", "split"])
async def test_live_events_of_a_tool_loop_never_show_an_echoed_key(echo: str) -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    provider = KeyedProvider(SCRIPTS[echo](), clock=clock)
    async with stream_tool_loop(provider, [], seen.channel, REQUEST, clock=clock) as events:
        live = [repr(event) async for event in events]
    assert leaked_runs([KEY], {"the live events": "\n".join(live)}) == []
    assert any("[REDACTED]" in event for event in live)


async def test_a_drafted_reply_holding_a_key_is_reviewed_masked_and_delivered_masked() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    reviewer = ScriptedReviewer(clock=clock)
    policy = LoopPolicy(drafting=True)
    result = await run_tool_loop(
        KeyedProvider(drafted_echo(), clock=clock),
        [],
        seen.channel,
        REQUEST,
        clock=clock,
        policy=policy,
        reviewer=reviewer,
        observer=seen.observer,
    )
    # the reviewer was asked (not refused the packet) and saw the reply masked
    assert [packet.candidate for packet in reviewer.packets] == ["Here it is: [REDACTED]."]
    assert [review.verdict for review in result.reviews] == ["pass"]
    assert result.reason != "draft_unreviewed"
    assert seen.channel.text == "Here it is: [REDACTED]."
    seen.assert_nothing_holds_the_key(result, ("the reviewer", repr(reviewer.packets)))


# --------------------------------------------------------------------------- run_generation_turn
def keyed_attempt(script: Sequence[Sequence[ScriptItem]], clock: VirtualClock) -> Attempt:
    """A model built for its key, as a chain's keyed model is: the provider itself names no
    key, the `Attempt` does."""
    return Attempt(lambda key: ScriptedProvider(script, clock=clock), keys=(KEY,), label="main")


@pytest.mark.parametrize("echo", list(SCRIPTS))
async def test_a_key_the_model_echoes_reaches_nothing_a_generation_turn_hands_out(
    echo: str,
) -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    result = await run_generation_turn(
        [keyed_attempt(SCRIPTS[echo](), clock)],
        [seen.lookup()],
        seen.channel,
        REQUEST,
        clock=clock,
        observer=seen.observer,
        on_snapshot=seen.take_snapshot,
    )
    assert result.status is TurnStatus.COMPLETED
    assert seen.snapshots  # one as the attempt started, one at each stable point
    seen.assert_nothing_holds_the_key(result)


async def test_a_generation_turn_delivers_and_reports_the_same_masked_text() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    result = await run_generation_turn(
        [keyed_attempt(split_echo(), clock)], [], seen.channel, REQUEST, clock=clock
    )
    assert seen.channel.text == "Your key is [REDACTED]. Again: [REDACTED]."
    assert "".join(d.text or "" for d in result.delivered) == seen.channel.text


@pytest.mark.parametrize("echo", ["whole", "split"])
async def test_live_events_of_a_generation_turn_never_show_an_echoed_key(echo: str) -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    async with stream_generation_turn(
        [keyed_attempt(SCRIPTS[echo](), clock)], [], seen.channel, REQUEST, clock=clock
    ) as events:
        live = [repr(event) async for event in events]
    assert leaked_runs([KEY], {"the live events": "\n".join(live)}) == []


async def test_a_drafted_reply_of_a_generation_turn_is_reviewed_and_delivered_masked() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    reviewer = ScriptedReviewer(clock=clock)
    result = await run_generation_turn(
        [keyed_attempt(drafted_echo(), clock)],
        [],
        seen.channel,
        REQUEST,
        clock=clock,
        policy=TurnPolicy(loop=LoopPolicy(drafting=True)),
        reviewer=reviewer,
        observer=seen.observer,
        on_snapshot=seen.take_snapshot,
    )
    assert [packet.candidate for packet in reviewer.packets] == ["Here it is: [REDACTED]."]
    assert seen.channel.text == "Here it is: [REDACTED]."
    seen.assert_nothing_holds_the_key(result, ("the reviewer", repr(reviewer.packets)))


# --------------------------------------------------------------------------- over real HTTP
async def test_a_key_echoed_over_http_reaches_neither_the_user_nor_the_result(
    wire_server: WireServer,
) -> None:
    """A real adapter, built with the key, against a loopback server that streams the key
    back split over two SSE events, then calls a tool with it."""
    wire_server.serve(
        Scripted(chunks=tool_call_stream("Checking. ", "lookup", {"q": KEY})),
        Scripted(chunks=text_stream(f"Your key is {KEY[:12]}", f"{KEY[12:]}.")),
    )
    clock = VirtualClock()
    seen = Witnesses(clock)
    provider = OpenAICompatibleProvider(wire_server.url, "test-model", api_key=KEY)
    result = await run_tool_loop(
        provider,
        [seen.lookup()],
        seen.channel,
        REQUEST,
        observer=seen.observer,
        on_snapshot=seen.take_snapshot,
    )
    assert result.status is TurnStatus.COMPLETED
    # (the adapter's secrets include its credential header, ``Bearer <key>``: the space
    # before the key is a piece of that one)
    assert seen.channel.text in (
        "Checking. Your key is [REDACTED].",
        "Checking. Your key is[REDACTED].",
    )
    assert seen.tool_arguments == [{"q": "[REDACTED]"}]
    seen.assert_nothing_holds_the_key(result)
    # the second request carried the masked history back to the model, never the key
    assert KEY not in wire_server.requests[1].body.decode()
    assert json.loads(wire_server.requests[1].body)["messages"]


# --------------------------------------------------------------------------- the kit's checker
async def test_the_invariant_checker_names_the_channel_when_a_key_reached_the_user() -> None:
    """Invariant 9 searches what the channel was delivered too, not only the result."""
    clock = VirtualClock()
    channel = RecordingChannel(clock=clock)
    # a provider that names no key, so the engine cannot mask it: the key reaches the user
    provider = ScriptedProvider(whole_echo(), clock=clock)
    result = await run_tool_loop(provider, [], channel, REQUEST, clock=clock)
    with pytest.raises(InvariantViolation, match="invariant 9") as raised:
        check_invariants(result, policy=LoopPolicy(), channel=channel, keys=[KEY])
    assert "the channel's deliveries" in str(raised.value)
    assert KEY not in str(raised.value)


async def test_text_held_back_as_a_possible_key_start_is_kept_when_the_stream_stalls() -> None:
    """A chunk ending in ``sk-`` might begin the key, so its tail is held back; when the
    stream then stalls into the inactivity deadline, the held text was still the model's and
    is in the pass's text (and what was delivered is what the channel confirmed)."""
    clock = VirtualClock()
    seen = Witnesses(clock)
    stalled: list[list[ScriptItem]] = [[TextDelta("Partial answer, see sk-"), Pause(60.0)]]
    policy = LoopPolicy(inactivity_timeout=2.0)
    result = await run_tool_loop(
        KeyedProvider(stalled, clock=clock),
        [],
        seen.channel,
        REQUEST,
        clock=clock,
        policy=policy,
        observer=seen.observer,
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    assert result.stream_results[-1].text == "Partial answer, see sk-"
    assert any("see sk-" in event or "'sk-'" in event for event in seen.observer.seen)
    seen.assert_nothing_holds_the_key(result)


# --------------------------------------------------------------------------- a tool quoting a key
def quoting_tools(seen: Witnesses) -> list[Tool]:
    """Tools whose own output quotes the key: in a result's data, message and expression, in
    a reported failure, in an exception's message, and in a context restart's item."""

    async def quote(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(
            data={"owner": KEY, KEY: [f"a {KEY[:10]}", {"deep": KEY}], "count": 2},
            message=f"found {KEY}",
            expression=f"sticker:{KEY}",
        )

    async def refuse(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(success=False, data=[KEY], message=f"{KEY} is revoked")

    async def explode(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        raise RuntimeError(f"the vault rejected {KEY}")

    async def enrich(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        item = {"role": "system", "content": f"transcript mentions {KEY}"}
        return ToolResult(context_restart=ContextRestart(item, ("transcript",)))

    return [
        Tool("quote", "quote the key", {"type": "object"}, quote),
        Tool("refuse", "refuse with the key", {"type": "object"}, refuse),
        Tool("explode", "raise with the key", {"type": "object"}, explode),
        Tool("enrich", "restart with the key", {"type": "object"}, enrich),
    ]


def tool_quotes() -> list[list[ScriptItem]]:
    calls: list[list[ScriptItem]] = [
        [FunctionCall(name, {}, f"call_{name}"), UsageReport(5, 5)]
        for name in ("quote", "refuse", "explode", "enrich")
    ]
    return [*calls, [TextDelta("Done."), UsageReport(5, 5)]]


def tool_quote_places(
    seen: Witnesses, result: GenerationTurnResult, provider: ScriptedProvider
) -> dict[str, str]:
    return {
        **seen.places(result),
        "the notices": repr(seen.channel.notices),
        "the next requests": repr(provider.requests[1:]),
    }


async def test_a_key_a_tool_quotes_reaches_nothing_a_tool_loop_hands_out() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    provider = KeyedProvider(tool_quotes(), clock=clock)
    result = await run_tool_loop(
        provider,
        quoting_tools(seen),
        seen.channel,
        REQUEST,
        clock=clock,
        observer=seen.observer,
        on_snapshot=seen.take_snapshot,
    )
    assert result.status is TurnStatus.COMPLETED
    assert len(provider.requests) == 5 and len(seen.snapshots) >= 4
    assert leaked_runs([KEY], tool_quote_places(seen, result, provider)) == []
    seen.assert_nothing_holds_the_key(result)
    # what the tool said is kept, masked, not dropped
    quoted = result.history[0].response
    assert quoted.data == {
        "owner": "[REDACTED]",
        "[REDACTED]": ["a [REDACTED]", {"deep": "[REDACTED]"}],
        "count": 2,
    }
    assert quoted.message == "found [REDACTED]"
    assert [d.expression for d in seen.channel.delivered if d.expression] == ["sticker:[REDACTED]"]
    assert result.history[1].response.reason == "[REDACTED] is revoked"
    assert result.history[2].response.reason == "RuntimeError: the vault rejected [REDACTED]"
    summaries = [n.params["summary"] for n in seen.channel.notices if n.key == "tool_failed"]
    assert any("[REDACTED] is revoked" in summary for summary in summaries)
    assert "transcript mentions [REDACTED]" in repr(provider.requests[-1])
    check_invariants(
        result, policy=LoopPolicy(), channel=seen.channel, provider=provider, keys=[KEY]
    )


async def test_a_key_a_tool_quotes_reaches_nothing_a_generation_turn_hands_out() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    provider = ScriptedProvider(tool_quotes(), clock=clock)
    attempt = Attempt(lambda key: provider, keys=(KEY,), label="main")
    result = await run_generation_turn(
        [attempt],
        quoting_tools(seen),
        seen.channel,
        REQUEST,
        clock=clock,
        observer=seen.observer,
        on_snapshot=seen.take_snapshot,
    )
    assert result.status is TurnStatus.COMPLETED
    assert len(provider.requests) == 5 and seen.snapshots
    assert leaked_runs([KEY], tool_quote_places(seen, result, provider)) == []
    # what the channel was handed is what the result says it was handed, not a later mask
    seen.assert_nothing_holds_the_key(result)
    assert [d.expression for d in result.delivered if d.expression] == ["sticker:[REDACTED]"]


async def test_tool_data_of_other_types_is_kept_as_it_is_by_a_generation_turn_with_keys() -> None:
    """A tool's data may hold values that are neither JSON nor attrs classes (a datetime, a
    Decimal): the look for keys in the result passes over them instead of failing the turn,
    and still masks the key beside them."""
    clock = VirtualClock()
    channel = RecordingChannel(clock=clock)
    script: list[list[ScriptItem]] = [
        [FunctionCall("when", {}, "call_when"), UsageReport(5, 5)],
        [TextDelta("Done."), UsageReport(5, 5)],
    ]
    provider = ScriptedProvider(script, clock=clock)
    at = datetime.datetime(2026, 12, 1, 9, 30)

    async def when(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"at": at, "rate": decimal.Decimal("1.5"), "owner": KEY})

    tool = Tool("when", "When it happens.", {"type": "object", "properties": {}}, when)
    attempt = Attempt(lambda key: provider, keys=(KEY,), label="main")

    result = await run_generation_turn([attempt], [tool], channel, REQUEST, clock=clock)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, "Done.")
    assert result.history[0].response.data == {
        "at": at,
        "rate": decimal.Decimal("1.5"),
        "owner": "[REDACTED]",
    }


async def test_live_events_never_show_a_key_a_tool_quotes() -> None:
    clock = VirtualClock()
    seen = Witnesses(clock)
    provider = KeyedProvider(tool_quotes(), clock=clock)
    async with stream_tool_loop(
        provider, quoting_tools(seen), seen.channel, REQUEST, clock=clock
    ) as events:
        live = [repr(event) async for event in events]
    assert leaked_runs([KEY], {"the live events": "\n".join(live)}) == []
    assert any("found [REDACTED]" in event for event in live)


# --------------------------------------------------------------------------- the stream mask
_KEY_TEXT = st.text(alphabet="abcdefABCDEF0123456789-_", min_size=4, max_size=30)
_FILLER = st.text(alphabet=" .:=abcXYZ09-_é", max_size=12)


@st.composite
def echoed_streams(draw: st.DrawFn) -> tuple[tuple[str, ...], str, list[str]]:
    """The turn's keys (a short one among them, perhaps: matched only whole), a reply made
    of filler, slices of the keys and whole keys, and the reply cut into chunks anywhere."""
    keys = tuple(draw(st.lists(_KEY_TEXT, min_size=1, max_size=3, unique=True)))
    slices = st.sampled_from(keys).flatmap(
        lambda key: st.tuples(st.integers(0, len(key)), st.integers(0, len(key))).map(
            lambda bounds: key[min(bounds) : max(bounds)]
        )
    )
    parts = draw(st.lists(st.one_of(_FILLER, slices, st.sampled_from(keys)), max_size=10))
    text = "Answer: " + "".join(parts)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    bounds = [0, *cuts, len(text)]
    return keys, text, [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


class SecretHolder(ScriptedProvider):
    """A scripted model that holds the keys it is given, as an adapter's ``secrets``."""

    def __init__(self, keys: tuple[str, ...], passes: list[list[ScriptItem]], clock: Any):
        super().__init__(passes, clock=clock)
        self.secrets = keys


@settings(max_examples=150)
@given(echoed_streams())
def test_masking_a_streamed_reply_equals_masking_the_whole_reply(
    stream: tuple[tuple[str, ...], str, list[str]],
) -> None:
    """However the chunks cut a reply, what the mask lets through, joined, is exactly the
    whole reply masked at once (`Secrets.mask`): on its own and in a turn's channel."""
    keys, text, chunks = stream
    secrets = Secrets(keys)
    expected = secrets.mask(text)

    async def source() -> AsyncIterator[Any]:
        for piece in chunks:
            yield TextDelta(piece)

    async def masked_alone() -> str:
        return "".join([chunk.text async for chunk in secrets.masked(source())])

    async def masked_in_a_turn() -> str:
        clock = VirtualClock()
        channel = RecordingChannel(clock=clock)
        script: list[list[ScriptItem]] = [[*map(TextDelta, chunks), UsageReport(5, 5)]]
        provider = SecretHolder(keys, script, clock)
        await run_tool_loop(provider, [], channel, REQUEST, clock=clock)
        return channel.text

    assert asyncio.run(masked_alone()) == expected
    assert asyncio.run(masked_in_a_turn()) == expected


async def test_short_keys_echoed_just_before_a_chunk_ends_are_masked_once_each() -> None:
    """A short key (matched only whole) can end twice in the few characters the mask keeps
    after a chunk that ends on a key; the next chunk does not mask those echoes again."""
    secrets = Secrets(("qzw", "sk-live-1234567890"))

    async def source() -> AsyncIterator[Any]:
        for piece in ("Hi qzw qzw", " and more"):
            yield TextDelta(piece)

    seen = "".join([chunk.text async for chunk in secrets.masked(source())])

    assert seen == secrets.mask("Hi qzw qzw and more") == "Hi [REDACTED] [REDACTED] and more"


async def test_a_key_split_over_unsigned_thought_chunks_is_masked_as_one() -> None:
    """Thoughts without a signature stream like text: a key split over two of them is masked
    as one key, not its first characters let through before the rest is seen."""
    secrets = Secrets((KEY,))
    pieces = ("I recall " + KEY[:5], KEY[5:] + " is the key")

    async def source() -> AsyncIterator[Any]:
        for piece in pieces:
            yield ThoughtDelta(piece)

    seen = "".join([chunk.text async for chunk in secrets.masked(source())])

    assert seen == secrets.mask("".join(pieces)) == "I recall [REDACTED] is the key"


def test_the_result_look_finds_a_key_that_holds_the_text_separator() -> None:
    """The quick look for keys in a result joins its texts with NUL; a key holding a NUL is
    looked for text by text instead, and still found (it never answers no wrongly)."""
    key = "sk-live\x007Hq2Zp9WxR4m"
    leak = fragment_pattern((key,))
    assert leak is not None
    assert may_hold_key([f"it was {key}"], (key,), leak)
    assert may_hold_key({"quote": f"it was {key}", "note": "fine"}, (key,), leak)
    assert not may_hold_key(["nothing here", "fine"], (key,), leak)


async def test_text_held_back_as_a_possible_key_start_is_never_sent_after_a_refused_delivery() -> (
    None
):
    """docs/behaviour.md §9.12 rule 2: the channel refuses the second delivery; the tail held
    back as a possible start of the key ("k" begins "k-7Qm2xZ") must not reach the user after
    that gap, or they would read "Hik" with the words between missing."""
    key = "hk-7Qm2xZ9pLk4vR8tW3nB6"
    script = TurnScript(
        passes=((TextDelta("Hi"), TextDelta("🙂 ok"), EchoKey(KeyEcho.WHOLE)),),
        failing_delivery=1,
        provider_key=key,
    )
    run = await run_script(script, LoopPolicy(delivery_flush_chars=1))
    assert (run.result.status, run.result.reason) == (TurnStatus.ERROR, "host_error")
    assert [d.text for d in run.result.delivered] == ["Hi"]
    assert run.result.final_text == "Hi"
