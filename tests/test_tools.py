"""Tools as hosts write them: arguments checked against the tool's schema before the handler
runs, plain (sync) handlers run in a worker thread under the tool's deadline, and a failing
handler is a failed call for the model and a WARNING with its traceback for the host."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import json
import logging
import threading
import urllib.request
from typing import Any

import fastjsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnStatus
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.result import make_converter
from toolloop_fsm.result import result_to_json
from toolloop_fsm.tools import _check_arguments

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1},
        "stops": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city"],
    "additionalProperties": False,
}


def weather_tool(handler: Any, schema: dict[str, Any] | None = None, **options: Any) -> Tool:
    return Tool(
        "get_weather",
        "the weather in a city",
        WEATHER_SCHEMA if schema is None else schema,
        handler,
        **options,
    )


def recording_handler(calls: list[dict[str, Any]]) -> Any:
    async def handler(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        calls.append(arguments)
        return ToolResult(data={"sky": "clear"})

    return handler


def sorry_turn(*calls: FunctionCall) -> Any:
    """A turn whose model makes ``calls`` (one per pass), then says sorry."""
    return scripted_turn([*([call] for call in calls), [TextDelta("Sorry.")]])


# --------------------------------------------------------------------------- the name
@pytest.mark.parametrize(
    "name",
    ["get weather", "get.weather", "météo", "weather/today", "a" * 65, "", "get_weather\n"],
    ids=["space", "dot", "accented", "slash", "65 characters", "empty", "newline"],
)
def test_a_tool_name_every_provider_refuses_is_refused_at_construction(name: str) -> None:
    with pytest.raises(ValueError) as refused:
        Tool(name, "the weather in a city", WEATHER_SCHEMA, recording_handler([]))
    message = str(refused.value)
    assert repr(name) in message
    assert "^[a-zA-Z0-9_-]{1,64}$" in message


@pytest.mark.parametrize("name", ["get_weather", "get-weather", "Weather2", "a" * 64, "_"])
def test_a_tool_name_of_letters_digits_underscores_and_hyphens_is_accepted(name: str) -> None:
    assert Tool(name, "the weather", WEATHER_SCHEMA, recording_handler([])).name == name


# --------------------------------------------------------------------------- the schema
@pytest.mark.parametrize(
    ("arguments", "told"),
    [
        ({"days": 2}, "arguments.city: required"),
        (
            {"city": "Paris", "days": 0},
            "arguments.days: minimum (must be bigger than or equal to 1)",
        ),
        ({"city": "Paris", "days": "2"}, "arguments.days: type (must be integer)"),
        ({"city": "Paris", "stops": ["Lyon", 3]}, "arguments.stops[1]: type (must be string)"),
        ({"city": "Paris", "when": "now"}, "arguments.when: additionalProperties (not allowed)"),
    ],
    ids=["missing", "below the minimum", "wrong type", "nested", "not allowed"],
)
async def test_arguments_that_break_the_schema_fail_the_call_naming_the_path_and_the_rule(
    arguments: dict[str, Any], told: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[dict[str, Any]] = []
    turn = sorry_turn(FunctionCall("get_weather", arguments))
    with caplog.at_level(logging.INFO, logger="toolloop_fsm"):
        result = await run_turn(turn, [weather_tool(recording_handler(calls))])
    assert result.status is TurnStatus.COMPLETED
    response = result.history[0].response
    assert not response.success
    assert response.reason == told
    assert calls == []  # the handler never ran
    # the model's mistake is the model's to fix: nothing for the host to act on
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    # the hidden failure notice tells the host what the model was told
    assert told in turn.channel.notices[0].params["summary"]


async def test_every_missing_required_argument_is_named() -> None:
    schema = {**WEATHER_SCHEMA, "required": ["city", "days"]}
    turn = sorry_turn(FunctionCall("get_weather", {}))
    result = await run_turn(turn, [weather_tool(recording_handler([]), schema)])
    reason = result.history[0].response.reason
    assert reason == "arguments.city: required; arguments.days: required"


async def test_every_violation_is_named_not_only_the_first() -> None:
    arguments = {"city": 3, "days": 0, "stops": ["Lyon", 3], "when": "now"}
    turn = sorry_turn(FunctionCall("get_weather", arguments))
    calls: list[dict[str, Any]] = []
    result = await run_turn(turn, [weather_tool(recording_handler(calls))])
    assert result.history[0].response.reason == (
        "arguments.when: additionalProperties (not allowed); "
        "arguments.city: type (must be string); "
        "arguments.days: minimum (must be bigger than or equal to 1); "
        "arguments.stops[1]: type (must be string)"
    )
    assert calls == []


async def test_past_ten_violations_the_rest_are_counted() -> None:
    turn = sorry_turn(FunctionCall("get_weather", {"city": "Paris", "stops": list(range(15))}))
    result = await run_turn(turn, [weather_tool(recording_handler([]))])
    reason = result.history[0].response.reason
    assert reason is not None
    named = [f"arguments.stops[{i}]: type (must be string)" for i in range(10)]
    assert reason == "; ".join([*named, "and 5 more"])


ADDRESS_SCHEMA = {
    "type": "object",
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["street", "zip"],
        }
    },
    "properties": {"home": {"$ref": "#/$defs/Address"}, "work": {"$ref": "#/$defs/Address"}},
    "required": ["home"],
}


async def test_violations_inside_referenced_definitions_are_each_named() -> None:
    # the shape pydantic gives nested models (`@tool`): properties that are $ref to $defs
    arguments = {"home": {"zip": "75001"}, "work": {"street": 5, "zip": 1}}
    turn = sorry_turn(FunctionCall("ship", arguments))
    tool = Tool("ship", "ships a parcel", ADDRESS_SCHEMA, recording_handler([]))
    result = await run_turn(turn, [tool])
    assert result.history[0].response.reason == (
        "arguments.home.street: required; arguments.home.zip: type (must be integer); "
        "arguments.work.street: type (must be string)"
    )


async def test_a_schema_that_cannot_be_taken_apart_names_its_first_violation() -> None:
    schema = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    turn = sorry_turn(FunctionCall("pick", {"a": 1}))
    result = await run_turn(turn, [Tool("pick", "picks", schema, recording_handler([]))])
    assert result.history[0].response.reason == (
        "arguments: anyOf (cannot be validated by any definition)"
    )


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["Paris", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner),
    max_leaves=8,
)


@given(
    st.dictionaries(st.sampled_from(["city", "days", "stops", "when"]), JSON_VALUES),
    st.sampled_from([WEATHER_SCHEMA, ADDRESS_SCHEMA]),
)
def test_a_refusal_names_what_the_validator_found_and_only_refused_arguments_are_refused(
    arguments: dict[str, Any], schema: dict[str, Any]
) -> None:
    tool = Tool("get_weather", "the weather", schema, recording_handler([]))
    refusal = _check_arguments(tool, 1, arguments)
    try:
        fastjsonschema.compile(schema)(arguments)
    except fastjsonschema.JsonSchemaValueException as first:
        assert refusal is not None
        assert "arguments" + str(first.name).removeprefix("data") in refusal
        assert len(refusal.split("; ")) <= 11
    else:
        assert refusal is None


async def test_arguments_that_fit_the_schema_reach_the_handler_as_sent() -> None:
    calls: list[dict[str, Any]] = []
    schema = {"type": "object", "properties": {"days": {"type": "integer", "default": 1}}}
    turn = sorry_turn(FunctionCall("get_weather", {"city": "Paris"}))
    result = await run_turn(turn, [weather_tool(recording_handler(calls), schema)])
    assert result.history[0].response.success
    assert calls == [{"city": "Paris"}]  # checked, not rewritten: no default filled in


async def test_refused_arguments_count_toward_the_consecutive_error_ceiling() -> None:
    calls: list[dict[str, Any]] = []
    bad = FunctionCall("get_weather", {"town": "Paris"})
    turn = scripted_turn([[bad], [bad], [bad], [TextDelta("never")]])
    policy = LoopPolicy(max_consecutive_tool_errors=2)
    result = await run_turn(turn, [weather_tool(recording_handler(calls))], policy=policy)
    assert result.status is TurnStatus.ERROR
    assert result.reason == "consecutive_tool_errors"
    assert calls == []


async def test_a_schema_is_compiled_on_the_first_dispatch_once_for_every_tool_sharing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled: list[Any] = []
    compile_schema = fastjsonschema.compile

    def counting(definition: Any, *args: Any, **kwargs: Any) -> Any:
        compiled.append(definition)
        return compile_schema(definition, *args, **kwargs)

    monkeypatch.setattr(fastjsonschema, "compile", counting)
    # a schema no other test uses, so that no earlier dispatch compiled it
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 913}}}
    tools = [weather_tool(recording_handler([]), schema) for _ in range(3)]
    assert compiled == []  # building tools compiles nothing
    for built in tools:  # a host that builds its tools again for every turn
        turn = sorry_turn(weather_call(), weather_call())
        result = await run_turn(turn, [built])
        assert [entry.response.success for entry in result.history] == [True, True]
    assert compiled == [schema]


async def test_a_schema_that_does_not_compile_fails_the_call_and_logs_an_error_naming_the_tool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[dict[str, Any]] = []
    schema = {"type": "object", "properties": {"city": {"type": "strng"}}}
    turn = sorry_turn(weather_call())
    with caplog.at_level(logging.ERROR, logger="toolloop_fsm"):
        result = await run_turn(turn, [weather_tool(recording_handler(calls), schema)])
    reason = result.history[0].response.reason or ""
    assert reason.startswith("the tool's parameters schema is invalid, so it was not called")
    assert "Unknown type" in reason
    assert calls == []
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert "tool get_weather (dispatch 1)" in record.getMessage()
    assert "Unknown type" in record.getMessage()


async def test_a_schema_referring_to_another_document_is_never_fetched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fetched: list[Any] = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: fetched.append(a))
    schema = {"$ref": "https://schemas.example.invalid/weather.json"}
    turn = sorry_turn(weather_call())
    result = await run_turn(turn, [weather_tool(recording_handler([]), schema)])
    assert fetched == []
    reason = result.history[0].response.reason or ""
    assert "https://schemas.example.invalid/weather.json names another document" in reason


def test_a_tool_whose_parameters_are_not_json_is_refused_when_it_is_built() -> None:
    with pytest.raises(ValueError, match="Tool 'get_weather': parameters must be a JSON schema"):
        weather_tool(recording_handler([]), {"type": "object", "required": {"city"}})


def weather_call() -> FunctionCall:
    return FunctionCall("get_weather", {"city": "Paris"})


# --------------------------------------------------------------------------- plain handlers
async def test_a_plain_function_handler_runs_in_a_worker_thread() -> None:
    loop_thread = threading.get_ident()
    seen: list[tuple[int, dict[str, Any], int]] = []

    def get_weather(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        seen.append((threading.get_ident(), arguments, ctx.dispatch))
        return ToolResult(data={"sky": "clear"}, message="live data")

    turn = sorry_turn(weather_call())
    result = await run_turn(turn, [weather_tool(get_weather)])
    assert result.status is TurnStatus.COMPLETED
    assert result.history[0].response.data == {"sky": "clear"}
    [(thread, arguments, dispatch)] = seen
    assert thread != loop_thread  # the event loop was never blocked by it
    assert (arguments, dispatch) == ({"city": "Paris"}, 1)


async def test_a_plain_handler_sees_the_turns_context_variables() -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")
    request_id.set("req-42")
    seen: list[str] = []

    def get_weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        seen.append(request_id.get("unset"))
        return ToolResult()

    await run_turn(sorry_turn(weather_call()), [weather_tool(get_weather)])
    assert seen == ["req-42"]


async def test_a_plain_handler_doing_real_work_under_a_virtual_clock_succeeds() -> None:
    def get_weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        # real CPU work in the worker thread (tens of milliseconds), not a sleep: the event
        # loop sits idle meanwhile, which is when a virtual clock could jump to the deadline
        hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 50_000)
        return ToolResult(data={"sky": "clear"})

    turn = sorry_turn(weather_call())
    result = await run_turn(turn, [weather_tool(get_weather)])
    # virtual time did not jump over the thread's work to its 300-second deadline
    assert result.history[0].response.success, result.history[0].response.reason
    assert turn.clock.now() < 1.0


async def test_a_plain_handler_past_its_deadline_is_timed_out_and_its_thread_abandoned() -> None:
    release, finished = threading.Event(), threading.Event()

    def get_weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        release.wait(10)  # a stuck call; released when the test is over
        finished.set()
        return ToolResult()

    policy = LoopPolicy(cancel_grace=2)
    turn = sorry_turn(weather_call())
    try:
        result = await run_turn(turn, [weather_tool(get_weather, timeout=0.05)], policy=policy)
    finally:
        release.set()
    assert result.status is TurnStatus.COMPLETED
    assert result.history[0].response.reason == "timed out after 0.05 s"
    # a thread cannot be cancelled: it is abandoned and named like other stuck host code
    assert result.abandoned_calls == ("tool get_weather (dispatch 1)",)
    assert result.final_text == "Sorry."
    assert turn.clock.now() <= 0.05 + policy.cancel_grace + 1e-6
    await asyncio.to_thread(finished.wait, 10)


async def test_a_stop_while_a_plain_handler_runs_ends_the_turn_without_waiting_for_it() -> None:
    release, finished = threading.Event(), threading.Event()
    turn = sorry_turn(weather_call())

    def get_weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        turn.signals.request_stop("stopped")  # the host's /kill, from another thread
        release.wait(10)
        finished.set()
        return ToolResult()

    try:
        result = await run_turn(turn, [weather_tool(get_weather)])
    finally:
        release.set()
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.reason == "stopped_during_tool"
    assert result.abandoned_calls == ("tool get_weather (dispatch 1)",)
    assert turn.channel.queued_front == ["stopped"]
    await asyncio.to_thread(finished.wait, 10)


class AsyncCallable:
    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    async def __call__(self, _arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        self.seen.append(threading.get_ident())
        return ToolResult()


async def test_async_handlers_in_every_form_run_on_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    async def answer(_arguments: dict[str, Any], _ctx: ToolContext, *, tag: str) -> ToolResult:
        seen.append(threading.get_ident())
        return ToolResult(data=tag)

    async def plain(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await answer(arguments, ctx, tag="lambda")

    handlers = {
        "partial": functools.partial(answer, tag="partial"),
        "callable object": AsyncCallable(seen),
        "lambda returning a coroutine": lambda arguments, ctx: plain(arguments, ctx),
    }
    for form, handler in handlers.items():
        turn = sorry_turn(weather_call())
        result = await run_turn(turn, [weather_tool(handler)])
        assert result.history[0].response.success, (form, result.history[0].response.reason)
    assert seen == [loop_thread] * 3


# --------------------------------------------------------------------------- failing handlers
async def raising_async(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    raise LookupError("no station near Paris")


def raising_plain(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    raise LookupError("no station near Paris")


@pytest.mark.parametrize("handler", [raising_async, raising_plain], ids=["async", "plain"])
async def test_a_raising_handler_fails_the_call_and_is_logged_with_its_traceback(
    handler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    turn = sorry_turn(weather_call())
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_turn(turn, [weather_tool(handler)])
    assert result.history[0].response.reason == "LookupError: no station near Paris"
    [record] = caplog.records
    assert record.name == "toolloop_fsm.tools"
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("tool get_weather (dispatch 1) raised LookupError")
    assert record.exc_info is not None and isinstance(record.exc_info[1], LookupError)
    assert "Traceback" in caplog.text and "no station near Paris" in caplog.text
    assert "Paris" not in record.getMessage()  # the arguments are not logged


async def test_a_handler_returning_something_else_fails_the_call_and_is_logged_naming_the_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def get_weather(_arguments: dict[str, Any], _ctx: ToolContext) -> Any:
        return {"sky": "clear"}  # a dict, not a ToolResult

    turn = sorry_turn(weather_call())
    with caplog.at_level(logging.WARNING, logger="toolloop_fsm"):
        result = await run_turn(turn, [weather_tool(get_weather)])
    assert result.history[0].response.reason == "the handler returned dict, not ToolResult"
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "tool get_weather (dispatch 1) returned dict, not ToolResult"
    )


async def test_a_handler_reporting_its_own_failure_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def get_weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(success=False, message="the station is offline")

    turn = sorry_turn(weather_call())
    with caplog.at_level(logging.DEBUG, logger="toolloop_fsm"):
        result = await run_turn(turn, [weather_tool(get_weather)])
    assert result.history[0].response.reason == "the station is offline"
    # only the machine's transitions are logged (DEBUG), nothing about the tool
    assert [r.name for r in caplog.records if r.name != "toolloop_fsm.machine"] == []


@pytest.mark.parametrize("hook", [5, "look it up"])
def test_a_reconcile_hook_that_is_not_callable_is_refused_when_the_tool_is_built(
    hook: object,
) -> None:
    async def pay(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult()

    with pytest.raises(TypeError, match=r"Tool 'pay': reconcile must be a function"):
        Tool("pay", "pays", {"type": "object"}, pay, reconcile=hook)  # type: ignore[arg-type]


def test_a_call_in_doubt_survives_the_strict_reading_of_a_result() -> None:
    call = InDoubtCall("pay", 2, "call_1", InDoubtCause.WORKER_LOST, reconciled=True)
    result = GenerationTurnResult(TurnStatus.COMPLETED, in_doubt_calls=(call,))
    strict = make_converter(strict=True)

    read = strict.structure(json.loads(result_to_json(result)), GenerationTurnResult)

    assert read.in_doubt_calls == (call,)
    assert read.in_doubt_calls[0].cause is InDoubtCause.WORKER_LOST
