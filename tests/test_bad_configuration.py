"""Bad configuration is refused where it is written: a policy, a tool, a request, an attempt
or a key book entry with a value of the wrong type, or a number that is not a finite value
in range, raises `TypeError`/`ValueError` at construction, and the message names the field.

Before these checks, a NaN deadline was silently off (every comparison with NaN is false),
a string of keys became one key per character, and a tool with a string for a schema
failed only when a provider first serialised it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from tests.inner_kit import USER
from toolloop_fsm import Attempt
from toolloop_fsm import LoopPolicy
from toolloop_fsm import SharedRoute
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolRegistry
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.pump import resume_tool_loop
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

NOT_FINITE_OR_NEGATIVE = (math.nan, math.inf, -math.inf, -1)


async def _answer(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    return ToolResult()


def _numeric_fields(cls: type) -> list[str]:
    """The fields of ``cls`` that hold a number (an int or a float, optional or not), read
    from their declared types."""
    numeric = ("int", "float", "int | None", "float | None")
    return [f.name for f in attrs.fields(cls) if f.type in numeric]


def _refusal(build: Callable[[], object]) -> str:
    with pytest.raises((TypeError, ValueError)) as caught:
        build()
    return str(caught.value)


# --------------------------------------------------------------------------- policies
def test_the_walk_covers_every_numeric_field_of_both_policies() -> None:
    """If a policy gains a number, it is walked below (and must reject what they reject)."""
    assert _numeric_fields(LoopPolicy) == [
        "max_function_call_iterations",
        "soft_warn_iteration",
        "max_consecutive_tool_errors",
        "max_identical_calls",
        "max_tool_calls",
        "continuation_tool_failure_threshold",
        "inactivity_timeout",
        "first_token_timeout",
        "abandoned_stream_settle",
        "tool_timeout",
        "max_parallel_tools",
        "tool_failure_notice_limit",
        "delivery_flush_chars",
        "host_call_timeout",
        "cancel_grace",
        "max_pass_duration",
        "held_prose_max_bytes",
        "held_prose_max_segments",
        "send_message_limit",
        "max_reviews",
        "max_revisions",
        "max_tool_reviews",
        "max_tool_corrections",
        "review_timeout",
    ]
    assert _numeric_fields(TurnPolicy) == [
        "max_key_attempts_per_model",
        "rate_limit_cooldown",
        "failure_cooldown",
    ]


@pytest.mark.parametrize("value", NOT_FINITE_OR_NEGATIVE, ids=repr)
@pytest.mark.parametrize("name", _numeric_fields(LoopPolicy))
def test_a_loop_policy_refuses_nan_infinity_and_negatives_naming_the_field(
    name: str, value: float
) -> None:
    fields: dict[str, Any] = {name: value}
    message = _refusal(lambda: LoopPolicy(**fields))
    assert name in message


@pytest.mark.parametrize("value", NOT_FINITE_OR_NEGATIVE, ids=repr)
@pytest.mark.parametrize("name", _numeric_fields(TurnPolicy))
def test_a_turn_policy_refuses_nan_infinity_and_negatives_naming_the_field(
    name: str, value: float
) -> None:
    fields: dict[str, Any] = {name: value}
    message = _refusal(lambda: TurnPolicy(**fields))
    assert name in message


@pytest.mark.parametrize(
    "name",
    [
        "max_function_call_iterations",
        "soft_warn_iteration",
        "max_consecutive_tool_errors",
        "max_identical_calls",
        "max_tool_calls",
        "continuation_tool_failure_threshold",
        "inactivity_timeout",
        "first_token_timeout",
        "tool_timeout",
        "max_parallel_tools",
        "tool_failure_notice_limit",
        "delivery_flush_chars",
    ],
)
def test_a_loop_policy_refuses_zero_where_zero_means_nothing_could_happen(name: str) -> None:
    fields: dict[str, Any] = {name: 0}
    assert name in _refusal(lambda: LoopPolicy(**fields))


def test_zero_is_a_valid_settle_window_and_cooldown() -> None:
    assert LoopPolicy(abandoned_stream_settle=0).abandoned_stream_settle == 0
    no_pause = TurnPolicy(rate_limit_cooldown=0, failure_cooldown=0)
    assert (no_pause.rate_limit_cooldown, no_pause.failure_cooldown) == (0, 0)


@pytest.mark.parametrize("name", ["max_function_call_iterations", "delivery_flush_chars"])
@pytest.mark.parametrize("value", [2.5, "100", True, None], ids=repr)
def test_a_count_must_be_a_whole_number(name: str, value: Any) -> None:
    fields: dict[str, Any] = {name: value}
    assert name in _refusal(lambda: LoopPolicy(**fields))


@pytest.mark.parametrize("value", ["120", True, None, [1.0]], ids=repr)
def test_a_budget_must_be_a_number(value: Any) -> None:
    assert "inactivity_timeout" in _refusal(lambda: LoopPolicy(inactivity_timeout=value))


def test_whole_seconds_are_a_valid_budget() -> None:
    assert LoopPolicy(inactivity_timeout=30, first_token_timeout=60).first_token_timeout == 60


def test_the_suppressed_tools_given_as_one_string_are_refused_not_split_into_letters() -> None:
    message = _refusal(
        lambda: LoopPolicy(suppress_followup_after_pre_tool_text="update_short_term_memory")
    )
    assert "suppress_followup_after_pre_tool_text" in message


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"memory_tool_name": ""}, "memory_tool_name"),
        ({"at_ceiling": "stop"}, "at_ceiling"),
        ({"at_ceiling": None}, "at_ceiling"),
        ({"memory_tool_name": None}, "memory_tool_name"),
        ({"end_after_pre_tool_text": "never"}, "end_after_pre_tool_text"),
        (
            {"suppress_followup_after_pre_tool_text": [1, 2]},
            "suppress_followup_after_pre_tool_text",
        ),
    ],
)
def test_a_loop_policy_refuses_other_wrong_values_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    assert name in _refusal(lambda: LoopPolicy(**changes))


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"loop": {"inactivity_timeout": 5.0}}, "loop"),
        ({"allow_shared_route": "no"}, "allow_shared_route"),
    ],
)
def test_a_turn_policy_refuses_other_wrong_values_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    assert name in _refusal(lambda: TurnPolicy(**changes))


# --------------------------------------------------------------------------- key book
@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"cooldown_until": math.nan}, "cooldown_until"),
        ({"cooldown_until": math.inf}, "cooldown_until"),
        ({"cooldown_until": -math.inf}, "cooldown_until"),
        ({"cooldown_until": "soon"}, "cooldown_until"),
        ({"retired": "yes"}, "retired"),
        ({"successes": -1}, "successes"),
        ({"failures": 1.5}, "failures"),
    ],
)
def test_a_key_health_entry_refuses_a_cooldown_that_never_ends_or_wrong_counts(
    changes: dict[str, Any], name: str
) -> None:
    assert name in _refusal(lambda: KeyHealth(**changes))


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"label": ""}, "label"),
        ({"label": 3}, "label"),
        ({"keys": -1}, "keys"),
        ({"keys": 1.0}, "keys"),
        ({"tool_calling": "json"}, "tool_calling"),
        ({"route": "operator"}, "route"),
    ],
)
def test_an_attempt_plan_refuses_wrong_values_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    assert name in _refusal(lambda: AttemptPlan(**{"label": "m0", **changes}))


# --------------------------------------------------------------------------- tools
def _tool(**changes: object) -> Tool:
    fields: dict[str, Any] = {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object"},
        "handler": _answer,
        **changes,
    }
    return Tool(**fields)


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"parameters": '{"type": "object"}'}, "parameters"),
        ({"parameters": None}, "parameters"),
        ({"parameters": [("type", "object")]}, "parameters"),
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"name": None}, "name"),
        ({"name": 7}, "name"),
        ({"handler": "get_weather"}, "handler"),
        ({"handler": None}, "handler"),
        ({"description": None}, "description"),
        ({"requires_follow_up": "no"}, "requires_follow_up"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": math.inf}, "timeout"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -5.0}, "timeout"),
        ({"timeout": "30"}, "timeout"),
        ({"redact": "***"}, "redact"),
    ],
)
def test_a_tool_with_a_wrong_value_is_refused_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    assert name in _refusal(lambda: _tool(**changes))


def test_a_well_formed_tool_is_accepted() -> None:
    tool = _tool(timeout=30, redact=lambda arguments: arguments, requires_follow_up=False)
    assert tool.spec().name == "get_weather"


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"success": "false"}, "success"),
        ({"message": 404}, "message"),
        ({"end_turn": "yes"}, "end_turn"),
        ({"delivered": 1}, "delivered"),
        ({"expression": 12}, "expression"),
        ({"context_restart": {"item": {"kind": "memory"}}}, "context_restart"),
    ],
)
def test_a_tool_result_with_a_wrong_value_is_refused_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    assert name in _refusal(lambda: ToolResult(**changes))


def test_a_registry_refuses_two_tools_with_the_same_name() -> None:
    message = _refusal(lambda: ToolRegistry([_tool(), _tool(description="again")]))
    assert "get_weather" in message and "twice" in message


@pytest.mark.parametrize(
    "tools", [["get_weather"], [_answer], [None]], ids=["a name", "a handler", "None"]
)
def test_a_registry_refuses_what_is_not_a_tool(tools: list[object]) -> None:
    message = _refusal(lambda: ToolRegistry(tools))  # type: ignore[arg-type]
    assert "Tool" in message and type(tools[0]).__name__ in message


def test_a_registry_given_one_tool_instead_of_a_collection_says_so() -> None:
    message = _refusal(lambda: ToolRegistry(_tool()))  # type: ignore[arg-type]
    assert "collection of Tool" in message


# --------------------------------------------------------------------------- the request
@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"context": "what's the weather in Paris?"}, "context"),
        ({"context": USER[0]}, "context"),
        ({"context": ["what's the weather in Paris?"]}, "context"),
        ({"context": None}, "context"),
        ({"tools_allowed": "get_weather"}, "tools_allowed"),
        ({"tools_allowed": [1, 2]}, "tools_allowed"),
        ({"prefill": 5}, "prefill"),
        ({"thought_log_owner": None}, "thought_log_owner"),
        ({"max_output": 0}, "max_output"),
        ({"max_output": -1}, "max_output"),
        ({"max_output": math.inf}, "max_output"),
        ({"max_output": 1.5}, "max_output"),
    ],
)
def test_a_request_with_a_wrong_value_is_refused_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    fields: dict[str, Any] = {"context": USER, **changes}
    assert name in _refusal(lambda: TurnRequest(**fields))


def test_a_request_keeps_its_messages_and_allowlist_as_given() -> None:
    request = TurnRequest(USER, tools_allowed=["get_weather"], max_output=512)
    assert request.context == tuple(USER)
    assert request.tools_allowed == frozenset({"get_weather"})


# --------------------------------------------------------------------------- attempts
def test_keys_given_as_one_string_are_refused_not_split_into_one_key_per_letter() -> None:
    provider = ScriptedProvider([])
    message = _refusal(lambda: Attempt(provider, keys="sk-abc"))
    assert "keys" in message
    assert "sk-abc" not in message  # a key is never shown, not even a mistaken one


@pytest.mark.parametrize(
    "keys", [["sk-live-AAAA1111", ""], [b"sk-live-AAAA1111"], ["sk-live-AAAA1111", None]]
)
def test_a_key_that_is_not_a_non_empty_string_is_refused_without_showing_it(
    keys: list[object],
) -> None:
    message = _refusal(lambda: Attempt(ScriptedProvider([]), keys=keys))
    assert "keys" in message and "AAAA1111" not in message


def test_the_same_key_twice_is_refused_without_showing_it() -> None:
    keys = ["sk-live-AAAA1111", "sk-live-AAAA1111"]
    message = _refusal(lambda: Attempt(ScriptedProvider([]), keys=keys))
    assert "keys" in message and "twice" in message and "AAAA1111" not in message


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"provider": "openai"}, "provider"),
        ({"provider": None}, "provider"),
        ({"label": ""}, "label"),
        ({"label": 3}, "label"),
        ({"tool_calling": "json"}, "tool_calling"),
    ],
)
def test_an_attempt_with_a_wrong_value_is_refused_naming_the_field(
    changes: dict[str, Any], name: str
) -> None:
    fields: dict[str, Any] = {"provider": ScriptedProvider([]), **changes}
    assert name in _refusal(lambda: Attempt(**fields))


def test_a_provider_factory_and_a_keyless_provider_are_both_accepted() -> None:
    provider = ScriptedProvider([])
    assert Attempt(lambda _key: provider, keys=["sk-live-AAAA1111"]).make_provider("k") is provider
    assert Attempt(provider, tool_calling="verbatim").keys == ()


def test_a_shared_route_refuses_a_single_attempt_and_an_admission_that_is_not_callable() -> None:
    attempt = Attempt(ScriptedProvider([]))
    assert "attempts" in _refusal(lambda: SharedRoute(attempt, lambda _request: True))  # type: ignore[arg-type]
    assert "attempts" in _refusal(lambda: SharedRoute(["openai"], lambda _request: True))
    assert "admit" in _refusal(lambda: SharedRoute([attempt], True))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the entry points
class _ChannelWithoutNotices:
    """A host's channel that forgot `send_notice` (it would only be missed when a notice is
    posted, after the reply was sent)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def send_text(self, text: str) -> None:
        self.texts.append(text)

    async def send_expression(self, expression: str) -> None:
        self.texts.append(expression)

    async def queue_front(self, stop_message: str) -> None:
        self.texts.append(stop_message)


