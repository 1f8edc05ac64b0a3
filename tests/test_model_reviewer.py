"""`ModelReviewer`: the verdict a model gives as strict JSON, and every way asking can fail.

Against `ScriptedProvider` (time from a `VirtualClock`): the answers it reads, the ones it
refuses and why, the deadline, secrets, the byte budget, usage, and the request the model is
shown. Over loopback HTTP, through `OpenAICompatibleProvider`: the demo's scripted model
playing the reviewer, a server that answers prose, one that stalls, and a key that must not
leave.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import pytest

from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import Finding
from toolloop_fsm import ModelReviewer
from toolloop_fsm import Pass
from toolloop_fsm import ProviderError
from toolloop_fsm import ProviderRequest
from toolloop_fsm import Reviewer
from toolloop_fsm import ReviewPacket
from toolloop_fsm import Revise
from toolloop_fsm import Unavailable
from toolloop_fsm.demo import ANSWERING_MODEL
from toolloop_fsm.demo import DEMO_FINDING
from toolloop_fsm.demo import DemoServer
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.model_reviewer import CUT_MARK
from toolloop_fsm.model_reviewer import MAX_ANSWER_CHARS
from toolloop_fsm.model_reviewer import REVIEW_MARKER
from toolloop_fsm.model_reviewer import VERDICT_SCHEMA
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.review import CandidateStatus
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import ProposedCall
from toolloop_fsm.review import ReviewedTool
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.review import ReviewUsage
from toolloop_fsm.review import RevisionInfo
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing.scripted import ScriptItem

CANDIDATE = "It's 21 °C and clear in Paris — a good day for a walk along the Seine."
WEATHER = ReviewedTool(
    "get_weather",
    {"city": "Paris"},
    success=True,
    data={"city": "Paris", "sky": "clear", "temp_c": 21},
    message="demo data",
)
FRESH = RevisionInfo(reviews_done=0, max_reviews=2, revisions_done=0, max_revisions=1)
REVISED = RevisionInfo(
    reviews_done=1,
    max_reviews=2,
    revisions_done=1,
    max_revisions=1,
    previous_findings=(Finding(FindingCategory.VOICE, "Too stiff.", "Say it warmly."),),
)
REVISE_ANSWER = {
    "verdict": "revise",
    "findings": [
        {"category": "voice", "problem": "Reads like a bulletin.", "direction": "Talk to them."},
        {
            "category": "continuity",
            "problem": "Says 23 °C; the tool said 21.",
            "direction": "Use 21.",
        },
    ],
}


def packet(
    candidate: str = CANDIDATE,
    *,
    kind: ReviewKind = ReviewKind.RESPONSE,
    status: CandidateStatus = CandidateStatus.PENDING,
    history: Sequence[Mapping[str, Any]] = (
        {"role": "user", "content": "What's the weather like in Paris today?"},
    ),
    tools: Sequence[ReviewedTool] = (WEATHER,),
    revision: RevisionInfo = FRESH,
    proposed_call: ProposedCall | None = None,
) -> ReviewPacket:
    return ReviewPacket(
        kind=kind,
        candidate=candidate,
        status=status,
        trigger="complete_response" if kind is ReviewKind.RESPONSE else "tool_call",
        history=tuple(history),
        tools=tuple(tools),
        revision=revision,
        proposed_call=proposed_call,
    )


def answered(
    text: str, *more: ScriptItem, finish: FinishKind = FinishKind.STOP
) -> list[ScriptItem]:
    """One pass that streams ``text`` in pieces of 7 characters, then ``more``, then finishes."""
    pieces: list[ScriptItem] = [TextDelta(text[i : i + 7]) for i in range(0, len(text), 7)]
    return [*pieces, *more, FinishReason(finish)]


def reviewer_for(
    *passes: Sequence[ScriptItem], **options: Any
) -> tuple[ModelReviewer, ScriptedProvider]:
    clock = options.pop("clock", None) or VirtualClock()
    provider = ScriptedProvider(passes, clock=clock)
    return ModelReviewer(provider, clock=clock, **options), provider


def shown(provider: ScriptedProvider) -> tuple[str, dict[str, Any]]:
    """The system instruction and the packet (parsed) of the one request the model got."""
    assert len(provider.requests) == 1
    system, user = provider.requests[0].context
    assert (system["role"], user["role"]) == ("system", "user")
    return system["content"], json.loads(user["content"])


def reason(verdict: object) -> str:
    assert isinstance(verdict, Unavailable), verdict
    return verdict.reason


# --------------------------------------------------------------------------- verdicts
async def test_a_pass_answer_lets_the_candidate_through() -> None:
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'))

    verdict = await reviewer.review(packet())

    assert isinstance(verdict, Pass)
    assert len(provider.requests) == 1
    assert provider.requests[0].tools == ()


async def test_a_revise_answer_carries_its_findings_in_order() -> None:
    reviewer, _provider = reviewer_for(answered(json.dumps(REVISE_ANSWER)))

    verdict = await reviewer.review(packet())

    assert isinstance(verdict, Revise)
    assert verdict.findings == (
        Finding(FindingCategory.VOICE, "Reads like a bulletin.", "Talk to them."),
        Finding(FindingCategory.CONTINUITY, "Says 23 °C; the tool said 21.", "Use 21."),
    )


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"verdict": "pass"}\n```',
        '  ```JSON\n{"verdict": "pass"}\n```\n',
        '```\n{"verdict": "pass"}\n```',
    ],
    ids=["json-fence", "upper-case-and-blank-lines", "bare-fence"],
)
async def test_an_answer_in_one_code_fence_is_read(text: str) -> None:
    reviewer, _provider = reviewer_for(answered(text))
    assert isinstance(await reviewer.review(packet()), Pass)


@pytest.mark.parametrize(
    "text",
    [
        "Looks good to me!",
        "",
        '{"verdict": "pass"',
        '["pass"]',
        '"pass"',
        'Here is my verdict:\n```json\n{"verdict": "pass"}\n```',
        '```json\n{"verdict": "pass"}\n```\n```json\n{"verdict": "pass"}\n```',
        '{"verdict": "pass"} and that is final',
        '{"verdict": NaN}',
    ],
    ids=[
        "prose",
        "empty",
        "cut-json",
        "array",
        "string",
        "prose-before-fence",
        "two-fences",
        "prose-after",
        "nan",
    ],
)
async def test_an_answer_that_is_not_one_json_object_is_malformed(text: str) -> None:
    reviewer, _provider = reviewer_for(answered(text))
    assert reason(await reviewer.review(packet())) == "malformed"


def _finding(**change: str) -> dict[str, str]:
    return {"category": "voice", "problem": "Too stiff.", "direction": "Warmer.", **change}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            {"verdict": "revise", "findings": [_finding()] * 5},
            "schema: findings: must contain less than or equal to 4 items",
        ),
        ({"verdict": "revise", "findings": []}, "schema: findings: must contain at least 1 items"),
        (
            {"verdict": "revise", "findings": [_finding(category="pacing")]},
            "schema: findings[0].category: must be one of ['character', 'voice', 'initiative', "
            "'chemistry', 'repetition', 'continuity', 'tool_use']",
        ),
        (
            {"verdict": "revise", "findings": [_finding(problem="x" * 301)]},
            "schema: findings[0].problem: must be shorter than or equal to 300 characters",
        ),
        (
            {"verdict": "revise", "findings": [_finding(direction="   ")]},
            "schema: findings[0].direction: must match pattern \\S",
        ),
        ({"findings": [_finding()]}, "schema: answer: must contain ['verdict'] properties"),
        ({"verdict": "revise"}, "schema: answer: must contain ['findings'] properties"),
        ({"verdict": "pass", "findings": [_finding()]}, "schema: findings: must not be there"),
        ({"verdict": "approve"}, "schema: verdict: must be one of ['pass', 'revise', 'refuse']"),
        (
            {"verdict": "pass", "confidence": 0.9},
            "schema: answer: must not contain {'confidence'} properties",
        ),
    ],
    ids=[
        "five-findings",
        "no-findings",
        "unknown-category",
        "301-char-problem",
        "blank-direction",
        "missing-verdict",
        "revise-without-findings",
        "pass-with-findings",
        "unknown-verdict",
        "extra-key",
    ],
)
async def test_an_answer_of_the_wrong_shape_says_what_is_wrong(
    answer: dict[str, Any], expected: str
) -> None:
    reviewer, _provider = reviewer_for(answered(json.dumps(answer)))
    assert reason(await reviewer.review(packet())) == expected


async def test_a_300_character_problem_is_accepted() -> None:
    answer = {"verdict": "revise", "findings": [_finding(problem="x" * 300)]}
    reviewer, _provider = reviewer_for(answered(json.dumps(answer)))
    verdict = await reviewer.review(packet())
    assert isinstance(verdict, Revise)
    assert verdict.findings[0].problem == "x" * 300


@pytest.mark.parametrize("finish", [FinishKind.CONTENT_FILTER, FinishKind.REFUSAL])
async def test_a_provider_that_refuses_gives_no_verdict(finish: FinishKind) -> None:
    # even an answer that would pass: a filtered answer is not the model's verdict
    reviewer, _provider = reviewer_for(answered('{"verdict": "pass"}', finish=finish))
    assert reason(await reviewer.review(packet())) == "refusal"


async def test_a_model_that_declines_to_judge_is_a_refusal() -> None:
    reviewer, _provider = reviewer_for(answered('{"verdict": "refuse"}'))
    assert reason(await reviewer.review(packet())) == "refusal"


# --------------------------------------------------------------------------- failures
async def test_a_provider_failure_names_its_kind_and_never_its_message() -> None:
    error = ProviderError(
        "upstream said: key sk-live-1234567890 is over quota",
        kind="rate_limit",
        retryable=True,
        status_code=429,
    )
    reviewer, provider = reviewer_for([TextDelta('{"verdict"'), Fail(error)])

    verdict = await reviewer.review(packet())

    assert reason(verdict) == "provider_error: rate_limit"
    assert provider.streams_closed == 1
    # the request was made, so the review cost something
    assert verdict.usage is not None and verdict.usage.estimated


async def test_a_provider_failure_is_logged_without_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = "sk-live-1234567890abcdef"
    error = ProviderError(f"invalid key {key}", kind="auth", retryable=False, status_code=401)
    reviewer, _provider = reviewer_for([Fail(error)], secrets=[key])

    with caplog.at_level("WARNING", logger="toolloop_fsm.review"):
        verdict = await reviewer.review(packet())

    assert reason(verdict) == "provider_error: auth"
    [record] = [r for r in caplog.records if r.name == "toolloop_fsm.review"]
    assert "invalid key [REDACTED]" in record.getMessage()
    assert key[:8] not in record.getMessage()


class RaisingProvider:
    """A host's provider whose stream breaks with an ordinary exception."""

    name = "raising"

    def __init__(self) -> None:
        self.requests: list[ProviderRequest] = []

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        self.requests.append(request)
        return self._play()

    async def _play(self) -> AsyncIterator[Chunk]:
        yield TextDelta("{")
        raise RuntimeError("socket exploded")


