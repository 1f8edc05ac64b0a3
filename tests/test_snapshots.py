"""Durable turns, one case each: a snapshot at every stable point, its strict JSON form, and a
turn resumed from it in a fresh machine — completed tools never run again, delivered text is
never sent again, the pass that was running restarts under the same delivery keys."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSnapshot
from toolloop_fsm import resume_generation_turn
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm import snapshot_to_json
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.sansio import Deliver
from toolloop_fsm.sansio import OfferSnapshot
from toolloop_fsm.sansio import ToolLoopMachine
from toolloop_fsm.snapshot import MAX_SNAPSHOT_ERROR_CHARS
from toolloop_fsm.snapshot import MAX_SNAPSHOT_SIZE
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing.reviewer import ScriptedReviewer

USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
SMALL_FLUSH = LoopPolicy(delivery_flush_chars=5)


class CountingTool:
    """A weather tool that counts its runs (its side effect, as the world sees it)."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    def tool(self) -> Tool:
        async def handler(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
            self.runs.append(arguments)
            return ToolResult(data={"forecast": "sunny"})

        return Tool("get_weather", "The weather in a city", {"type": "object"}, handler)


def weather_passes() -> list[list[ScriptItem]]:
    return [
        [TextDelta("Let me look. "), FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("It is sunny in Oslo today.")],
    ]


async def _run_with_snapshots(
    passes: list[list[Any]], weather: CountingTool, channel: RecordingChannel
) -> tuple[GenerationTurnResult, list[str]]:
    saved: list[str] = []
    result = await run_tool_loop(
        ScriptedProvider(passes),
        [weather.tool()],
        channel,
        TurnRequest(USER, turn_id="turn-1"),
        policy=SMALL_FLUSH,
        on_snapshot=lambda snapshot: saved.append(snapshot_to_json(snapshot)),
    )
    return result, saved


# --------------------------------------------------------------------------- stable points
def test_a_snapshot_is_offered_before_every_pass_and_reads_back_equal() -> None:
    weather = CountingTool()
    result, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    assert result.iterations == 2
    snapshots = [snapshot_from_json(text) for text in saved]
    assert [s.loop.iterations for s in snapshots if s.loop is not None] == [0, 1]
    assert all(s.tier == "tool_loop" and s.turn_id == "turn-1" for s in snapshots)
    # after the tool round: the history holds the call, the ledger its outcome
    after_tool = snapshots[1].loop
    assert after_tool is not None
    assert [entry.call.name for entry in after_tool.history or ()] == ["get_weather"]
    assert len(after_tool.ledger) == 1
    assert snapshot_to_json(snapshot_from_json(saved[1])) == saved[1]


def test_a_machine_not_asked_for_snapshots_offers_none() -> None:
    machine = ToolLoopMachine()
    effects = machine.start(TurnRequest(USER))
    assert not any(isinstance(effect, OfferSnapshot) for effect in effects)
    asked = ToolLoopMachine(snapshots=True)
    assert any(isinstance(effect, OfferSnapshot) for effect in asked.start(TurnRequest(USER)))


def test_a_live_event_stream_takes_snapshots_too() -> None:
    from toolloop_fsm.stream import TurnEnded
    from toolloop_fsm.stream import stream_tool_loop

    weather = CountingTool()
    saved: list[TurnSnapshot] = []

    async def watch() -> GenerationTurnResult | None:
        ended = None
        async with stream_tool_loop(
            ScriptedProvider(weather_passes()),
            [weather.tool()],
            RecordingChannel(),
            TurnRequest(USER),
            on_snapshot=saved.append,
        ) as events:
            async for event in events:
                if isinstance(event, TurnEnded):
                    ended = event.result
        return ended

    result = asyncio.run(watch())
    assert result is not None and result.status.value == "completed"
    assert [s.loop.iterations for s in saved if s.loop is not None] == [0, 1]


# --------------------------------------------------------------------------- resume
def test_a_turn_resumed_after_its_tool_ran_does_not_run_the_tool_again() -> None:
    weather = CountingTool()
    first, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    assert len(weather.runs) == 1
    snapshot = snapshot_from_json(saved[1])  # taken after the tool round, before pass 2
    channel = RecordingChannel()
    resumed = asyncio.run(
        resume_tool_loop(
            snapshot,
            ScriptedProvider(weather_passes()[1:]),
            [weather.tool()],
            channel,
            policy=SMALL_FLUSH,
        )
    )
    assert len(weather.runs) == 1  # the ledger and the history hold its outcome
    assert (resumed.status, resumed.reason) == (first.status, first.reason)
    assert resumed.delivered_text == first.delivered_text
    assert resumed.final_text == "It is sunny in Oslo today."
    # the text delivered before the snapshot is not sent again
    assert channel.text == "It is sunny in Oslo today."
    assert resumed.turn_id == "turn-1"
    assert ("ready", "resume", "starting_pass") in [
        (step.state, step.event, step.next_state) for step in resumed.trace
    ]


def test_a_turn_resumed_after_a_tool_batch_sends_the_batch_again_and_runs_none_of_it() -> None:
    weather = CountingTool()
    cities = ("Oslo", "Rome", "Lima")
    passes: list[list[Any]] = [
        [
            TextDelta("Checking three. "),
            *(FunctionCall("get_weather", {"city": c}) for c in cities),
        ],
        [TextDelta("Sunny in all three.")],
    ]
    first, saved = asyncio.run(_run_with_snapshots(passes, weather, RecordingChannel()))
    assert sorted(run["city"] for run in weather.runs) == sorted(cities)
    snapshot = snapshot_from_json(saved[1])  # taken after the batch, before pass 2
    provider = ScriptedProvider(passes[1:])
    resumed = asyncio.run(
        resume_tool_loop(
            snapshot, provider, [weather.tool()], RecordingChannel(), policy=SMALL_FLUSH
        )
    )
    assert len(weather.runs) == 3  # no call of the batch ran again
    assert resumed.final_text == "Sunny in all three."
    # the resumed pass sends the batch as it was: three calls, one narration, in order
    history = provider.requests[0].history
    assert [(h.call.arguments["city"], h.position) for h in history] == [
        ("Oslo", 0),
        ("Rome", 1),
        ("Lima", 2),
    ]
    assert [h.pre_tool_text for h in history] == ["Checking three. ", None, None]
    assert resumed.history == first.history


def test_a_turn_resumed_after_the_memory_tool_ran_keeps_it_disabled() -> None:
    memory_runs: list[dict[str, Any]] = []

    async def remember(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        memory_runs.append(arguments)
        return ToolResult(data={"saved": True})

    memory = Tool("update_short_term_memory", "Remember a fact", {"type": "object"}, remember)
    weather = CountingTool()
    passes: list[list[ScriptItem]] = [
        [FunctionCall("update_short_term_memory", {"fact": "likes Oslo"})],
        [FunctionCall("update_short_term_memory", {"fact": "again"})],
        [TextDelta("Noted.")],
    ]
    saved: list[str] = []
    asyncio.run(
        run_tool_loop(
            ScriptedProvider(passes),
            [memory, weather.tool()],
            RecordingChannel(),
            TurnRequest(USER),
            on_snapshot=lambda s: saved.append(snapshot_to_json(s)),
        )
    )
    assert memory_runs == [{"fact": "likes Oslo"}]  # once a turn
    snapshot = snapshot_from_json(saved[1])  # after the memory tool ran, before pass 2
    provider = ScriptedProvider(passes[1:])
    resumed = asyncio.run(
        resume_tool_loop(snapshot, provider, [memory, weather.tool()], RecordingChannel())
    )
    assert memory_runs == [{"fact": "likes Oslo"}]  # still disabled: not run a second time
    assert [spec.name for spec in provider.requests[0].tools] == ["get_weather"]
    refused = resumed.history[-1].response
    assert not refused.success
    assert "not available in this turn" in (refused.reason or "")
    assert resumed.final_text == "Noted."


def test_a_turn_resumed_after_a_checkpoint_rejection_keeps_the_rejection() -> None:
    from toolloop_fsm.review import Finding
    from toolloop_fsm.review import Pass
    from toolloop_fsm.review import Revise
    from toolloop_fsm.testing.reviewer import ScriptedReviewer

    checkpoint = LoopPolicy(review_tool_calls=True)
    no = Finding("tool_use", "Oslo was not asked about", "ask which city first")
    call = FunctionCall("get_weather", {"city": "Oslo", "units": "metric"})
    passes: list[list[ScriptItem]] = [[call], [call], [TextDelta("Which city?")]]
    weather = CountingTool()
    saved: list[str] = []
    asyncio.run(
        run_tool_loop(
            ScriptedProvider(passes),
            [weather.tool()],
            RecordingChannel(),
            TurnRequest(USER),
            policy=checkpoint,
            reviewer=ScriptedReviewer([Revise([no]), Pass()]),
            on_snapshot=lambda s: saved.append(snapshot_to_json(s)),
        )
    )
    snapshot = snapshot_from_json(saved[1])  # after the rejection, before pass 2
    reviewer = ScriptedReviewer([Pass()])
    resumed = asyncio.run(
        resume_tool_loop(
            snapshot,
            ScriptedProvider(passes[1:]),
            [weather.tool()],
            RecordingChannel(),
            policy=checkpoint,
            reviewer=reviewer,
        )
    )
    assert reviewer.packets == []  # the identical call gets the same rejection, unreviewed
    assert weather.runs == []
    assert [e.response.status for e in resumed.history] == ["review_rejected"] * 2
    assert resumed.history[0].response == resumed.history[1].response
    assert resumed.final_text == "Which city?"


def test_a_crash_mid_pass_resumed_with_a_keyed_channel_shows_no_text_twice() -> None:
    """The worker dies while pass 2 streams, after part of it was delivered; the resumed
    pass sends that part again under the same keys and the channel drops it."""
    passes: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("It is sunny "), Pause(5.0), TextDelta("in Oslo today.")],
    ]
    weather = CountingTool()
    channel = RecordingChannel()
    saved: list[TurnSnapshot] = []

    async def crash() -> None:
        clock = VirtualClock()
        task = asyncio.current_task()
        assert task is not None

        def cut_when_pass_2_is_shown(_delivered: object) -> None:
            if len(saved) == 2:
                task.cancel()  # the process dies here: nothing after runs

        channel.on_delivery = cut_when_pass_2_is_shown
        await run_tool_loop(
            ScriptedProvider(passes, clock=clock),
            [weather.tool()],
            channel,
            TurnRequest(USER, turn_id="turn-2"),
            policy=SMALL_FLUSH,
            clock=clock,
            on_snapshot=saved.append,
        )

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(crash())
    assert channel.text == "It is sunny "
    channel.on_delivery = None
    snapshot = snapshot_from_json(snapshot_to_json(saved[-1]))
    clock = VirtualClock()
    resumed = asyncio.run(
        resume_tool_loop(
            snapshot,
            ScriptedProvider(passes[1:], clock=clock),
            [weather.tool()],
            channel,
            policy=SMALL_FLUSH,
            clock=clock,
        )
    )
    assert channel.duplicates_dropped == 1
    assert channel.text == "It is sunny in Oslo today."
    assert resumed.delivered_text == "It is sunny in Oslo today."
    assert len(weather.runs) == 1