def _loop_call(**changes: Any) -> Callable[[], Any]:
    """A `run_tool_loop` call with ``changes`` (each test's own event loop and clock)."""
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=VirtualClock())
    fields: dict[str, Any] = {
        "provider": provider,
        "tools": [],
        "channel": RecordingChannel(),
        "request": TurnRequest(USER),
        "clock": VirtualClock(),
        **changes,
    }
    return lambda: asyncio.run(run_tool_loop(**fields))


def _chain_call(**changes: Any) -> Callable[[], Any]:
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=VirtualClock())
    fields: dict[str, Any] = {
        "attempts": [Attempt(provider)],
        "tools": [],
        "channel": RecordingChannel(),
        "request": TurnRequest(USER),
        "clock": VirtualClock(),
        **changes,
    }
    return lambda: asyncio.run(run_generation_turn(**fields))


def _type_error(call: Callable[[], Any]) -> str:
    with pytest.raises(TypeError) as caught:
        call()
    return str(caught.value)


def test_run_tool_loop_given_a_turn_policy_says_which_entry_point_takes_one() -> None:
    message = _type_error(_loop_call(policy=TurnPolicy()))
    assert message == (
        "run_tool_loop(policy=…): expected a LoopPolicy, got TurnPolicy "
        "(run_generation_turn takes a TurnPolicy)"
    )