class StreamlessProvider:
    """A host's provider whose ``stream`` raises before returning an iterator."""

    name = "streamless"

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        raise ValueError("no model configured")


@pytest.mark.parametrize(
    ("provider", "expected"),
    [
        (RaisingProvider(), "provider_error: RuntimeError"),
        (StreamlessProvider(), "provider_error: ValueError"),
    ],
    ids=["raises-while-streaming", "raises-before-streaming"],
)
async def test_a_provider_that_raises_is_unavailable_not_an_exception(
    provider: Any, expected: str
) -> None:
    reviewer = ModelReviewer(provider, clock=VirtualClock())
    assert reason(await reviewer.review(packet())) == expected


async def test_a_review_that_outlasts_its_timeout_is_abandoned_at_the_timeout() -> None:
    clock = VirtualClock()
    reviewer, provider = reviewer_for(
        [TextDelta('{"verdict": '), Pause(500), *answered('"pass"}')],
        clock=clock,
        review_timeout=45,
    )

    verdict = await reviewer.review(packet())

    assert reason(verdict) == "timeout"
    assert clock.now() == 45  # not a virtual second later, not at the 500 s stall's end
    assert provider.streams_closed == 1  # the provider's stream was closed, not left running
    assert verdict.usage is not None
    assert verdict.usage.output_tokens == estimate_tokens('{"verdict": ')