def test_a_delivery_in_flight_at_the_snapshot_is_sent_again_under_its_key() -> None:
    machine = ToolLoopMachine(SMALL_FLUSH, snapshots=True)
    machine.start(TurnRequest(USER, turn_id="turn-3"))
    machine.feed(TextDelta("Let me look. "))
    machine.feed(FunctionCall("get_weather", {}))  # unregistered: refused, a next pass follows
    from toolloop_fsm.events import StreamEnded

    effects = machine.feed(StreamEnded())
    offered = [e.snapshot for e in effects if isinstance(e, OfferSnapshot)]
    assert offered and offered[0].in_flight  # the text was handed over, not yet confirmed
    seq = offered[0].in_flight[0].seq
    resumed = ToolLoopMachine(SMALL_FLUSH)
    opening = resumed.resume(snapshot_from_json(snapshot_to_json(TurnSnapshot(offered[0]))).loop)  # type: ignore[arg-type]
    assert opening[0] == Deliver(seq, text="Let me look. ")


def test_an_exception_from_on_snapshot_is_raised_from_the_run() -> None:
    class StoreDown(Exception):
        pass

    def fail(_snapshot: TurnSnapshot) -> None:
        raise StoreDown("the snapshot store is unreachable")

    weather = CountingTool()
    with pytest.raises(StoreDown):
        asyncio.run(
            run_tool_loop(
                ScriptedProvider(weather_passes()),
                [weather.tool()],
                RecordingChannel(),
                TurnRequest(USER),
                on_snapshot=fail,
            )
        )
    assert weather.runs == []  # the turn ended at its first stable point


