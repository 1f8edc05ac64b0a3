"""The outer-tier cases (docs/behaviour.md §9) and issue #3, each as a named test: fallback chains,
key rotation and health, continuation from delivered text, the tool ledger across attempts,
shared-route admission, notices, and keys that never leak."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import make_tool
from toolloop_fsm import Attempt
from toolloop_fsm import DestinationUnreachable
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Provider
from toolloop_fsm import ProviderError
from toolloop_fsm import SharedRoute
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import result_to_json
from toolloop_fsm import run_generation_turn
from toolloop_fsm.attempts import AdmissionRequest
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.scaffolding import is_verbatim_scaffolding
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

SECRET_KEYS = ("sk-live-AAAA1111", "sk-live-BBBB2222", "sk-live-CCCC3333")


def rate_limited(retry_after: float | None = None) -> ProviderError:
    return ProviderError(
        "429 Too Many Requests",
        kind="rate_limit",
        retryable=True,
        status_code=429,
        retry_after=retry_after,
    )


def server_error() -> ProviderError:
    return ProviderError("503 overloaded", kind="server", retryable=True, status_code=503)


def auth_error() -> ProviderError:
    return ProviderError("401 invalid key", kind="auth", retryable=False, status_code=401)


class KeyedProviders:
    """A provider factory: each key gets its own scripted provider; records which keys
    were used (the only place a key is seen)."""

    def __init__(self, clock: VirtualClock, scripts: dict[str | None, list[list[Any]]]) -> None:
        self.clock = clock
        self.scripts = scripts
        self.used: list[str | None] = []
        self.providers: dict[str | None, ScriptedProvider] = {}

    def __call__(self, key: str | None) -> Provider:
        self.used.append(key)
        provider = ScriptedProvider(self.scripts.get(key, [[]]), clock=self.clock, name="keyed")
        self.providers[key] = provider
        return provider


def policy(**loop: Any) -> TurnPolicy:
    return TurnPolicy(loop=LoopPolicy(delivery_flush_chars=1, **loop))


async def generate(
    attempts: Sequence[Attempt],
    clock: VirtualClock,
    *,
    tools: Sequence[Tool] = (),
    channel: RecordingChannel | None = None,
    signals: TurnSignals | None = None,
    turn_policy: TurnPolicy | None = None,
    shared_route: SharedRoute | None = None,
    key_book: dict[tuple[str, int], KeyHealth] | None = None,
    request: TurnRequest | None = None,
) -> tuple[GenerationTurnResult, RecordingChannel]:
    channel = channel if channel is not None else RecordingChannel(clock=clock)
    result = await run_generation_turn(
        attempts,
        tools,
        channel,
        request if request is not None else TurnRequest(USER),
        policy=turn_policy if turn_policy is not None else policy(),
        signals=signals,
        clock=clock,
        shared_route=shared_route,
        key_book=key_book,
    )
    return result, channel


# --------------------------------------------------------------------------- continuation
async def test_fallback_after_partial_delivery_continues_from_the_delivered_text() -> None:
    clock = VirtualClock()
    first = ScriptedProvider(
        [[TextDelta("The capital "), TextDelta("of France "), Fail(server_error())]], clock=clock
    )
    second = ScriptedProvider([[TextDelta("is Paris.")]], clock=clock)
    result, channel = await generate(
        [Attempt(first, label="primary"), Attempt(second, label="backup")], clock
    )
    assert result.status is TurnStatus.COMPLETED
    assert second.requests[0].prefill == "The capital of France "
    assert channel.delivered_text == "The capital of France is Paris."  # nothing repeated
    assert result.delivered_text == channel.delivered_text
    assert result.final_text == "The capital of France is Paris."
    assert [a.superseded for a in result.attempts] == [True, False]
    assert [(f.label, f.reason, f.kind) for f in result.attempt_failures] == [
        ("primary", "provider_error", "server")
    ]
    assert any(step.event == "attempt_superseded" for step in result.trace)


async def test_a_successful_tool_is_never_run_again_across_a_model_fallback() -> None:
    clock = VirtualClock()
    executions = Executions()
    tool = make_tool("get_weather", executions, clock)
    first = ScriptedProvider(
        [[FunctionCall("get_weather", {"city": "Paris"}, "call_A")], [Fail(server_error())]],
        clock=clock,
    )
    second = ScriptedProvider(
        [[FunctionCall("get_weather", {"city": "Paris"}, "toolu_other_id")], [TextDelta("Sunny.")]],
        clock=clock,
    )
    result, _ = await generate([Attempt(first), Attempt(second)], clock, tools=[tool])
    assert result.status is TurnStatus.COMPLETED
    assert executions.names() == ["get_weather"]  # the model's call ids differ; the key does not
    assert result.history[0].response.success
    assert result.tool_dispatches == 0  # the final attempt reused the recorded outcome


async def test_expression_delivered_once_per_turn_across_attempts() -> None:
    clock = VirtualClock()

    async def sticker(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(expression=f"{arguments['name']}_sticker")

    tool = Tool("sticker", "send a sticker", {"type": "object"}, sticker)
    first = ScriptedProvider(
        [[FunctionCall("sticker", {"name": "cat"})], [Fail(server_error())]], clock=clock
    )
    second = ScriptedProvider(
        [[FunctionCall("sticker", {"name": "dog"})], [TextDelta("There you go!")]], clock=clock
    )
    result, channel = await generate([Attempt(first), Attempt(second)], clock, tools=[tool])
    assert result.status is TurnStatus.COMPLETED
    assert channel.expressions == ["cat_sticker"]
    assert [d.expression for d in result.delivered if d.expression] == ["cat_sticker"]


async def test_an_expression_delivered_by_an_earlier_attempt_settles_an_empty_pass() -> None:
    clock = VirtualClock()
    executions = Executions()

    async def sticker(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(expression="cat_sticker")

    tools = [
        Tool("sticker", "send a sticker", {"type": "object"}, sticker),
        make_tool("note", executions, clock, requires_follow_up=False),
    ]
    first = ScriptedProvider([[FunctionCall("sticker", {})], [Fail(server_error())]], clock=clock)
    # the backup only takes a note (no follow-up needed), then has nothing to add: the
    # sticker the user already saw is the reply
    second = ScriptedProvider([[FunctionCall("note", {"n": 1})], []], clock=clock)
    result, channel = await generate([Attempt(first), Attempt(second)], clock, tools=tools)
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "settled_after_tool"
    assert channel.expressions == ["cat_sticker"]
    assert executions.names() == ["note"]


# --------------------------------------------------------------------------- keys
async def test_key_rotation_before_model_fallback() -> None:
    clock = VirtualClock()
    keyed = KeyedProviders(
        clock,
        {
            SECRET_KEYS[0]: [[Fail(rate_limited())]],
            SECRET_KEYS[1]: [[TextDelta("Answer from key two.")]],
        },
    )
    backup = ScriptedProvider([[TextDelta("backup")]], clock=clock)
    result, _ = await generate(
        [Attempt(keyed, keys=SECRET_KEYS[:2], label="main"), Attempt(backup, label="backup")],
        clock,
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Answer from key two."
    assert keyed.used == [SECRET_KEYS[0], SECRET_KEYS[1]]
    assert backup.requests == []
    assert [(a.label, a.key_index) for a in result.attempts] == [("main", 0), ("main", 1)]


async def test_at_most_three_key_attempts_per_model_then_the_next_model() -> None:
    clock = VirtualClock()
    keys = tuple(f"sk-{i}" for i in range(5))
    keyed = KeyedProviders(clock, {key: [[Fail(server_error())]] for key in keys})
    backup = ScriptedProvider([[TextDelta("from backup")]], clock=clock)
    result, _ = await generate(
        [Attempt(keyed, keys=keys, label="main"), Attempt(backup, label="backup")], clock
    )
    assert keyed.used == list(keys[:3])
    assert result.final_text == "from backup"
    assert len(result.attempt_failures) == 3


async def test_timeout_advances_to_the_next_model_and_the_key_is_not_credited() -> None:
    clock = VirtualClock()
    keyed = KeyedProviders(clock, {SECRET_KEYS[0]: [[Pause(1000)]]})
    backup = ScriptedProvider([[TextDelta("late but here")]], clock=clock)
    book: dict[tuple[str, int], KeyHealth] = {}
    result, channel = await generate(
        [Attempt(keyed, keys=SECRET_KEYS[:2], label="main"), Attempt(backup, label="backup")],
        clock,
        key_book=book,
    )
    assert result.status is TurnStatus.COMPLETED
    assert keyed.used == [SECRET_KEYS[0]]  # a timeout does not rotate keys
    assert ("main", 0) not in book  # neither credited nor cooled
    assert result.attempt_failures[0].reason == "first_token_timeout"
    # the timeout notice was held, and a later attempt answered: it is never posted
    assert not any(n.key == "timeout" for n in channel.notices)


async def test_a_successful_key_is_credited() -> None:
    clock = VirtualClock()
    keyed = KeyedProviders(clock, {SECRET_KEYS[0]: [[TextDelta("hi")]]})
    book: dict[tuple[str, int], KeyHealth] = {}
    await generate([Attempt(keyed, keys=SECRET_KEYS[:1], label="main")], clock, key_book=book)
    assert book[("main", 0)].successes == 1


@pytest.mark.parametrize(
    ("error", "cooldown", "retired"),
    [
        (rate_limited(retry_after=7.0), 7.0, False),
        (rate_limited(), 60.0, False),
        (server_error(), 300.0, False),
        (auth_error(), 0.0, True),
    ],
    ids=["429-retry-after", "429-default", "other-failure", "auth"],
)
async def test_key_health_after_a_failure(
    error: ProviderError, cooldown: float, retired: bool
) -> None:
    clock = VirtualClock(start=1000.0)
    keyed = KeyedProviders(clock, {SECRET_KEYS[0]: [[Fail(error)]]})
    book: dict[tuple[str, int], KeyHealth] = {}
    await generate([Attempt(keyed, keys=SECRET_KEYS[:1], label="main")], clock, key_book=book)
    health = book[("main", 0)]
    assert health.retired is retired
    assert health.cooldown_until == (pytest.approx(1000.0 + cooldown) if cooldown else 0.0)


async def test_a_cooling_key_is_skipped_by_the_next_turn_until_its_cooldown_ends() -> None:
    clock = VirtualClock()
    book: dict[tuple[str, int], KeyHealth] = {}
    keyed = KeyedProviders(
        clock,
        {SECRET_KEYS[0]: [[Fail(rate_limited(30.0))]], SECRET_KEYS[1]: [[TextDelta("ok")]]},
    )
    attempts = [Attempt(keyed, keys=SECRET_KEYS[:2], label="main")]
    await generate(attempts, clock, key_book=book)
    assert keyed.used == [SECRET_KEYS[0], SECRET_KEYS[1]]
    keyed.used.clear()
    await generate(attempts, clock, key_book=book)  # 30 s have not passed: key 0 is cooling
    assert keyed.used == [SECRET_KEYS[1]]
    clock.advance(31)
    keyed.used.clear()
    await generate(attempts, clock, key_book=book)
    assert keyed.used == [SECRET_KEYS[0], SECRET_KEYS[1]]


async def test_a_rejected_request_moves_to_the_next_model_without_trying_other_keys() -> None:
    clock = VirtualClock()
    bad = ProviderError("400 bad request", kind="bad_request", retryable=False, status_code=400)
    keyed = KeyedProviders(clock, {key: [[Fail(bad)]] for key in SECRET_KEYS})
    backup = ScriptedProvider([[TextDelta("fine")]], clock=clock)
    result, _ = await generate(
        [Attempt(keyed, keys=SECRET_KEYS, label="main"), Attempt(backup, label="b")], clock
    )
    assert keyed.used == [SECRET_KEYS[0]]
    assert result.final_text == "fine"


async def test_no_key_material_anywhere_in_results_traces_notices_logs_or_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = VirtualClock()

    def leaky_factory(key: str | None) -> Provider:
        # a careless provider that puts its key into its error message
        return ScriptedProvider(
            [
                [
                    TextDelta("partial "),
                    Fail(
                        ProviderError(
                            f"bad key {key}", kind="auth", retryable=False, status_code=401
                        )
                    ),
                ]
            ],
            clock=clock,
        )

    def raising_factory(key: str | None) -> Provider:
        raise RuntimeError(f"cannot build a client with {key}")

    attempts = [
        Attempt(leaky_factory, keys=SECRET_KEYS[:2], label="leaky"),
        Attempt(raising_factory, keys=SECRET_KEYS[2:], label="raising"),
    ]
    result, channel = await generate(attempts, clock)
    assert result.status is TurnStatus.ERROR
    everything = "\n".join(
        [
            result_to_json(result),
            repr(result),
            repr(attempts),
            str(result.exception),
            repr(channel.notices),
            caplog.text,
        ]
    )
    for key in SECRET_KEYS:
        assert key not in result_to_json(result)
        assert key not in repr(attempts)
        assert key not in repr(channel.notices)
        assert key not in caplog.text
        assert key not in (result.error_message or "")
    assert "[REDACTED]" in (result.error_message or "")
    assert everything  # the haystack was not empty


async def test_a_key_a_tool_echoes_deep_in_its_data_never_reaches_the_result() -> None:
    clock = VirtualClock()
    key = SECRET_KEYS[0]

    async def echo(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        # nested where only a walk of every text finds it: a list in a mapping in a list,
        # and the name of a mapping entry (cut: 8 characters of the key)
        rows = [{"account": {"tokens": ["ok", f"used {key}"]}}, {key[4:12]: 1}]
        return ToolResult(data={"rows": rows}, message="echoed")

    provider = ScriptedProvider(
        [[FunctionCall("echo", {}, "c1")], [TextDelta("done")]], clock=clock
    )
    result, _ = await generate(
        [Attempt(lambda _key: provider, keys=(key,), label="m")],
        clock,
        tools=[make_tool("echo", Executions(), clock, echo)],
    )
    assert result.status is TurnStatus.COMPLETED
    text = result_to_json(result)
    assert key not in text
    assert "used [REDACTED]" in text


async def test_a_result_with_no_key_material_comes_back_as_the_turn_built_it() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider(
        [[FunctionCall("echo", {"q": "x"}, "c1")], [TextDelta("the answer, no keys")]],
        clock=clock,
    )
    result, _ = await generate(
        [Attempt(lambda _key: provider, keys=SECRET_KEYS, label="m")],
        clock,
        tools=[make_tool("echo", Executions(), clock)],
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "the answer, no keys"
    assert result.history[0].response.data == {"ok": True, "args": {"q": "x"}}
    assert "[REDACTED]" not in result_to_json(result)


# --------------------------------------------------------------------------- exits
async def test_unreachable_destination_ends_skipped_with_no_more_attempts() -> None:
    clock = VirtualClock()
    first = ScriptedProvider([[TextDelta("hello")]], clock=clock)
    second = ScriptedProvider([[TextDelta("never")]], clock=clock)
    channel = RecordingChannel(clock=clock)

    async def gone(_text: str) -> None:
        raise DestinationUnreachable("the thread was deleted")

    channel.send_text = gone  # type: ignore[method-assign, assignment]
    result, _ = await generate([Attempt(first), Attempt(second)], clock, channel=channel)
    assert result.status is TurnStatus.SKIPPED
    assert result.reason == "destination_unreachable"
    assert second.requests == []


async def test_unreachable_reported_by_the_host_while_an_attempt_runs() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    first = ScriptedProvider([[TextDelta("hello"), Pause(50), TextDelta(" again")]], clock=clock)
    second = ScriptedProvider([[TextDelta("never")]], clock=clock)
    clock.call_later(10, signals.report_unreachable)
    result, _ = await generate([Attempt(first), Attempt(second)], clock, signals=signals)
    assert result.status is TurnStatus.SKIPPED
    assert second.requests == []
    assert clock.now() == pytest.approx(10)


async def test_host_exception_ends_error_without_fallback() -> None:
    clock = VirtualClock()
    first = ScriptedProvider([[TextDelta("hello")]], clock=clock)
    second = ScriptedProvider([[TextDelta("never")]], clock=clock)
    channel = RecordingChannel(clock=clock, fail_when=lambda text, _e: text is not None)
    result, _ = await generate([Attempt(first), Attempt(second)], clock, channel=channel)
    assert result.status is TurnStatus.ERROR
    assert result.reason == "host_error"
    assert isinstance(result.exception, ConnectionError)
    assert second.requests == []


async def test_a_stop_is_final_and_no_failure_notice_is_posted_while_it_is_pending() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    first = ScriptedProvider([[Fail(server_error())]], clock=clock)
    second = ScriptedProvider([[TextDelta("Hi"), Pause(20), TextDelta("!")]], clock=clock)
    clock.call_later(5, lambda: signals.request_stop("stopping"))
    result, channel = await generate([Attempt(first), Attempt(second)], clock, signals=signals)
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert not any(n.key == "fallback_used" for n in channel.notices)


@pytest.mark.parametrize("follow_up", [True, False], ids=["follow-up-pending", "control"])
async def test_no_fallback_notice_while_a_follow_up_is_pending(follow_up: bool) -> None:
    clock = VirtualClock()
    signals = TurnSignals()

    async def remember(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        if follow_up:
            signals.follow_up()  # a new message during the tool chain: it waits for next turn
        return ToolResult(data="saved")

    tool = Tool("remember", "remember something", {"type": "object"}, remember)
    first = ScriptedProvider([[Fail(server_error())]], clock=clock)
    second = ScriptedProvider(
        [[FunctionCall("remember", {"x": 1})], [TextDelta("Saved it.")]], clock=clock
    )
    result, channel = await generate(
        [Attempt(first), Attempt(second)], clock, signals=signals, tools=[tool]
    )
    assert result.status is TurnStatus.COMPLETED
    posted = any(n.key == "fallback_used" for n in channel.notices)
    assert posted is not follow_up


async def test_one_compact_fallback_notice_after_a_success_that_followed_failures() -> None:
    clock = VirtualClock()
    a = ScriptedProvider([[Fail(server_error())]], clock=clock)
    b = ScriptedProvider([[Fail(rate_limited())]], clock=clock)
    c = ScriptedProvider([[TextDelta("Finally.")]], clock=clock)
    result, channel = await generate(
        [Attempt(a, label="a"), Attempt(b, label="b"), Attempt(c, label="c")], clock
    )
    notices = [n for n in channel.notices if n.key == "fallback_used"]
    assert len(notices) == 1
    assert notices[0].params["failures"] == [
        "a: error (server)",
        "b: error (rate_limit)",
    ]
    assert result.status is TurnStatus.COMPLETED


async def test_chain_exhausted_the_last_failure_is_the_result_with_every_failure_listed() -> None:
    clock = VirtualClock()
    a = ScriptedProvider([[Fail(server_error())]], clock=clock)
    b = ScriptedProvider([[Pause(1000)]], clock=clock)
    result, channel = await generate([Attempt(a, label="a"), Attempt(b, label="b")], clock)
    assert result.status is TurnStatus.TIMEOUT
    assert result.reason == "first_token_timeout"
    assert [(f.label, f.status) for f in result.attempt_failures] == [
        ("a", TurnStatus.ERROR),
        ("b", TurnStatus.TIMEOUT),
    ]
    # nothing later answered, so the held timeout notice is posted, once
    assert [n.key for n in channel.notices].count("timeout") == 1


async def test_non_retryable_statuses_are_final() -> None:
    clock = VirtualClock()
    a = ScriptedProvider([[]], clock=clock)  # an empty response
    b = ScriptedProvider([[TextDelta("never")]], clock=clock)
    result, _ = await generate([Attempt(a), Attempt(b)], clock)
    assert result.status is TurnStatus.EMPTY_RESPONSE
    assert b.requests == []


# --------------------------------------------------------------------------- shared route
async def test_shared_route_is_asked_once_and_admission_switches_the_credential_source() -> None:
    clock = VirtualClock()
    asked: list[Any] = []

    async def admit(request: Any) -> bool:
        asked.append(request)
        return True

    own = ScriptedProvider([[Fail(rate_limited())]], clock=clock)
    shared = ScriptedProvider([[TextDelta("via the shared route")]], clock=clock)
    result, _ = await generate(
        [Attempt(own, label="own")],
        clock,
        shared_route=SharedRoute([Attempt(shared, label="shared")], admit),
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.credential_source == "shared"
    assert len(asked) == 1 and asked[0].failures[0].label == "own"
    assert [a.route for a in result.attempts] == ["user", "shared"]


async def test_shared_route_refusal_is_reported_once() -> None:
    clock = VirtualClock()
    own = ScriptedProvider([[Fail(server_error())]], clock=clock)
    shared = ScriptedProvider([[TextDelta("never")]], clock=clock)
    result, channel = await generate(
        [Attempt(own, label="own")],
        clock,
        shared_route=SharedRoute([Attempt(shared, label="shared")], lambda _r: False),
    )
    assert result.status is TurnStatus.ERROR
    assert result.reason == "shared_route_refused"
    assert [n.key for n in channel.notices].count("shared_route_refused") == 1
    assert shared.requests == []
    assert result.credential_source == "user"


async def test_settings_that_withhold_the_shared_route_are_honoured() -> None:
    clock = VirtualClock()
    asked: list[Any] = []
    own = ScriptedProvider([[Fail(server_error())]], clock=clock)
    shared = ScriptedProvider([[TextDelta("never")]], clock=clock)

    def admit(request: AdmissionRequest) -> bool:
        asked.append(request)
        return True

    result, _ = await generate(
        [Attempt(own, label="own")],
        clock,
        turn_policy=TurnPolicy(allow_shared_route=False),
        shared_route=SharedRoute([Attempt(shared, label="shared")], admit),
    )
    assert result.status is TurnStatus.ERROR
    assert asked == [] and shared.requests == []


# --------------------------------------------------------------------------- verbatim scaffolding
async def test_verbatim_scaffolding_added_for_verbatim_models_and_stripped_for_native_ones() -> (
    None
):
    clock = VirtualClock()
    tool = make_tool("get_weather", Executions(), clock)
    native_first = ScriptedProvider([[Fail(server_error())]], clock=clock, tool_calling="native")
    verbatim = ScriptedProvider(
        [[Fail(server_error())]], clock=clock, tool_calling="verbatim", name="verbatim"
    )
    native_last = ScriptedProvider([[TextDelta("done")]], clock=clock, tool_calling="native")
    result, _ = await generate(
        [
            Attempt(native_first, label="n1"),
            Attempt(verbatim, label="v"),
            Attempt(native_last, label="n2"),
        ],
        clock,
        tools=[tool],
    )
    assert result.status is TurnStatus.COMPLETED

    def scaffolding(provider: ScriptedProvider) -> list[Any]:
        return [m for m in provider.requests[0].context if is_verbatim_scaffolding(m)]

    assert scaffolding(native_first) == []
    (dump,) = scaffolding(verbatim)
    assert "get_weather" in dump["content"]
    assert scaffolding(native_last) == []
    assert native_last.requests[0].context[-1] == USER[0]


# --------------------------------------------------------------------------- cancellation
async def test_cancelling_the_caller_propagates_through_the_generation_turn() -> None:
    started = asyncio.Event()
    cancelled: list[str] = []

    class Blocking:
        name = "blocking"

        async def _play(self) -> Any:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append("stream")
                raise
            yield TextDelta("never")

        def stream(self, request: ProviderRequest) -> Any:
            return self._play()

    from toolloop_fsm.host import LoopClock

    task = asyncio.ensure_future(
        run_generation_turn(
            [Attempt(Blocking())], [], RecordingChannel(), TurnRequest(USER), clock=LoopClock()
        )
    )
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == ["stream"]


async def test_a_key_cut_short_in_a_providers_error_never_reaches_the_result() -> None:
    clock = VirtualClock()
    key = "sk-live-" + "Q7x2Lm9Pz4Rt8Wv1Ys6Nb3Kc5Hd0Jf2Ge7"
    # a server that quotes the key cut at its error-body limit: no whole key to match
    cut = ProviderError(f"401 invalid api key {key[:30]}…", kind="auth", retryable=False)
    provider = ScriptedProvider([[Fail(cut)]], clock=clock)
    result, channel = await generate(
        [Attempt(lambda _key: provider, keys=(key,), label="m")], clock
    )
    assert result.status is TurnStatus.ERROR
    text = result_to_json(result) + repr(result.exception) + repr(channel.notices)
    pieces = {key[i : i + 8] for i in range(len(key) - 7)}
    assert not [piece for piece in pieces if piece in text]