async def test_a_slow_review_inside_its_timeout_gives_its_verdict() -> None:
    clock = VirtualClock()
    reviewer, _provider = reviewer_for(
        [Pause(119), *answered('{"verdict": "pass"}')], clock=clock
    )  # the default timeout: 120 s

    assert isinstance(await reviewer.review(packet()), Pass)
    assert clock.now() == 119


async def test_an_endless_answer_is_cut_off_as_malformed() -> None:
    endless = [TextDelta("x" * 1000) for _ in range(MAX_ANSWER_CHARS // 1000 + 5)]
    reviewer, provider = reviewer_for([*endless, FinishReason(FinishKind.STOP)])

    assert reason(await reviewer.review(packet())) == "malformed"
    assert provider.streams_closed == 1


async def test_a_cancelled_review_is_not_swallowed() -> None:
    clock = VirtualClock()
    reviewer, _provider = reviewer_for([Pause(60), *answered('{"verdict": "pass"}')], clock=clock)
    task = asyncio.ensure_future(reviewer.review(packet()))

    def cancel() -> None:
        task.cancel()

    clock.call_later(10, cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_packet_of_the_wrong_kinds_of_values_is_unavailable_not_an_exception() -> None:
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'))
    broken = ReviewPacket(
        kind="response",  # type: ignore[arg-type]
        candidate=CANDIDATE,
        status=CandidateStatus.PENDING,
        trigger="complete_response",
        history=(),
        tools=(),
        revision=FRESH,
    )

    assert await reviewer.review(broken) == Unavailable("bad_packet")
    assert provider.requests == []


# --------------------------------------------------------------------------- secrets
SECRET = "hunter2-correct-horse-battery"


@pytest.mark.parametrize(
    "leaky",
    [
        packet(f"Sure, the password is {SECRET}."),
        packet(
            "",
            kind=ReviewKind.TOOL_CALL,
            proposed_call=ProposedCall("send_email", {"body": f"login with {SECRET}"}),
        ),
        packet(tools=[ReviewedTool("lookup", {"q": "x"}, success=True, data={"note": SECRET})]),
        packet(tools=[ReviewedTool("lookup", {"token": SECRET}, success=False, message="no")]),
        packet(history=[{"role": "user", "content": f"my key is {SECRET}"}]),
        # a long run of the secret is as secret as the whole of it
        packet(f"the middle of it: {SECRET[4:16]}"),
    ],
    ids=[
        "candidate",
        "proposed-call-arguments",
        "tool-data",
        "tool-arguments",
        "history",
        "a-12-character-run",
    ],
)
async def test_a_packet_holding_a_secret_is_never_sent(leaky: ReviewPacket) -> None:
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'), secrets=[SECRET])

    verdict = await reviewer.review(leaky)

    assert verdict == Unavailable("secret")  # no usage: nothing was asked
    assert provider.requests == []


async def test_a_short_secret_counts_only_whole() -> None:
    reviewer, provider = reviewer_for(
        answered('{"verdict": "pass"}'), answered('{"verdict": "pass"}'), secrets=["pa55"]
    )
    assert isinstance(await reviewer.review(packet("the pa5 and 55 are not it")), Pass)
    assert reason(await reviewer.review(packet("but pa55 is"))) == "secret"
    assert len(provider.requests) == 1


async def test_the_secrets_are_not_in_the_reviewers_repr() -> None:
    reviewer, _provider = reviewer_for(secrets=[SECRET])
    assert SECRET not in repr(reviewer)


# --------------------------------------------------------------------------- the byte budget
def _history(count: int, size: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"message {n}: " + "h" * size} for n in range(count)]


async def test_a_packet_over_the_budget_loses_its_oldest_history_first() -> None:
    history = _history(3, 1000)
    big_tool = ReviewedTool("lookup", {"q": "x"}, success=True, data="d" * 1500)
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'), max_input_bytes=4000)

    assert isinstance(await reviewer.review(packet(history=history, tools=[big_tool])), Pass)

    _system, document = shown(provider)
    user_bytes = len(provider.requests[0].context[1]["content"].encode("utf-8"))
    assert user_bytes <= 4000
    assert document["candidate"] == CANDIDATE
    assert document["history"] == history[2:]  # the two oldest went, the newest stayed
    assert document["history_omitted"] == 2
    assert document["tools"][0]["data"] == "d" * 1500  # tools are cut only after history


async def test_when_history_is_not_enough_tool_data_and_messages_are_cut_and_marked() -> None:
    tools = [
        ReviewedTool(
            "lookup", {"q": "x"}, success=True, data={"rows": ["r" * 50] * 60}, message="m" * 2000
        ),
        ReviewedTool("clock", {}, success=True, data="12:00", message="local time"),
    ]
    call = ProposedCall("send_email", {"to": "ana@example.org", "body": "b" * 900})
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'), max_input_bytes=3000)
    big = packet(
        "c" * 800,
        kind=ReviewKind.TOOL_CALL,
        history=_history(2, 500),
        tools=tools,
        proposed_call=call,
    )

    assert isinstance(await reviewer.review(big), Pass)

    _system, document = shown(provider)
    assert len(provider.requests[0].context[1]["content"].encode("utf-8")) <= 3000
    assert document["history"] == [] and document["history_omitted"] == 2
    # never cut: the candidate and the proposed call
    assert document["candidate"] == "c" * 800
    assert document["proposed_call"]["arguments"] == {"to": "ana@example.org", "body": "b" * 900}
    lookup, clock = document["tools"]
    assert lookup["data"].endswith(CUT_MARK) and lookup["data"].startswith('{"rows": ["rrr')
    assert lookup["message"].endswith(CUT_MARK) and lookup["message"].startswith("mmm")
    # the short values were left whole: the long ones were cut to a common length
    assert (clock["data"], clock["message"]) == ("12:00", "local time")
    assert lookup["arguments"] == {"q": "x"}


async def test_a_packet_that_cannot_fit_without_cutting_the_candidate_is_too_large() -> None:
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'), max_input_bytes=2000)

    verdict = await reviewer.review(packet("é" * 1200, history=_history(3, 100)))  # 2,400 bytes

    assert verdict == Unavailable("too_large")
    assert provider.requests == []


# --------------------------------------------------------------------------- usage
async def test_the_usage_the_provider_reports_is_the_reviews_usage() -> None:
    reviewer, _provider = reviewer_for(answered('{"verdict": "pass"}', UsageReport(812, 9)))
    verdict = await reviewer.review(packet())
    assert verdict.usage == ReviewUsage(812, 9, estimated=False)


async def test_usage_reported_in_increments_is_added_up() -> None:
    increments = (
        UsageReport(800, 0, cumulative=False),
        UsageReport(0, 4, cumulative=False),
        UsageReport(0, 5, cumulative=False),
    )
    reviewer, _provider = reviewer_for(answered(json.dumps(REVISE_ANSWER), *increments))
    verdict = await reviewer.review(packet())
    assert isinstance(verdict, Revise)
    assert verdict.usage == ReviewUsage(800, 9, estimated=False)


async def test_without_a_usage_report_the_review_is_estimated_from_its_text() -> None:
    answer = json.dumps(REVISE_ANSWER)
    reviewer, provider = reviewer_for(answered(answer))

    verdict = await reviewer.review(packet())

    system, user = (m["content"] for m in provider.requests[0].context)
    assert verdict.usage == ReviewUsage(
        estimate_tokens(system + user), estimate_tokens(answer), estimated=True
    )


async def test_an_unusable_answer_still_reports_what_it_cost() -> None:
    reviewer, _provider = reviewer_for(answered("Looks fine.", UsageReport(700, 3)))
    verdict = await reviewer.review(packet())
    assert verdict == Unavailable("malformed", usage=ReviewUsage(700, 3))


# --------------------------------------------------------------------------- what is shown
async def test_the_model_is_shown_the_candidate_its_status_and_the_answer_schema() -> None:
    cut = CandidateStatus.PENDING_CUT_AT_LENGTH_LIMIT
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'))

    await reviewer.review(packet(status=cut, revision=REVISED))

    system, document = shown(provider)
    assert system.startswith(REVIEW_MARKER)
    assert json.dumps(VERDICT_SCHEMA, ensure_ascii=False) in system  # the exact answer shape
    for category in FindingCategory:
        assert category.value in system
    assert document["kind"] == "response"
    assert document["candidate"] == CANDIDATE
    assert document["status"] == "pending_cut_at_length_limit"
    assert "will be delivered as cut" in document["status_note"]
    assert document["trigger"] == "complete_response"
    assert document["tools"] == [
        {
            "name": "get_weather",
            "arguments": {"city": "Paris"},
            "success": True,
            "data": {"city": "Paris", "sky": "clear", "temp_c": 21},
            "message": "demo data",
            "status": None,
            "reason": None,
        }
    ]
    assert document["revision"] == {
        "reviews_done": 1,
        "max_reviews": 2,
        "revisions_done": 1,
        "max_revisions": 1,
        "previous_findings": [
            {"category": "voice", "problem": "Too stiff.", "direction": "Say it warmly."}
        ],
    }
    assert "proposed_call" not in document


async def test_a_tool_checkpoint_shows_the_proposed_call_as_not_executed() -> None:
    call = ProposedCall("book_table", {"restaurant": "Chez Ana", "seats": 2}, correction=True)
    reviewer, provider = reviewer_for(answered('{"verdict": "pass"}'))

    await reviewer.review(
        packet("Let me book that.", kind=ReviewKind.TOOL_CALL, proposed_call=call)
    )

    _system, document = shown(provider)
    assert document["kind"] == "tool_call"
    assert document["proposed_call"] == {
        "name": "book_table",
        "arguments": {"restaurant": "Chez Ana", "seats": 2},
        "status": "not_executed",
        "correction": True,
    }


# --------------------------------------------------------------------------- construction
def test_a_model_reviewer_is_a_reviewer() -> None:
    reviewer, _provider = reviewer_for()
    assert isinstance(reviewer, Reviewer)


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"review_timeout": 0}, ValueError, "review_timeout"),
        ({"review_timeout": math.inf}, ValueError, "review_timeout"),
        ({"max_input_bytes": 0}, ValueError, "max_input_bytes"),
        ({"max_input_bytes": 10.5}, TypeError, "max_input_bytes"),
        ({"secrets": SECRET}, TypeError, "secrets"),
        ({"secrets": [SECRET, 7]}, TypeError, "secrets"),
        ({"clock": "monotonic"}, TypeError, "clock"),
    ],
    ids=[
        "zero-timeout",
        "infinite-timeout",
        "zero-budget",
        "fractional-budget",
        "one-string-of-secrets",
        "a-secret-that-is-not-text",
        "not-a-clock",
    ],
)
def test_a_reviewer_built_wrong_says_which_option(
    options: dict[str, Any], error: type[Exception], named: str
) -> None:
    with pytest.raises(error, match=named):
        ModelReviewer(ScriptedProvider([]), **options)