def test_resume_refuses_a_host_that_no_longer_registers_a_tool_the_snapshot_names() -> None:
    weather = CountingTool()
    _, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    with pytest.raises(SnapshotError, match=r"tools: .*get_weather"):
        asyncio.run(
            resume_tool_loop(
                snapshot_from_json(saved[1]),
                ScriptedProvider([]),
                [],
                RecordingChannel(),
                policy=SMALL_FLUSH,
            )
        )


def test_a_tool_loop_snapshot_is_refused_by_resume_generation_turn_and_back() -> None:
    weather = CountingTool()
    _, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    snapshot = snapshot_from_json(saved[0])
    with pytest.raises(SnapshotError, match="resume_tool_loop"):
        asyncio.run(resume_generation_turn(snapshot, [], [weather.tool()], RecordingChannel()))


def test_a_drafted_turn_resumed_after_its_revision_keeps_the_review_state() -> None:
    """Cut right after the reviewer asked for a revision: the resumed turn writes the
    replacement, has it reviewed once more (the budget spent stands) and shows only it."""
    from toolloop_fsm.review import Finding
    from toolloop_fsm.review import Pass
    from toolloop_fsm.review import Revise
    from toolloop_fsm.testing.reviewer import ScriptedReviewer

    drafting = LoopPolicy(drafting=True)
    voice = Finding("voice", "the reply is flat", "answer warmly, in one sentence")
    passes: list[list[ScriptItem]] = [
        [TextDelta("Checking. "), FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("Sunny.")],
        [TextDelta("It is a lovely sunny day in Oslo!")],
    ]
    weather = CountingTool()
    saved: list[str] = []
    first = asyncio.run(
        run_tool_loop(
            ScriptedProvider(passes),
            [weather.tool()],
            RecordingChannel(),
            TurnRequest(USER),
            policy=drafting,
            reviewer=ScriptedReviewer([Revise([voice]), Pass()]),
            on_snapshot=lambda s: saved.append(snapshot_to_json(s)),
        )
    )
    assert (first.status.value, first.reason) == ("completed", "draft_passed")
    cut = snapshot_from_json(saved[-1])  # before the revision's pass
    assert cut.loop is not None and cut.loop.draft is not None
    assert (cut.loop.draft.reviews, cut.loop.draft.revisions) == (1, 1)
    assert [r.verdict for r in cut.loop.draft.records] == ["revise"]
    channel = RecordingChannel()
    reviewer = ScriptedReviewer([Pass()])
    resumed = asyncio.run(
        resume_tool_loop(
            cut,
            ScriptedProvider(passes[2:]),
            [weather.tool()],
            channel,
            policy=drafting,
            reviewer=reviewer,
        )
    )
    assert (resumed.status, resumed.reason) == (first.status, first.reason)
    assert channel.texts == ["It is a lovely sunny day in Oslo!"]
    assert resumed.delivered_text == first.delivered_text
    assert [r.verdict for r in resumed.reviews] == ["revise", "pass"]
    assert reviewer.packets[0].revision is not None
    assert reviewer.packets[0].revision.revisions_done == 1
    assert len(weather.runs) == 1