def test_run_generation_turn_given_a_loop_policy_says_which_entry_point_takes_one() -> None:
    message = _type_error(_chain_call(policy=LoopPolicy()))
    assert message == (
        "run_generation_turn(policy=…): expected a TurnPolicy, got LoopPolicy "
        "(run_tool_loop takes a LoopPolicy; wrap it as TurnPolicy(loop=…))"
    )


def test_run_tool_loop_without_a_provider_is_refused_at_the_call_not_a_provider_error() -> None:
    channel = RecordingChannel()
    message = _type_error(_loop_call(provider=None, channel=channel))
    assert message == (
        "run_tool_loop(provider=…): expected a Provider (an object with a stream method), "
        "got NoneType"
    )
    assert channel.delivered == [] and channel.notices == []


@pytest.mark.parametrize("entry", ["run_tool_loop", "run_generation_turn"])
def test_a_channel_lacking_send_notice_is_refused_at_the_call_before_anything_is_sent(
    entry: str,
) -> None:
    channel = _ChannelWithoutNotices()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=VirtualClock())
    if entry == "run_tool_loop":
        call = _loop_call(provider=provider, channel=channel)
    else:
        call = _chain_call(attempts=[Attempt(provider)], channel=channel)
    message = _type_error(call)
    assert message == f"{entry}(channel=…): the channel lacks send_notice"
    assert provider.requests == [] and channel.texts == []


def test_a_channel_lacking_several_methods_is_told_all_of_them() -> None:
    message = _type_error(_loop_call(channel=object()))
    assert message == (
        "run_tool_loop(channel=…): the channel lacks send_text, send_expression, send_notice "
        "and queue_front"
    )


def test_resuming_a_tool_loop_checks_its_arguments_at_the_call_too() -> None:
    snapshots: list[TurnSnapshot] = []
    _loop_call(on_snapshot=snapshots.append)()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=VirtualClock())
    resumed = resume_tool_loop(snapshots[0], provider, [], _ChannelWithoutNotices())  # type: ignore[arg-type]
    message = _type_error(lambda: asyncio.run(resumed))
    assert message == "resume_tool_loop(channel=…): the channel lacks send_notice"
    assert provider.requests == []