def test_something_that_is_not_a_provider_is_refused() -> None:
    with pytest.raises(TypeError, match="provider"):
        ModelReviewer("gpt-4o")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- over loopback HTTP
async def test_the_demo_model_sends_a_first_draft_back_and_passes_the_revision() -> None:
    async with DemoServer(record_requests=True) as server:
        provider = OpenAICompatibleProvider(server.base_url, ANSWERING_MODEL, api_key="demo-key-2")
        reviewer = ModelReviewer(provider)

        first = await reviewer.review(packet())
        revised = await reviewer.review(packet(revision=REVISED))
        call = ProposedCall("get_weather", {"city": "Paris"})
        checkpoint = await reviewer.review(
            packet("", kind=ReviewKind.TOOL_CALL, tools=(), proposed_call=call)
        )

    assert isinstance(first, Revise)
    assert first.findings == (Finding(**DEMO_FINDING),)
    assert first.usage is not None and not first.usage.estimated  # the server reported usage
    assert isinstance(revised, Pass)
    assert isinstance(checkpoint, Pass)
    # what went over the wire: the instruction and the packet, no tools
    sent = server.requests[0]
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    assert json.loads(sent["messages"][1]["content"])["candidate"] == CANDIDATE
    assert "tools" not in sent


SSE = (("content-type", "text/event-stream"),)