# --------------------------------------------------------------------------- generation turns
def test_a_generation_turn_resumed_in_its_fallback_attempt_keeps_the_chain_and_the_tool() -> None:
    """Model A runs the tool, then fails; model B continues. The turn is cut before B's
    second pass; resumed, B finishes, the tool has run once and A's failure stands."""
    weather = CountingTool()
    failing: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Oslo"})],
        [Fail(ProviderError("overloaded", kind="server", retryable=True))],
    ]
    answering: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("Sunny in Oslo.")],
    ]

    def chain() -> list[Attempt]:
        return [
            Attempt(ScriptedProvider(failing), label="A"),
            Attempt(ScriptedProvider(answering), label="B"),
        ]

    saved: list[str] = []
    request = TurnRequest(USER, turn_id="turn-4")
    first = asyncio.run(
        run_generation_turn(
            chain(),
            [weather.tool()],
            RecordingChannel(),
            request,
            on_snapshot=lambda s: saved.append(snapshot_to_json(s)),
        )
    )
    assert first.status.value == "completed" and len(weather.runs) == 1
    snapshots = [snapshot_from_json(text) for text in saved]
    assert all(s.tier == "generation" for s in snapshots)
    # B's own stable point after its (reused) tool round: attempt 2, one pass done
    cut = next(
        s
        for s in snapshots
        if s.chain is not None
        and s.chain.attempts == 2
        and s.loop is not None
        and s.loop.iterations == 1
    )
    assert cut.chain is not None and [f.label for f in cut.chain.failures] == ["A"]
    resumed_chain = [
        Attempt(ScriptedProvider(failing), label="A"),
        Attempt(ScriptedProvider(answering[1:]), label="B"),
    ]
    resumed = asyncio.run(
        resume_generation_turn(cut, resumed_chain, [weather.tool()], RecordingChannel())
    )
    assert len(weather.runs) == 1
    assert (resumed.status, resumed.reason) == (first.status, first.reason)
    assert resumed.delivered_text == first.delivered_text
    assert [a.label for a in resumed.attempts] == ["A", "B"]
    assert [f.label for f in resumed.attempt_failures] == ["A"]


