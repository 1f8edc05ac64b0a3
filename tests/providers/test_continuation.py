"""ContinuationSession in real turns: a completion-style model that stops after a fragment is
continued, fragment by fragment, into one pass of the loop within one total output budget.

Every test runs a whole turn (`run_tool_loop`, or `run_generation_turn` for the fallback) on a
virtual clock, with a `ScriptedProvider` standing in for the completion model: each scripted
pass is one fragment, i.e. one request to the model.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from attrs import define
from attrs import field

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import make_tool
from tests.inner_kit import succeeds
from toolloop_fsm import Attempt
from toolloop_fsm import FinishKind
from toolloop_fsm import FinishReason
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import Tool
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers import ContinuationSession
from toolloop_fsm.providers import Provider
from toolloop_fsm.providers import VerbatimToolCalls
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing.scripted import ScriptItem

CUT = FinishReason(FinishKind.LENGTH, "length")
STOP = FinishReason(FinishKind.STOP, "stop")
# Deliver every chunk at once, so that "delivered" below means "streamed to the user".
EAGER = LoopPolicy(delivery_flush_chars=1)


@define
class Story:
    """A turn whose provider is a session over scripted fragments."""

    fragments: Sequence[Sequence[ScriptItem]]
    max_total_output: int = 1000
    max_fragments: int = 8
    clock: VirtualClock = field(factory=VirtualClock)
    signals: TurnSignals = field(factory=TurnSignals)
    executions: Executions = field(factory=Executions)
    model: ScriptedProvider = field(init=False)
    session: ContinuationSession = field(init=False)
    channel: RecordingChannel = field(init=False)

    def __attrs_post_init__(self) -> None:
        self.model = ScriptedProvider(self.fragments, clock=self.clock)
        self.session = ContinuationSession(
            self.model, max_total_output=self.max_total_output, max_fragments=self.max_fragments
        )
        self.channel = RecordingChannel(clock=self.clock)

    @property
    def requests(self) -> list[ProviderRequest]:
        return self.model.requests

    def tool(self, name: str, **options: Any) -> Tool:
        return make_tool(name, self.executions, self.clock, **options)

    async def run(
        self,
        tools: Sequence[Tool] = (),
        *,
        provider: Provider | None = None,
        request: TurnRequest | None = None,
        at: Sequence[tuple[float, Callable[[TurnSignals], None]]] = (),
    ) -> GenerationTurnResult:
        for when, act in at:
            self.clock.call_later(when, lambda act=act: act(self.signals))
        return await run_tool_loop(
            provider if provider is not None else self.session,
            tools,
            self.channel,
            request if request is not None else TurnRequest(USER),
            policy=EAGER,
            signals=self.signals,
            clock=self.clock,
        )


def entries(result: GenerationTurnResult) -> list[tuple[int, int, bool]]:
    return [(e.input_tokens, e.output_tokens, e.estimated) for e in result.usage.entries]


# --------------------------------------------------------------------------- fragments
async def test_fragments_cut_by_length_reach_the_user_as_one_pass_without_tools() -> None:
    story = Story(
        [
            [TextDelta("Once upon"), CUT],
            [TextDelta(" a time, a fox"), CUT],
            [TextDelta(" found a key."), STOP],
        ]
    )
    result = await story.run([story.tool("get_weather")])

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Once upon a time, a fox found a key."
    assert story.channel.delivered_text == "Once upon a time, a fox found a key."
    assert (result.iterations, result.tool_dispatches) == (1, 0)
    assert [(s.outcome, s.finish) for s in result.stream_results] == [
        ("completed", FinishKind.STOP)
    ]
    assert [r.prefill for r in story.requests] == [None, "Once upon", "Once upon a time, a fox"]
    # the turn has a tool, but a continuation model is never offered one
    assert [r.tools for r in story.requests] == [(), (), ()]


async def test_each_continuation_request_ends_with_the_text_so_far_after_the_hosts_prefill() -> (
    None
):
    story = Story([[TextDelta(" I woke"), CUT], [TextDelta(" late."), STOP]])
    result = await story.run(request=TurnRequest(USER, prefill="Dear diary,"))

    assert result.final_text == " I woke late."
    assert [r.prefill for r in story.requests] == ["Dear diary,", "Dear diary, I woke"]


async def test_scene_metadata_from_every_fragment_is_appended_to_the_final_text() -> None:
    story = Story(
        [
            [TextDelta("Rain fell."), SceneMetadata("a rainy street"), CUT],
            [TextDelta(" She ran."), SceneMetadata("night"), STOP],
        ]
    )
    result = await story.run()

    assert result.final_text == "Rain fell. She ran.\n\n[Scene Metadata]\na rainy street\nnight"
    assert story.requests[1].prefill == "Rain fell."  # the metadata is not part of the text


# --------------------------------------------------------------------------- the total budget
async def test_spending_the_total_budget_ends_the_pass_with_finish_length() -> None:
    ten = "x" * 48  # no fragment reports usage: each is estimated at 10 tokens
    assert estimate_tokens(ten) == 10
    story = Story([[TextDelta(ten), CUT]] * 4, max_total_output=25, max_fragments=10)
    result = await story.run()

    assert result.status is TurnStatus.COMPLETED
    assert result.stream_results[-1].finish is FinishKind.LENGTH
    assert story.channel.delivered_text == ten * 3
    # each request asks for no more than the budget left
    assert [r.max_output for r in story.requests] == [25, 15, 5]
    # one ledger entry for the pass, holding the three estimates, marked as estimated
    assert entries(result) == [(0, 30, True)]


async def test_reported_tokens_are_spent_and_summed_and_the_hosts_request_cap_is_kept() -> None:
    def fragment(text: str) -> list[ScriptItem]:
        return [TextDelta(text), UsageReport(input_tokens=12, output_tokens=6), CUT]

    story = Story(
        [fragment("alpha "), fragment("beta "), fragment("gamma "), fragment("delta ")],
        max_total_output=20,
    )
    result = await story.run(request=TurnRequest(USER, max_output=8))

    # 6 + 6 + 6 + 6 = 24 reported output tokens pass the budget of 20 at the fourth fragment
    assert result.stream_results[-1].finish is FinishKind.LENGTH
    assert result.final_text == "alpha beta gamma delta "
    assert [r.max_output for r in story.requests] == [8, 8, 8, 2]
    assert entries(result) == [(48, 24, False)]


async def test_a_fragment_without_usage_is_estimated_and_the_pass_total_is_marked() -> None:
    story = Story(
        [
            [TextDelta("Reported. "), UsageReport(input_tokens=5, output_tokens=3), CUT],
            [ThoughtDelta("hmm"), TextDelta("Not reported"), STOP],
        ]
    )
    result = await story.run()

    assert result.final_text == "Reported. Not reported"
    # 3 reported, then 4 estimated for the second fragment's thoughts and text
    assert estimate_tokens("hmm" + "Not reported") == 4
    assert entries(result) == [(5, 7, True)]
    assert result.usage.has_estimates


async def test_a_chinese_fragment_without_usage_spends_the_budget_near_its_real_count() -> None:
    # the start of tests/data/token_counts.json's chinese_prose: 36 tokens for o200k_base,
    # where a quarter of its 43 characters would have spent 11 of the budget and asked for more
    text = "今天巴黎的天气比较温和，西风轻拂，下午有少量云。明天会更暖和，中午气温将达到二十二度，"
    halves = [TextDelta(text[: len(text) // 2]), TextDelta(text[len(text) // 2 :])]
    story = Story([[*halves, CUT], [TextDelta("傍晚有阵雨。"), STOP]], max_total_output=30)
    result = await story.run()

    # the first fragment's estimate (its chunks weighed one by one) spends the budget
    assert estimate_tokens(text) > 30
    assert result.stream_results[-1].finish is FinishKind.LENGTH
    assert len(story.requests) == 1
    assert entries(result) == [(0, estimate_tokens(text), True)]


# --------------------------------------------------------------------------- pending fragments
async def test_reaching_max_fragments_leaves_the_last_fragment_pending() -> None:
    story = Story(
        [[TextDelta("one "), CUT], [TextDelta("two "), CUT], [TextDelta("three"), STOP]],
        max_fragments=2,
    )
    result = await story.run()

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "one two "
    assert result.stream_results[-1].finish is FinishKind.CONTINUATION_PENDING
    assert len(story.requests) == 2


async def test_a_cut_fragment_that_wrote_nothing_is_not_requested_again() -> None:
    story = Story([[TextDelta("Begun"), CUT], [CUT], [TextDelta("never"), STOP]])
    result = await story.run()

    assert result.final_text == "Begun"
    assert result.stream_results[-1].finish is FinishKind.CONTINUATION_PENDING
    assert len(story.requests) == 2  # the same prompt again would write nothing again


async def test_an_empty_pass_with_a_pending_fragment_is_not_settled_after_a_tool() -> None:
    # The model writes its call in text (VerbatimToolCalls over the session) and the sticker is
    # delivered; then the next pass only streams blank lines until max_fragments.
    def run_with(last: FinishReason) -> Story:
        return Story(
            [
                [TextDelta('sticker({"name": "cat"})'), STOP],
                [TextDelta("\n"), CUT],
                [TextDelta("\n"), last],
            ],
            max_fragments=2,
        )

    pending, ended = run_with(CUT), run_with(STOP)
    results = []
    for story in (pending, ended):
        sticker = story.tool(
            "sticker", behaviour=succeeds(expression="cat"), requires_follow_up=False
        )
        results.append(await story.run([sticker], provider=VerbatimToolCalls(story.session)))
        assert story.channel.expressions == ["cat"]
        assert len(story.requests) == 3

    pending_result, ended_result = results
    assert pending_result.stream_results[-1].finish is FinishKind.CONTINUATION_PENDING
    assert pending_result.status is TurnStatus.EMPTY_RESPONSE
    assert (ended_result.status, ended_result.reason) == (
        TurnStatus.COMPLETED,
        "settled_after_tool",
    )


# --------------------------------------------------------------------------- tool calls
async def test_a_tool_call_from_a_continuation_model_is_passed_on_and_ends_its_pass() -> None:
    story = Story(
        [
            # cut by length just after the call: continuing would write past the call
            [TextDelta("Let me check. "), FunctionCall("get_weather", {"city": "Oslo"}), CUT],
            [TextDelta("Sunny in Oslo."), STOP],
        ]
    )
    result = await story.run([story.tool("get_weather")])

    assert story.executions.names() == ["get_weather"]
    assert [s.function_call for s in result.stream_results] == ["get_weather", None]
    assert result.final_text == "Sunny in Oslo."
    assert story.channel.delivered_text == "Let me check. Sunny in Oslo."
    # the second request is the next pass, after the tool: no continuation of the first
    assert len(story.requests) == 2
    assert story.requests[1].prefill is None
    assert [entry.call.name for entry in story.requests[1].history] == ["get_weather"]
    assert story.requests[1].tools == ()


async def test_the_session_is_continuation_style_so_a_silent_tool_after_text_ends_the_turn() -> (
    None
):
    story = Story(
        [
            [TextDelta("Noted. "), FunctionCall("note", {"text": "milk"}), STOP],
            [TextDelta("a second pass nobody asked for"), STOP],
        ]
    )
    result = await story.run([story.tool("note", requires_follow_up=False)])

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Noted. "
    assert story.executions.names() == ["note"]
    assert len(story.requests) == 1


# --------------------------------------------------------------------------- stop and failure
async def test_stop_mid_fragment_ends_stopped_by_user_keeping_what_was_delivered() -> None:
    story = Story(
        [
            [TextDelta("First part, "), CUT],
            [TextDelta("second part"), Pause(5), TextDelta(" never sent"), STOP],
            [TextDelta("never requested"), STOP],
        ]
    )
    result = await story.run(at=[(2, lambda s: s.request_stop())])

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.delivered_text == "First part, second part"
    assert story.channel.delivered_text == "First part, second part"
    assert len(story.requests) == 2
    assert story.model.streams_closed == 2  # the fragment being read was closed, not abandoned


async def test_provider_error_on_the_third_fragment_keeps_the_first_two_delivered() -> None:
    overloaded = ProviderError("model overloaded", kind="server", retryable=True)
    story = Story(
        [
            [TextDelta("Chapter one. "), UsageReport(input_tokens=9, output_tokens=4), CUT],
            [TextDelta("Chapter two. "), UsageReport(input_tokens=13, output_tokens=4), CUT],
            [UsageReport(input_tokens=17, output_tokens=1), Fail(overloaded)],
        ]
    )
    result = await story.run()

    assert (result.status, result.reason) == (TurnStatus.ERROR, "provider_error")
    assert result.error_message == "model overloaded"
    assert result.delivered_text == "Chapter one. Chapter two. "
    # every report the model made is in the ledger, the failed fragment's too
    assert entries(result) == [(39, 9, False)]


async def test_after_a_failed_fragment_the_next_model_continues_from_the_delivered_fragments() -> (
    None
):
    clock = VirtualClock()
    failing = ScriptedProvider(
        [
            [TextDelta("Chapter one. "), CUT],
            [TextDelta("Chapter two. "), CUT],
            [Fail(ProviderError("model overloaded", kind="server", retryable=True))],
        ],
        clock=clock,
    )
    backup = ScriptedProvider([[TextDelta("Chapter three."), STOP]], clock=clock)
    attempts = [
        Attempt(ContinuationSession(failing, max_total_output=100), label="first"),
        Attempt(ContinuationSession(backup, max_total_output=100), label="backup"),
    ]
    channel = RecordingChannel(clock=clock)
    result = await run_generation_turn(
        attempts, [], channel, TurnRequest(USER), policy=TurnPolicy(loop=EAGER), clock=clock
    )

    assert result.status is TurnStatus.COMPLETED
    assert channel.delivered_text == "Chapter one. Chapter two. Chapter three."
    assert backup.requests[0].prefill == "Chapter one. Chapter two. "


async def test_closing_the_session_between_chunks_closes_the_fragment_being_read() -> None:
    model = ScriptedProvider([[TextDelta("a"), TextDelta("b"), STOP]])
    stream = ContinuationSession(model, max_total_output=10).stream(ProviderRequest(USER))
    assert await anext(stream) == TextDelta("a")
    await stream.aclose()
    assert model.streams_closed == 1  # at once, not whenever it is garbage-collected


# --------------------------------------------------------------------------- construction
def test_a_budget_or_fragment_limit_below_one_is_refused_by_name() -> None:
    model = ScriptedProvider([])
    for options, name in (
        ({"max_total_output": 0}, "max_total_output"),
        ({"max_total_output": 10, "max_fragments": 0}, "max_fragments"),
    ):
        try:
            ContinuationSession(model, **options)
        except ValueError as error:
            assert name in str(error)
        else:
            raise AssertionError(f"{options} was accepted")