def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "model": "judge",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def test_a_server_that_answers_prose_gives_a_malformed_review(
    wire_server: WireServer,
) -> None:
    prose = (
        frame({"role": "assistant", "content": ""}),
        frame({"content": "The reply is lovely, "}),
        frame({"content": "ship it."}),
        frame({}, "stop"),
        b"data: [DONE]\n\n",
    )
    wire_server.serve(Scripted(headers=SSE, chunks=prose))
    reviewer = ModelReviewer(OpenAICompatibleProvider(wire_server.url + "/v1", "judge"))

    verdict = await reviewer.review(packet())

    assert reason(verdict) == "malformed"
    assert verdict.usage is not None and verdict.usage.estimated
    assert len(wire_server.requests) == 1


async def test_a_server_that_stalls_is_abandoned_at_the_review_timeout(
    wire_server: WireServer,
) -> None:
    chunks = (
        frame({"role": "assistant", "content": ""}),
        frame({"content": '{"verdict": '}),
        frame({"content": '"pass"}'}),
        frame({}, "stop"),
    )
    wire_server.serve(Scripted(headers=SSE, chunks=chunks, stall_after=2))
    # the review's deadline runs on a virtual clock; the HTTP client's read timeout (a real
    # timer) holds it still while the stalled answer is read, until the test moves it
    clock = VirtualClock()
    reviewer = ModelReviewer(
        OpenAICompatibleProvider(wire_server.url + "/v1", "judge"), review_timeout=0.3, clock=clock
    )

    review = asyncio.ensure_future(reviewer.review(packet()))
    stalled = asyncio.ensure_future(wire_server.stalled.wait())
    await asyncio.wait([review, stalled], return_when=asyncio.FIRST_COMPLETED)
    # a stalled answer is waited for, not taken as the verdict
    assert stalled.done() and not review.done(), review.result()
    clock.advance(0.3)
    verdict = await review

    assert reason(verdict) == "timeout"
    assert clock.now() == 0.3
    # the review closed its HTTP response: the stalled server sees its client go
    await wire_server.client_gone.wait()