def test_resume_generation_turn_refuses_a_different_chain() -> None:
    saved: list[TurnSnapshot] = []
    asyncio.run(
        run_generation_turn(
            [Attempt(ScriptedProvider([[TextDelta("Hi")]]), label="A")],
            [],
            RecordingChannel(),
            TurnRequest(USER),
            on_snapshot=saved.append,
        )
    )
    other = [Attempt(ScriptedProvider([]), label="Z")]
    with pytest.raises(SnapshotError, match=r"chain\.labels"):
        asyncio.run(resume_generation_turn(saved[0], other, [], RecordingChannel()))


def test_a_cooling_key_keeps_the_cooldown_it_had_left_on_the_resuming_clock() -> None:
    rate_limited = [
        [Fail(ProviderError("slow down", kind="rate_limit", retryable=True, retry_after=30.0))]
    ]
    saved: list[TurnSnapshot] = []

    def chain(first: list[list[Any]]) -> list[Attempt]:
        return [
            Attempt(lambda _key: ScriptedProvider(first), keys=("k-1", "k-2"), label="A"),
            Attempt(ScriptedProvider([[TextDelta("Hi")]]), label="B"),
        ]

    policy = TurnPolicy(max_key_attempts_per_model=2)
    asyncio.run(
        run_generation_turn(
            chain(rate_limited),
            [],
            RecordingChannel(),
            TurnRequest(USER),
            policy=policy,
            on_snapshot=saved.append,
        )
    )
    cut = saved[-1]
    assert cut.chain is not None and cut.chain.attempts >= 2
    clock = VirtualClock()
    book: dict[tuple[str, int], Any] = {}

    async def resume() -> GenerationTurnResult:
        await clock.sleep(1000.0)  # the resuming process's clock reads far later
        return await resume_generation_turn(
            cut,
            chain([[TextDelta("Hi")]]),
            [],
            RecordingChannel(),
            policy=policy,
            clock=clock,
            key_book=book,
        )

    asyncio.run(resume())
    cooled = book[("A", 0)]
    assert 1000.0 < cooled.cooldown_until <= 1030.0


# --------------------------------------------------------------------------- the JSON form
def _document() -> dict[str, Any]:
    weather = CountingTool()
    _, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    document: dict[str, Any] = json.loads(saved[1])
    return document


def test_a_snapshot_of_an_unknown_version_is_refused_naming_the_version() -> None:
    document = _document()
    document["version"] = 3
    with pytest.raises(SnapshotError, match="version: unknown snapshot version 3"):
        snapshot_from_json(json.dumps(document))


def test_text_that_is_not_json_is_refused_as_not_a_snapshot() -> None:
    with pytest.raises(SnapshotError, match="not JSON"):
        snapshot_from_json('{"version": 1, "loop": ')
    with pytest.raises(SnapshotError, match="a JSON object, got list"):
        snapshot_from_json("[1, 2]")
    with pytest.raises(SnapshotError, match="version: missing"):
        snapshot_from_json("{}")


def test_a_field_of_the_wrong_type_is_refused_naming_the_field() -> None:
    document = _document()
    document["loop"]["iterations"] = "1"  # a number written as text is not coerced
    with pytest.raises(SnapshotError, match=r"\$\.loop\.iterations") as raised:
        snapshot_from_json(json.dumps(document))
    assert "expected an integer, got str" in str(raised.value)
    document = _document()
    document["loop"]["delivered"][0]["text"] = 5
    with pytest.raises(SnapshotError, match=r"\$\.loop\.delivered\[0\]\.text"):
        snapshot_from_json(json.dumps(document))


def test_a_missing_or_unknown_field_is_refused_naming_it() -> None:
    document = _document()
    del document["loop"]["next_seq"]
    with pytest.raises(SnapshotError, match=r"next_seq"):
        snapshot_from_json(json.dumps(document))
    document = _document()
    document["loop"]["surprise"] = True
    with pytest.raises(SnapshotError, match=r"surprise"):
        snapshot_from_json(json.dumps(document))


