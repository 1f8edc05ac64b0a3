"""Drafting and the tool checkpoint, case by case (docs/behaviour.md §8): prose is held until
a reviewer passed it, one revision replaces it, the held-prose ceiling cuts a pass (and
aborts its request), a stop discards what is held, and a tool call can be rejected before it
runs. Each test names what a user of a drafting bot would notice."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import Turn
from tests.inner_kit import make_tool
from tests.inner_kit import scripted_turn
from tests.inner_kit import succeeds
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import Attempt
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers import OpenAICompatibleProvider
from toolloop_fsm.providers._history import tool_response_payload
from toolloop_fsm.review import CandidateStatus
from toolloop_fsm.review import Finding
from toolloop_fsm.review import Pass
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import ReviewUsage
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.review import Verdict
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing.hostile import RogueBaseException
from toolloop_fsm.testing.reviewer import Hang
from toolloop_fsm.testing.reviewer import Raise
from toolloop_fsm.testing.reviewer import ReviewerAct
from toolloop_fsm.testing.reviewer import ScriptedReviewer

DRAFTING = LoopPolicy(drafting=True)
CHECKPOINT = LoopPolicy(review_tool_calls=True)
VOICE = Finding("voice", "the reply is flat", "answer warmly, in one sentence")


class WatchingReviewer(ScriptedReviewer):
    """A scripted reviewer that also notes what the channel had received when it was asked."""

    def __init__(self, channel: RecordingChannel, acts: Sequence[ReviewerAct] = (), **kw: Any):
        super().__init__(acts, **kw)
        self.channel = channel
        self.delivered_when_asked: list[int] = []

    async def review(self, packet: ReviewPacket) -> Verdict:
        self.delivered_when_asked.append(len(self.channel.delivered))
        return await super().review(packet)


async def _run(
    turn: Turn,
    tools: Sequence[Tool],
    acts: Sequence[ReviewerAct],
    *,
    policy: LoopPolicy = DRAFTING,
    at: Sequence[tuple[float, Callable[[TurnSignals], None]]] = (),
) -> tuple[GenerationTurnResult, WatchingReviewer]:
    reviewer = WatchingReviewer(turn.channel, acts, clock=turn.clock)
    for when, act in at:
        turn.clock.call_later(when, lambda act=act: act(turn.signals))
    result = await run_tool_loop(
        turn.provider,
        tools,
        turn.channel,
        TurnRequest(USER),
        policy=policy,
        signals=turn.signals,
        clock=turn.clock,
        reviewer=reviewer,
    )
    turn.result = result
    return result, reviewer


def _texts(turn: Turn) -> list[str]:
    return [text for text in turn.channel.texts]


# --------------------------------------------------------------------------- off means today
async def test_with_drafting_off_the_reviewer_is_never_asked_and_text_streams() -> None:
    turn = scripted_turn([[TextDelta("It is sunny.")]])
    result, reviewer = await _run(turn, [], [Revise([VOICE])], policy=LoopPolicy())
    assert reviewer.packets == []
    assert result.status is TurnStatus.COMPLETED and result.reason is None
    assert _texts(turn) == ["It is sunny."]
    assert result.reviews == ()


async def test_drafting_without_a_reviewer_is_refused_naming_the_switch() -> None:
    turn = scripted_turn([[TextDelta("hi")]])
    with pytest.raises(ValueError, match=r"LoopPolicy\.drafting is on.*reviewer="):
        await run_tool_loop(turn.provider, [], turn.channel, TurnRequest(USER), policy=DRAFTING)
    with pytest.raises(ValueError, match=r"review_tool_calls is on"):
        await run_tool_loop(turn.provider, [], turn.channel, TurnRequest(USER), policy=CHECKPOINT)


# --------------------------------------------------------------------------- held, then shown
async def test_nothing_is_shown_until_the_reviewer_passes_the_reply() -> None:
    turn = scripted_turn([[TextDelta("It is "), TextDelta("sunny in Paris.")]])
    result, reviewer = await _run(turn, [], [Pass()])
    assert reviewer.delivered_when_asked == [0]
    assert _texts(turn) == ["It is sunny in Paris."]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "draft_passed")
    assert result.final_text == "It is sunny in Paris."
    (packet,) = reviewer.packets
    assert packet.kind is ReviewKind.RESPONSE
    assert packet.candidate == "It is sunny in Paris."
    assert packet.status is CandidateStatus.PENDING
    assert packet.trigger == "completed_pass"
    assert packet.history == tuple(USER[-2:])


async def test_pre_tool_narration_stays_pending_and_joins_the_final_candidate() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Let me look. "), FunctionCall("get_weather", {"city": "Paris"})],
            [TextDelta("It is 21 °C.")],
        ]
    )
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result, reviewer = await _run(turn, [tool], [Pass()])
    assert reviewer.delivered_when_asked == [0]
    assert reviewer.packets[0].candidate == "Let me look. It is 21 °C."
    assert [t.name for t in reviewer.packets[0].tools] == ["get_weather"]
    assert reviewer.packets[0].tools[0].success is True
    assert "".join(_texts(turn)) == "Let me look. It is 21 °C."
    assert result.final_text == "Let me look. It is 21 °C."


async def test_a_tool_only_turn_is_completed_without_inventing_prose_or_a_review() -> None:
    turn = scripted_turn([[FunctionCall("send_sticker", {})], []])
    tool = make_tool("send_sticker", turn.executions, turn.clock, requires_follow_up=False)
    result, reviewer = await _run(turn, [tool], [Revise([VOICE])])
    assert reviewer.packets == []
    assert _texts(turn) == []
    assert turn.executions.names() == ["send_sticker"]
    assert result.final_text == ""


async def test_the_reviewer_sees_arguments_through_the_tools_redaction_hook() -> None:
    turn = scripted_turn(
        [[FunctionCall("login", {"user": "ann", "password": "hunter2"})], [TextDelta("Done.")]]
    )

    def hide(arguments: Any) -> dict[str, Any]:
        return {**arguments, "password": "***"}

    tool = make_tool("login", turn.executions, turn.clock, succeeds(data="ok"), redact=hide)
    _result, reviewer = await _run(turn, [tool], [Pass()])
    assert reviewer.packets[0].tools[0].arguments == {"user": "ann", "password": "***"}
    assert "hunter2" not in repr(reviewer.packets[0])


# --------------------------------------------------------------------------- one revision
async def test_a_first_revise_asks_for_a_complete_replacement_that_is_then_shown() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Checking. "), FunctionCall("get_weather", {"city": "Paris"})],
            [TextDelta("21 degrees.")],
            [FunctionCall("get_weather", {"city": "Paris"})],  # repeated: reused, not re-run
            [TextDelta("It's a lovely 21 °C in Paris today!")],
        ]
    )
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result, reviewer = await _run(turn, [tool], [Revise([VOICE]), Pass()])
    assert _texts(turn) == ["It's a lovely 21 °C in Paris today!"]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "draft_passed")
    assert turn.executions.names() == ["get_weather"]  # the revision never re-ran the tool
    assert result.tool_dispatches == 1
    # the replacement was asked for with one user instruction carrying the draft and findings
    revision_request = turn.provider.requests[2]
    instruction = revision_request.context[-1]
    assert instruction["role"] == "user"
    assert "Checking. 21 degrees." in instruction["content"]
    assert "the reply is flat" in instruction["content"]
    assert sum(1 for m in revision_request.context if m.get("role") == "user") == 2
    # every actual tool outcome is kept; the model's own narration is cleared
    (entry,) = revision_request.history
    assert entry.response.success and entry.response.data == {
        "ok": True,
        "args": {"city": "Paris"},
    }
    assert entry.pre_tool_text is None
    assert reviewer.packets[1].revision.revisions_done == 1
    assert reviewer.packets[1].revision.previous_findings == (VOICE,)
    assert [r.verdict for r in result.reviews] == ["revise", "pass"]


async def test_a_second_revise_delivers_the_replacement_as_it_is() -> None:
    turn = scripted_turn([[TextDelta("Draft one.")], [TextDelta("Draft two.")]])
    result, reviewer = await _run(turn, [], [Revise([VOICE]), Revise([VOICE])])
    assert _texts(turn) == ["Draft two."]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "revisions_exhausted")
    assert len(reviewer.packets) == 2
    assert reviewer.delivered_when_asked == [0, 0]


async def test_an_unavailable_reviewer_lets_the_reply_through_and_is_not_asked_again() -> None:
    turn = scripted_turn([[TextDelta("Hello there.")]])
    result, _reviewer = await _run(turn, [], [Unavailable("refusal")])
    assert _texts(turn) == ["Hello there."]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "draft_unreviewed")
    assert result.reviews[0].reason == "refusal"


async def test_a_reviewer_that_raises_counts_as_unavailable() -> None:
    turn = scripted_turn([[TextDelta("Hello there.")]])
    result, _reviewer = await _run(turn, [], [Raise(RuntimeError("model down"))])
    assert _texts(turn) == ["Hello there."]
    assert result.reason == "draft_unreviewed"
    assert result.reviews[0].reason == "raised RuntimeError"


#: What a hostile reviewer raises instead of answering: a host library's own
#: `BaseException` subclass, and `GeneratorExit` (a closed client's generator).
REVIEWER_BASE_EXCEPTIONS = pytest.mark.parametrize(
    "raised",
    [RogueBaseException("the review service's quota is used up"), GeneratorExit("closed")],
    ids=["custom BaseException", "GeneratorExit"],
)


@REVIEWER_BASE_EXCEPTIONS
async def test_a_reviewer_raising_a_base_exception_lets_the_drafted_reply_through(
    raised: BaseException,
) -> None:
    turn = scripted_turn([[TextDelta("Hello there.")]])
    result, _reviewer = await _run(turn, [], [Raise(raised)])
    assert _texts(turn) == ["Hello there."]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "draft_unreviewed")
    assert result.reviews[0].reason == f"raised {type(raised).__name__}"


@REVIEWER_BASE_EXCEPTIONS
async def test_a_checkpoint_reviewer_raising_a_base_exception_lets_the_call_run(
    raised: BaseException,
) -> None:
    turn = scripted_turn([[_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, _ = await _run(turn, [tool], [Raise(raised)], policy=CHECKPOINT)
    assert turn.executions.names() == ["delete_file"]
    assert result.status is TurnStatus.COMPLETED
    assert result.reviews[0].reason == f"raised {type(raised).__name__}"


async def test_a_reviewer_that_never_answers_times_out_and_the_reply_is_delivered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    turn = scripted_turn([[TextDelta("Hello there.")]])
    policy = LoopPolicy(drafting=True, review_timeout=30.0)
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result, _reviewer = await _run(turn, [], [Hang()], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "review_timeout")
    assert _texts(turn) == ["Hello there."]
    assert turn.clock.now() == pytest.approx(30.0)
    assert "the reviewer did not answer within 30 s" in caplog.text
    assert "provider" not in caplog.text


async def test_reviews_are_spent_after_two_so_a_later_completion_is_delivered_unreviewed() -> None:
    turn = scripted_turn([[TextDelta("One.")], [TextDelta("Two.")]])
    policy = LoopPolicy(drafting=True, max_reviews=1)
    result, reviewer = await _run(turn, [], [Revise([VOICE])], policy=policy)
    assert len(reviewer.packets) == 1
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "reviews_exhausted")
    assert _texts(turn) == ["Two."]


# --------------------------------------------------------------------------- the ceiling
async def test_a_pass_reaching_the_held_prose_ceiling_is_cut_and_reviewed_as_cut() -> None:
    words = [TextDelta("word ") for _ in range(200)]  # 1,000 bytes offered
    turn = scripted_turn([words])
    policy = LoopPolicy(drafting=True, held_prose_max_bytes=64, delivery_flush_chars=10)
    result, reviewer = await _run(turn, [], [Revise([VOICE])], policy=policy)
    (packet,) = reviewer.packets
    assert packet.status is CandidateStatus.PENDING_CUT_AT_LENGTH_LIMIT
    assert packet.trigger == "length_limit"
    delivered = "".join(_texts(turn))
    assert delivered == ("word " * 13)[:64]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "cut_at_length_limit")
    assert [n.key for n in result.notices] == ["flush_limit"]
    # the provider's stream was closed long before it ran out
    assert turn.provider.streams_closed == 1
    assert result.stream_results[0].outcome == "cut_at_length_limit"
    # no usage was reported: the cut pass records an estimate, marked
    (usage,) = result.usage.entries
    assert usage.estimated and usage.source == "author"


async def test_a_reply_of_exactly_the_held_prose_ceiling_is_held_whole_and_not_cut() -> None:
    turn = scripted_turn([[TextDelta("0123456789"), TextDelta("abcdefghij")]])  # 20 bytes
    policy = LoopPolicy(drafting=True, held_prose_max_bytes=20, delivery_flush_chars=10)
    result, reviewer = await _run(turn, [], [Pass()], policy=policy)
    (packet,) = reviewer.packets
    assert packet.status is not CandidateStatus.PENDING_CUT_AT_LENGTH_LIMIT
    assert "".join(_texts(turn)) == "0123456789abcdefghij"
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "draft_passed")
    assert [n.key for n in result.notices] == []  # no flush_limit notice


async def test_a_cut_never_splits_a_character() -> None:
    turn = scripted_turn([[TextDelta("é" * 40)]])  # 2 bytes each
    policy = LoopPolicy(drafting=True, held_prose_max_bytes=11)
    result, _ = await _run(turn, [], [Pass()], policy=policy)
    assert "".join(_texts(turn)) == "é" * 5
    assert result.final_text == "é" * 5


async def test_the_segment_ceiling_cuts_too() -> None:
    turn = scripted_turn([[TextDelta("ab") for _ in range(50)]])
    policy = LoopPolicy(drafting=True, held_prose_max_segments=3, delivery_flush_chars=2)
    result, _ = await _run(turn, [], [Pass()], policy=policy)
    assert _texts(turn) == ["ab", "ab", "ab"]
    assert result.reason == "cut_at_length_limit"


async def test_a_cut_by_the_hosts_own_send_limit_is_delivered_silently() -> None:
    turn = scripted_turn([[TextDelta("word ") for _ in range(100)]])
    policy = LoopPolicy(drafting=True, send_message_limit=20, delivery_flush_chars=5)
    result, _ = await _run(turn, [], [Pass()], policy=policy)
    assert "".join(_texts(turn)) == ("word " * 4)
    assert result.notices == ()


async def test_the_ceiling_is_shared_by_every_pass_of_the_turn() -> None:
    turn = scripted_turn(
        [
            [TextDelta("0123456789"), FunctionCall("get_weather", {})],
            [TextDelta("abcdefghij" * 3)],
        ]
    )
    tool = make_tool("get_weather", turn.executions, turn.clock)
    policy = LoopPolicy(drafting=True, held_prose_max_bytes=25, delivery_flush_chars=5)
    result, _ = await _run(turn, [tool], [Pass()], policy=policy)
    assert "".join(_texts(turn)) == "0123456789abcdefghijabcde"
    assert result.reason == "cut_at_length_limit"


async def test_a_cut_pass_aborts_its_http_request_and_the_server_sees_the_disconnect() -> None:
    server = WireServer()
    await server.start()
    try:
        events = [
            b"data: "
            + json.dumps(
                {"choices": [{"index": 0, "delta": {"content": f"chunk {i:03d} "}}]}
            ).encode()
            + b"\n\n"
            for i in range(400)
        ]
        # the server streams 400 chunks, then keeps the response open until the client goes
        server.serve(Scripted(chunks=tuple(events), stall_after=len(events)))
        provider = OpenAICompatibleProvider(server.url + "/v1", "m")
        channel = RecordingChannel()
        reviewer = ScriptedReviewer([Pass()])
        policy = LoopPolicy(drafting=True, held_prose_max_bytes=100, delivery_flush_chars=20)
        result = await run_tool_loop(
            provider, [], channel, TurnRequest(USER), policy=policy, reviewer=reviewer
        )
        await server.client_gone.wait()
        assert result.reason == "cut_at_length_limit"
        assert len("".join(channel.texts).encode()) == 100
        # the request was aborted long before the server could send what it had
        assert server.body_bytes_sent < sum(len(e) for e in events)
    finally:
        await server.close()


# --------------------------------------------------------------------------- stop, follow-up
async def test_a_stop_during_the_review_discards_the_held_reply_and_queues_the_message() -> None:
    turn = scripted_turn([[TextDelta("Something long.")]])
    result, _ = await _run(
        turn, [], [Hang()], at=[(5.0, lambda s: s.request_stop("stopped, sorry"))]
    )
    assert (result.status, result.reason) == (TurnStatus.STOPPED_BY_USER, "stopped_during_review")
    assert _texts(turn) == []
    assert turn.channel.queued_front == ["stopped, sorry"]
    assert result.final_text == ""
    assert result.undelivered_text == "Something long."


async def test_a_stop_while_streaming_a_draft_sends_nothing_held() -> None:
    turn = scripted_turn([[TextDelta("First part. "), Pause(10), TextDelta("Second part.")]])
    result, reviewer = await _run(turn, [], [Pass()], at=[(5.0, lambda s: s.request_stop())])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert _texts(turn) == []
    assert reviewer.packets == []


async def test_a_follow_up_during_the_review_interrupts_and_sends_nothing() -> None:
    turn = scripted_turn([[TextDelta("A reply.")]])
    result, _ = await _run(turn, [], [Hang()], at=[(1.0, lambda s: s.follow_up())])
    assert result.status is TurnStatus.FOLLOW_UP_INTERRUPT
    assert _texts(turn) == []


# --------------------------------------------------------------------------- usage
async def test_usage_is_recorded_per_role_author_and_reviewer() -> None:
    turn = scripted_turn([[TextDelta("Hi."), UsageReport(10, 2)]])
    verdict = Pass(usage=ReviewUsage(300, 12))
    result, _ = await _run(turn, [], [verdict])
    assert [(e.source, e.input_tokens, e.output_tokens) for e in result.usage.entries] == [
        ("author", 10, 2),
        ("reviewer", 300, 12),
    ]


# --------------------------------------------------------------------------- secrets
async def test_a_conversation_holding_an_api_key_is_never_shown_to_the_reviewer() -> None:
    """The model's own text is masked of the keys as it streams (tests/test_echoed_keys.py);
    the conversation the host passed in is not the engine's to rewrite, so a packet quoting
    a key from it is not shown at all."""
    key = "sk-live-0123456789abcdef"
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("I will not repeat it.")]], clock=clock)
    channel = RecordingChannel(clock=clock)
    reviewer = ScriptedReviewer([Revise([VOICE])])
    result = await run_generation_turn(
        [Attempt(lambda _key: provider, keys=(key,), label="m")],
        [],
        channel,
        TurnRequest([{"role": "user", "content": f"my key is {key}"}]),
        policy=TurnPolicy(loop=DRAFTING),
        clock=clock,
        reviewer=reviewer,
    )
    assert reviewer.packets == []
    assert result.reviews[0].verdict == "unavailable"
    assert result.reviews[0].reason == "secret"


# --------------------------------------------------------------------------- fallback
async def test_review_budgets_are_shared_by_the_attempts_of_a_generation_turn() -> None:
    clock = VirtualClock()
    first = ScriptedProvider(
        [
            [TextDelta("Draft.")],
            [Fail(ProviderError("overloaded", kind="server", retryable=True))],
        ],
        clock=clock,
    )
    second = ScriptedProvider([[TextDelta("Second model's reply.")]], clock=clock)
    channel = RecordingChannel(clock=clock)
    reviewer = ScriptedReviewer([Revise([VOICE]), Revise([VOICE])])
    result = await run_generation_turn(
        [Attempt(first, label="first"), Attempt(second, label="second")],
        [],
        channel,
        TurnRequest(USER),
        policy=TurnPolicy(loop=DRAFTING),
        clock=clock,
        reviewer=reviewer,
    )
    # the revision was spent by the first attempt: the second's Revise delivers as it is
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "revisions_exhausted")
    assert channel.texts == ["Second model's reply."]
    assert [r.verdict for r in result.reviews] == ["revise", "revise"]


async def test_a_fallback_keeps_the_function_history_and_the_narration_held_before_it() -> None:
    clock = VirtualClock()
    executions = Executions()
    tool = make_tool("get_weather", executions, clock)
    first = ScriptedProvider(
        [
            [TextDelta("Let me look. "), FunctionCall("get_weather", {"city": "Paris"})],
            [
                TextDelta("It is wa"),
                Fail(ProviderError("overloaded", kind="server", retryable=True)),
            ],
        ],
        clock=clock,
    )
    second = ScriptedProvider([[TextDelta("It is 21 °C.")]], clock=clock)
    channel = RecordingChannel(clock=clock)
    reviewer = ScriptedReviewer([Pass()])
    result = await run_generation_turn(
        [Attempt(first, label="first"), Attempt(second, label="second")],
        [tool],
        channel,
        TurnRequest(USER),
        policy=TurnPolicy(loop=DRAFTING),
        clock=clock,
        reviewer=reviewer,
    )
    # the second model saw the first's tool round; the failed pass's own text was dropped
    (entry,) = second.requests[0].history
    assert entry.call.name == "get_weather" and entry.response.success
    assert reviewer.packets[0].candidate == "Let me look. It is 21 °C."
    assert channel.texts == ["Let me look. ", "It is 21 °C."]
    assert executions.names() == ["get_weather"]
    assert result.reason == "draft_passed"


async def test_an_expression_held_by_a_failed_attempt_is_the_turns_one_expression() -> None:
    # the first model's sticker is held (drafting) and carried to the second model with its
    # tool round; the second model sends another: the reply still shows one expression
    clock = VirtualClock()

    async def sticker(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(expression=f"{arguments['name']}_sticker")

    tool = Tool("sticker", "send a sticker", {"type": "object"}, sticker)
    first = ScriptedProvider(
        [
            [FunctionCall("sticker", {"name": "cat"})],
            [Fail(ProviderError("overloaded", kind="server", retryable=True))],
        ],
        clock=clock,
    )
    second = ScriptedProvider(
        [[FunctionCall("sticker", {"name": "dog"})], [TextDelta("There you go!")]], clock=clock
    )
    channel = RecordingChannel(clock=clock)
    result = await run_generation_turn(
        [Attempt(first, label="first"), Attempt(second, label="second")],
        [tool],
        channel,
        TurnRequest(USER),
        policy=TurnPolicy(loop=DRAFTING),
        clock=clock,
        reviewer=ScriptedReviewer([Pass()]),
    )
    assert result.reason == "draft_passed"
    assert channel.expressions == ["cat_sticker"]
    assert [d.expression for d in result.delivered if d.expression] == ["cat_sticker"]
    assert channel.texts == ["There you go!"]


# --------------------------------------------------------------------------- the checkpoint
def _call(name: str = "delete_file", **arguments: Any) -> FunctionCall:
    return FunctionCall(name, arguments or {"path": "/tmp/a"})


async def test_an_approved_call_runs_after_its_review() -> None:
    turn = scripted_turn([[_call()], [TextDelta("Deleted.")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, reviewer = await _run(turn, [tool], [Pass()], policy=CHECKPOINT)
    assert turn.executions.names() == ["delete_file"]
    (packet,) = reviewer.packets
    assert packet.kind is ReviewKind.TOOL_CALL
    assert packet.proposed_call is not None
    assert packet.proposed_call.status == "not_executed"
    assert packet.proposed_call.arguments == {"path": "/tmp/a"}
    assert result.status is TurnStatus.COMPLETED


async def test_a_rejected_call_does_not_run_and_the_model_sees_why() -> None:
    turn = scripted_turn([[_call()], [TextDelta("I won't delete it.")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    finding = Finding("tool_use", "deleting is not asked for", "ask the user first")
    result, _ = await _run(turn, [tool], [Revise([finding])], policy=CHECKPOINT)
    assert turn.executions.names() == []
    (entry,) = result.history
    shown = tool_response_payload(entry.response)
    assert shown["success"] is False
    assert shown["status"] == "review_rejected"
    assert shown["action_executed"] is False
    assert shown["findings"] == [
        {
            "category": "tool_use",
            "problem": "deleting is not asked for",
            "direction": "ask the user first",
        }
    ]
    # a rejection is no failure: no failure notice is posted
    assert [n.key for n in turn.channel.notices] == []
    assert result.status is TurnStatus.COMPLETED


async def test_rejections_do_not_count_towards_the_consecutive_error_ceiling() -> None:
    calls = [[_call(path=f"/tmp/{i}")] for i in range(6)]
    turn = scripted_turn([*calls, [TextDelta("Giving up.")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    policy = LoopPolicy(review_tool_calls=True, max_consecutive_tool_errors=2)
    finding = Finding("tool_use", "no", "no")
    result, reviewer = await _run(turn, [tool], [Revise([finding])] * 3, policy=policy)
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.names() == []
    assert len(reviewer.packets) == 3  # the call and its two corrections; then no approval
    assert all(e.response.status == "review_rejected" for e in result.history)


async def test_an_identical_rejected_call_gets_the_same_rejection_without_a_new_review() -> None:
    turn = scripted_turn([[_call()], [_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, reviewer = await _run(turn, [tool], [Revise([VOICE])], policy=CHECKPOINT)
    assert len(reviewer.packets) == 1
    assert [e.response.status for e in result.history] == ["review_rejected"] * 2
    assert result.history[0].response == result.history[1].response


async def test_the_same_rejected_call_with_its_keys_in_another_order_is_not_reviewed_again() -> (
    None
):
    first = FunctionCall("delete_file", {"path": "/tmp/a", "options": {"force": True, "depth": 2}})
    reordered = FunctionCall(
        "delete_file", {"options": {"depth": 2, "force": True}, "path": "/tmp/a"}
    )
    turn = scripted_turn([[first], [reordered], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, reviewer = await _run(turn, [tool], [Revise([VOICE]), Pass()], policy=CHECKPOINT)
    assert len(reviewer.packets) == 1  # the second is the same call: the same rejection
    assert turn.executions.names() == []
    assert [e.response.status for e in result.history] == ["review_rejected"] * 2
    assert result.history[0].response == result.history[1].response


async def test_a_correction_consumes_one_of_two_and_an_approval_runs_it() -> None:
    turn = scripted_turn(
        [
            [_call(path="/etc/passwd")],
            [_call(path="/tmp/x")],
            [_call(path="/tmp/y")],
            [_call(path="/tmp/z")],
            [TextDelta("done")],
        ]
    )
    tool = make_tool("delete_file", turn.executions, turn.clock)
    no = Revise([Finding("tool_use", "not that file", "a temp file")])
    result, reviewer = await _run(turn, [tool], [no, no, Pass()], policy=CHECKPOINT)
    # first rejected, first correction rejected, second correction approved and run; the
    # name's chain is closed by the approval, so the next call is reviewed as a new call
    assert [p.proposed_call.correction for p in reviewer.packets if p.proposed_call] == [
        False,
        True,
        True,
        False,
    ]
    assert [args["path"] for _, args, _ in turn.executions.calls] == ["/tmp/y", "/tmp/z"]
    assert result.status is TurnStatus.COMPLETED


async def test_no_third_correction_is_reviewed_it_stays_rejected() -> None:
    passes = [[_call(path=f"/f{i}")] for i in range(4)]
    turn = scripted_turn([*passes, [TextDelta("stop")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    no = Revise([Finding("tool_use", "no", "no")])
    result, reviewer = await _run(turn, [tool], [no, no, no, Pass()], policy=CHECKPOINT)
    assert len(reviewer.packets) == 3  # the first call and two corrections
    assert turn.executions.names() == []
    assert len(result.history) == 4


async def test_eight_tool_reviews_make_the_checkpoint_unavailable_and_calls_run() -> None:
    passes = [[FunctionCall(f"tool_{i}", {})] for i in range(10)]
    turn = scripted_turn([*passes, [TextDelta("done")]])
    tools = [make_tool(f"tool_{i}", turn.executions, turn.clock) for i in range(10)]
    result, reviewer = await _run(turn, tools, [], policy=CHECKPOINT)
    assert len(reviewer.packets) == 8
    assert turn.executions.names() == [f"tool_{i}" for i in range(10)]
    assert result.status is TurnStatus.COMPLETED


async def test_an_unavailable_reviewer_cannot_approve_a_correction() -> None:
    turn = scripted_turn([[_call(path="/a")], [_call(path="/b")], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    no = Revise([Finding("tool_use", "no", "no")])
    result, _ = await _run(turn, [tool], [no, Unavailable("timeout")], policy=CHECKPOINT)
    assert turn.executions.names() == []
    assert [e.response.status for e in result.history] == ["review_rejected"] * 2


async def test_an_unavailable_checkpoint_lets_a_new_call_run() -> None:
    turn = scripted_turn([[_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, _ = await _run(turn, [tool], [Unavailable("malformed")], policy=CHECKPOINT)
    assert turn.executions.names() == ["delete_file"]
    assert result.reviews[0].reason == "malformed"


async def test_a_checkpoint_review_that_times_out_lets_the_call_run() -> None:
    turn = scripted_turn([[_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    policy = LoopPolicy(review_tool_calls=True, review_timeout=10.0)
    result, _ = await _run(turn, [tool], [Hang()], policy=policy)
    assert turn.executions.names() == ["delete_file"]
    assert result.reviews[0].reason == "timeout"


async def test_a_stop_during_a_checkpoint_review_runs_nothing() -> None:
    turn = scripted_turn([[_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, _ = await _run(
        turn, [tool], [Hang()], policy=CHECKPOINT, at=[(1.0, lambda s: s.request_stop())]
    )
    assert (result.status, result.reason) == (TurnStatus.STOPPED_BY_USER, "stopped_during_review")
    assert turn.executions.names() == []


async def test_a_follow_up_during_a_checkpoint_review_waits_for_the_verdict() -> None:
    turn = scripted_turn([[_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    clock = turn.clock
    from toolloop_fsm.testing.reviewer import Slow

    result, _ = await _run(
        turn,
        [tool],
        [Slow(5.0, Pass())],
        policy=CHECKPOINT,
        at=[(1.0, lambda s: s.follow_up())],
    )
    assert turn.executions.names() == ["delete_file"]
    assert result.status is TurnStatus.COMPLETED
    assert clock.now() >= 5.0


async def test_a_checkpoint_verdict_is_recorded_as_a_decision_call_in_the_usage() -> None:
    turn = scripted_turn([[_call()], [TextDelta("ok")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    result, _ = await _run(turn, [tool], [Pass(usage=ReviewUsage(50, 3))], policy=CHECKPOINT)
    assert ("decision", 50, 3) in [
        (e.source, e.input_tokens, e.output_tokens) for e in result.usage.entries
    ]


async def test_drafting_and_the_checkpoint_together_hold_the_narration_across_the_review() -> None:
    turn = scripted_turn([[TextDelta("I'll delete it. "), _call()], [TextDelta("It is gone.")]])
    tool = make_tool("delete_file", turn.executions, turn.clock)
    policy = LoopPolicy(drafting=True, review_tool_calls=True)
    result, reviewer = await _run(turn, [tool], [Pass(), Pass()], policy=policy)
    assert [p.kind for p in reviewer.packets] == [ReviewKind.TOOL_CALL, ReviewKind.RESPONSE]
    assert reviewer.packets[0].candidate == "I'll delete it. "
    assert reviewer.delivered_when_asked == [0, 0]
    assert "".join(_texts(turn)) == "I'll delete it. It is gone."
    assert result.reason == "draft_passed"


async def test_a_held_expression_is_delivered_in_its_place_with_the_approved_draft() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Here is the sun: "), FunctionCall("send_sticker", {})],
            [TextDelta("Enjoy!")],
        ]
    )
    tool = make_tool("send_sticker", turn.executions, turn.clock, succeeds(expression="sun"))
    result, reviewer = await _run(turn, [tool], [Pass()])
    assert reviewer.delivered_when_asked == [0]  # held until the reviewer passed it
    shown = [(d.text, d.expression) for d in turn.channel.delivered]
    assert shown == [("Here is the sun: ", None), (None, "sun"), ("Enjoy!", None)]
    assert [d.expression for d in result.delivered if d.expression] == ["sun"]
    assert result.reason == "draft_passed"


async def test_a_continuation_provider_gives_up_at_exactly_its_retry_budget_while_drafting() -> (
    None
):
    passes: list[list[ScriptItem]] = [
        [TextDelta(f"Part {i}. "), FunctionCall("lookup", {"i": i})] for i in range(4)
    ]
    turn = scripted_turn(passes, continuation_style=True)
    tool = make_tool("lookup", turn.executions, turn.clock, succeeds(success=False, message="no"))
    policy = LoopPolicy(drafting=True, continuation_tool_failure_threshold=2)
    result, reviewer = await _run(turn, [tool], [Pass()], policy=policy)
    assert len(turn.executions.calls) == 2  # the second failure in a row spends the budget
    (packet,) = reviewer.packets
    assert packet.trigger == "continuation_retries_exhausted"
    shown = [(n.key, n.params) for n in result.notices if not n.hidden]
    assert shown == [("retry_exhausted", {"failures": 2})]
    assert "".join(_texts(turn)) == "Part 0. "  # text after the first failure is suppressed
    assert result.status is TurnStatus.COMPLETED


async def test_an_expression_dropped_by_a_revision_does_not_count_as_shown() -> None:
    # found by the drafting property tests: the revision dropped the held sticker, yet the
    # empty pass after the replacement "settled" on it and the turn ended completed with
    # nothing delivered at all
    turn = scripted_turn([[FunctionCall("send_sticker", {})], [TextDelta("Nice weather.")], []])
    tool = make_tool(
        "send_sticker",
        turn.executions,
        turn.clock,
        succeeds(expression="sticker:sun"),
        requires_follow_up=False,
    )
    result, _ = await _run(turn, [tool], [Revise([VOICE])])
    assert turn.channel.delivered == []
    assert result.status is TurnStatus.EMPTY_RESPONSE
    assert result.reason is None


async def test_a_stop_while_drafting_reports_the_discarded_buffer_as_undelivered() -> None:
    turn = scripted_turn([[TextDelta("Held part. "), Pause(10), TextDelta("never")]])
    policy = LoopPolicy(drafting=True, delivery_flush_chars=1_000)
    result, _ = await _run(
        turn, [], [Pass()], policy=policy, at=[(5.0, lambda s: s.request_stop())]
    )
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.undelivered_text == "Held part. "