async def test_the_providers_own_key_is_never_sent_to_it(wire_server: WireServer) -> None:
    key = "sk-test-9f8e7d6c5b4a3210"
    wire_server.serve(Scripted(headers=SSE, chunks=(frame({"content": '{"verdict": "pass"}'}),)))
    provider = OpenAICompatibleProvider(wire_server.url + "/v1", "judge", api_key=key)
    reviewer = ModelReviewer(provider)
    leaked = ReviewedTool("env", {}, success=True, data={"OPENAI_API_KEY": key})

    verdict = await reviewer.review(packet(tools=[leaked]))

    assert verdict == Unavailable("secret")
    assert wire_server.requests == []


async def test_a_ten_megabyte_answer_is_cut_and_refused_as_malformed_not_waited_on(
    wire_server: WireServer,
) -> None:
    # 10 MB of one SSE line, then the server holds the connection: nothing completes the
    # event, so only a bound on the bytes read ends the review (its deadline never passes on
    # the virtual clock)
    line = b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"x" * 10_000_000
    pieces = tuple(line[i : i + 65_536] for i in range(0, len(line), 65_536))
    wire_server.serve(Scripted(headers=SSE, chunks=pieces, stall_after=len(pieces)))
    reviewer = ModelReviewer(
        OpenAICompatibleProvider(wire_server.url + "/v1", "judge"),
        review_timeout=60,
        clock=VirtualClock(),
    )

    verdict = await reviewer.review(packet())

    assert reason(verdict) == "malformed"
    await wire_server.client_gone.wait()