def test_the_readmes_resume_example_runs_as_written(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Snapshots and resume") :]
    start = section.index("```python\n") + len("```python\n")
    script = tmp_path / "resume.py"
    script.write_text(section[start : section.index("\n```", start)], encoding="utf-8")
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "get_weather('Oslo') ran",
        "completed 'It is sunny in Oslo.' 1",
    ]


#: What a snapshot leaves out of the machines' state, each for a reason: the current pass
#: (its text and buffer, and its record) and the tool round in progress (a resumed turn
#: restarts the pass), the deadlines, the step bookkeeping, the ending (a stable point is not
#: an ending), and what the host passes again (policy, tools, plans). A field added to the
#: state must be captured or listed here; a record the snapshot holds flat (`_LOOP_FLAT`) has
#: every field captured.
_LOOP_LEFT_OUT = {
    "armed",
    "buffer_len",
    "buffer_start",
    "current_event",
    "current_pass",
    "effects",
    "error_message",
    "flush_chars",
    "next_token",
    "pass_text",
    "policy",
    "provider_error_kind",
    "provider_error_retryable",
    "provider_retry_after",
    "reason",
    "registry",
    "settle_started",
    "snapshots",
    "state",
    "status",
    "step_time",
    "stop_message",
    "tool_round",
    # decided as each pass opens (a snapshot is taken before a pass): the limit's count and
    # the pass number it is decided from are kept
    "tools_withdrawn",
    # what the current pass may write under a budget (decided as it opens), and the ceiling
    # a turn reached (set only as it ends)
    "write_room",
    "budget_exceeded",
    # caches the engine rebuilds on first use: the offered tools and their specs, the usage
    # estimate's running count (a resumed turn counts afresh)
    "allowed_tools",
    "offered_specs",
    "read_count",
}
#: The run state's records a snapshot holds field by field, under the fields' own names.
_LOOP_FLAT = {"deliveries", "produced"}
_CHAIN_LEFT_OUT = {
    # what a turn paused for approval hands over: its snapshot holds the chain before it
    "approval",
    "current_event",
    "effects",
    "last",
    "plans",
    "policy",
    "reason",
    "shared_plans",
    "state",
    "status",
    "step_time",
    "stop_message",
    "tool_specs",
    "unreachable",
}


def test_a_snapshot_captures_every_field_of_the_state_it_does_not_leave_out_on_purpose() -> None:
    import attrs

    from toolloop_fsm.snapshot import ChainSnapshot
    from toolloop_fsm.snapshot import DraftSnapshot
    from toolloop_fsm.snapshot import LoopSnapshot
    from toolloop_fsm.turn import Deliveries
    from toolloop_fsm.turn import DraftState
    from toolloop_fsm.turn import GenerationState
    from toolloop_fsm.turn import Produced
    from toolloop_fsm.turn import TurnState

    def names(cls: type) -> set[str]:
        return {f.name for f in attrs.fields(cls)}

    assert names(DraftState) - names(DraftSnapshot) == set()
    assert names(TurnState) - names(LoopSnapshot) == _LOOP_LEFT_OUT | _LOOP_FLAT
    for record in (Deliveries, Produced):
        assert names(record) - names(LoopSnapshot) == set(), record
    assert names(GenerationState) - names(ChainSnapshot) == _CHAIN_LEFT_OUT


# --------------------------------------------------------------------------- untrusted text
def test_a_deeply_nested_snapshot_is_refused_as_a_snapshot_error() -> None:
    """Nesting far past any snapshot's own is refused before it is parsed (Python's parser
    would exhaust the stack on it), as deep arrays and deep objects alike."""
    text = json.dumps(_document())
    for deep in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        hostile = text.replace('"thought_log": ""', f'"thought_log": {deep}', 1)
        assert hostile != text
        with pytest.raises(SnapshotError, match="nested deeper than"):
            snapshot_from_json(hostile)


def test_a_string_where_a_list_of_strings_belongs_is_refused_not_split_into_characters() -> None:
    for name in ("scene_metadata", "disabled_tools", "tools"):
        document = _document()
        document["loop"][name] = "abc"
        with pytest.raises(SnapshotError, match=rf"\$\.loop\.{name}\b") as raised:
            snapshot_from_json(json.dumps(document))
        assert "expected a list, got str" in str(raised.value)
    document = _document()
    document["loop"]["ledger"] = ["a", "b"]  # a mapping is an object, never a list
    with pytest.raises(SnapshotError, match=r"expected an object, got list @ \$\.loop\.ledger"):
        snapshot_from_json(json.dumps(document))


def test_a_string_where_a_list_of_records_belongs_costs_memory_bounded_by_its_size() -> None:
    """Each character of the string used to be read as a record of its own, every failure
    kept (a 1 MB snapshot took 4 GB): the string is refused at once, with one short
    message."""
    import tracemalloc

    document = _document()
    snapshot_from_json(json.dumps(document))  # the converter builds its hooks once, first
    document["loop"]["delivered"] = "x" * 20_000
    text = json.dumps(document)
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match=r"\$\.loop\.delivered") as raised:
            snapshot_from_json(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * len(text)
    assert len(str(raised.value)) <= MAX_SNAPSHOT_ERROR_CHARS


def test_many_wrong_elements_give_a_bounded_list_of_problems() -> None:
    document = _document()
    document["loop"]["delivered"] = [1] * 10_000 + [{"seq": "x"}] * 10_000
    with pytest.raises(SnapshotError, match=r"\$\.loop\.delivered\[0\]") as raised:
        snapshot_from_json(json.dumps(document))
    message = str(raised.value)
    assert "stopped reading after 3 bad elements (3 of 20000 read)" in message
    assert len(message) <= MAX_SNAPSHOT_ERROR_CHARS
    # a document wrong everywhere: the first problems, and how many more there are
    document = _document()
    wrong = (
        "iterations dispatches next_seq follow_ups_cleared consecutive_tool_errors "
        "continuation_failures thought_log last_text suppress_text continuation_style "
        "hold_timeout_notice prefill"
    )
    for name in wrong.split():
        document["loop"][name] = [[["wrong"]]]
    with pytest.raises(SnapshotError, match=r"and 2 further problems not listed") as raised:
        snapshot_from_json(json.dumps(document))
    assert len(str(raised.value)) <= MAX_SNAPSHOT_ERROR_CHARS


def test_a_snapshot_larger_than_the_size_limit_is_refused_before_it_is_parsed() -> None:
    text = json.dumps(_document())
    with pytest.raises(SnapshotError, match=rf"larger than the limit of {len(text) - 1}"):
        snapshot_from_json(text, max_size=len(text) - 1)
    assert snapshot_from_json(text, max_size=len(text)).loop is not None
    padded = text.replace('"thought_log": ""', '"thought_log": "' + "y" * MAX_SNAPSHOT_SIZE + '"')
    with pytest.raises(SnapshotError, match="larger than the limit"):
        snapshot_from_json(padded)
    with pytest.raises(SnapshotError, match="larger than the limit"):
        snapshot_from_json(padded.encode("utf-8"))


# --------------------------------------------------------------------------- what resume keeps
def _drafted_cut() -> tuple[TurnSnapshot, list[list[ScriptItem]]]:
    """A drafted turn cut before its second pass, its prose held for review."""
    passes: list[list[ScriptItem]] = [
        [TextDelta("Checking. "), FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("Sunny in Oslo.")],
    ]
    saved: list[TurnSnapshot] = []
    asyncio.run(
        run_tool_loop(
            ScriptedProvider(passes),
            [CountingTool().tool()],
            RecordingChannel(),
            TurnRequest(USER),
            policy=LoopPolicy(drafting=True),
            reviewer=ScriptedReviewer(),
            on_snapshot=saved.append,
        )
    )
    cut = snapshot_from_json(snapshot_to_json(saved[-1]))
    assert cut.loop is not None and cut.loop.draft is not None and cut.loop.draft.segments
    return cut, passes


def test_a_drafted_turn_resumed_with_a_policy_without_drafting_is_refused_naming_the_field() -> (
    None
):
    cut, passes = _drafted_cut()
    channel = RecordingChannel()
    with pytest.raises(SnapshotError, match=r"policy\.drafting: .*True.*False"):
        asyncio.run(
            resume_tool_loop(
                cut,
                ScriptedProvider(passes[1:]),
                [CountingTool().tool()],
                channel,
                policy=LoopPolicy(),
            )
        )
    assert channel.texts == []  # refused before anything was sent


def test_resume_refuses_a_ceiling_or_budget_other_than_the_one_the_turn_counted_against() -> None:
    weather = CountingTool()
    _, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    cut = snapshot_from_json(saved[1])
    for changed, field in [
        (LoopPolicy(delivery_flush_chars=50), "delivery_flush_chars"),
        (attrs.evolve(SMALL_FLUSH, max_function_call_iterations=1), "max_function_call_iterations"),
        (attrs.evolve(SMALL_FLUSH, memory_tool_name="remember"), "memory_tool_name"),
        (attrs.evolve(SMALL_FLUSH, review_tool_calls=True), "review_tool_calls"),
    ]:
        with pytest.raises(SnapshotError, match=rf"policy\.{field}: "):
            asyncio.run(
                resume_tool_loop(
                    cut,
                    ScriptedProvider([]),
                    [weather.tool()],
                    RecordingChannel(),
                    policy=changed,
                    reviewer=ScriptedReviewer(),
                )
            )


def test_resume_refuses_a_tool_whose_follow_up_or_replay_setting_changed() -> None:
    weather = CountingTool()
    _, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    cut = snapshot_from_json(saved[1])
    for changed, setting in [
        (attrs.evolve(weather.tool(), replay="rerun"), "replay"),
        (attrs.evolve(weather.tool(), requires_follow_up=False), "requires_follow_up"),
    ]:
        with pytest.raises(SnapshotError, match=rf"tools\.get_weather\.{setting}: "):
            asyncio.run(
                resume_tool_loop(
                    cut, ScriptedProvider([]), [changed], RecordingChannel(), policy=SMALL_FLUSH
                )
            )
    assert len(weather.runs) == 1


def test_a_resume_with_longer_time_budgets_and_a_new_tool_continues_the_turn() -> None:
    """Time budgets are the resuming process's; a tool the snapshot did not name may be
    added; a tool's timeout, description and schema may change."""
    weather = CountingTool()
    first, saved = asyncio.run(_run_with_snapshots(weather_passes(), weather, RecordingChannel()))
    patient = attrs.evolve(
        SMALL_FLUSH,
        tool_timeout=900.0,
        inactivity_timeout=600.0,
        host_call_timeout=90.0,
        cancel_grace=5.0,
        max_pass_duration=1800.0,
        review_timeout=300.0,
    )
    tools = [
        attrs.evolve(weather.tool(), timeout=60.0, description="The forecast for a city"),
        Tool("get_time", "The time", {"type": "object"}, lambda _a, _c: ToolResult(data="noon")),
    ]
    resumed = asyncio.run(
        resume_tool_loop(
            snapshot_from_json(saved[1]),
            ScriptedProvider(weather_passes()[1:]),
            tools,
            RecordingChannel(),
            policy=patient,
        )
    )
    assert (resumed.status, resumed.reason) == (first.status, first.reason)
    assert resumed.final_text == "It is sunny in Oslo today."
    assert len(weather.runs) == 1


def test_a_generation_turn_resumed_with_another_turn_policy_is_refused_naming_the_field() -> None:
    saved: list[TurnSnapshot] = []
    policy = TurnPolicy(loop=LoopPolicy(drafting=True))
    asyncio.run(
        run_generation_turn(
            [Attempt(ScriptedProvider([[TextDelta("Hi")]]), label="A")],
            [],
            RecordingChannel(),
            TurnRequest(USER),
            policy=policy,
            reviewer=ScriptedReviewer(),
            on_snapshot=saved.append,
        )
    )
    for changed, field in [
        (TurnPolicy(), r"policy\.loop\.drafting"),
        (attrs.evolve(policy, max_key_attempts_per_model=1), "policy.max_key_attempts_per_model"),
        (attrs.evolve(policy, allow_shared_route=False), "policy.allow_shared_route"),
    ]:
        for cut in saved:
            with pytest.raises(SnapshotError, match=rf"{field}: "):
                asyncio.run(
                    resume_generation_turn(
                        cut,
                        [Attempt(ScriptedProvider([]), label="A")],
                        [],
                        RecordingChannel(),
                        policy=changed,
                        reviewer=ScriptedReviewer(),
                    )
                )
    # the cooldowns are the resuming host's: a different one resumes
    cooler = attrs.evolve(policy, rate_limit_cooldown=5.0, failure_cooldown=10.0)
    resumed = asyncio.run(
        resume_generation_turn(
            saved[-1],
            [Attempt(ScriptedProvider([[TextDelta("Hi")]]), label="A")],
            [],
            RecordingChannel(),
            policy=cooler,
            reviewer=ScriptedReviewer(),
        )
    )
    assert resumed.status.value == "completed"
