"""`@tool`: a `Tool` built from a typed function — its name, its docstring's first paragraph,
and a parameters schema pydantic derives from the signature (or one the host passes)."""

from __future__ import annotations

import datetime
import sys
import threading
from typing import Annotated
from typing import Any
from typing import Literal

import pytest
from pydantic import AfterValidator
from pydantic import BaseModel
from pydantic import Field

from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnStatus
from toolloop_fsm import tool


def answered_turn(arguments: dict[str, Any], name: str = "get_weather") -> Any:
    return scripted_turn([[FunctionCall(name, arguments)], [TextDelta("Done.")]])


async def test_tool_builds_a_tool_from_an_async_function_its_docstring_and_type_hints() -> None:
    calls: list[tuple[str, int]] = []

    @tool
    async def get_weather(city: str, days: int = 1) -> ToolResult:
        """Current weather for a city,
        for today or the next few days.

        Longer notes for the host's readers, not for the model.
        """
        calls.append((city, days))
        return ToolResult(data={"city": city, "days": days})

    assert isinstance(get_weather, Tool)
    assert get_weather.name == "get_weather"
    assert get_weather.description == (
        "Current weather for a city, for today or the next few days."
    )
    schema = get_weather.parameters
    assert set(schema["properties"]) == {"city", "days"}
    assert schema["required"] == ["city"]
    assert schema["additionalProperties"] is False
    turn = answered_turn({"city": "Paris"})
    result = await run_turn(turn, [get_weather])
    assert result.status is TurnStatus.COMPLETED
    assert result.history[0].response.data == {"city": "Paris", "days": 1}
    assert calls == [("Paris", 1)]


async def test_the_model_is_told_which_argument_of_a_decorated_function_is_wrong() -> None:
    @tool
    async def get_weather(city: str, days: Annotated[int, Field(ge=1)] = 1) -> ToolResult:
        """Current weather."""
        raise AssertionError("not called with bad arguments")

    result = await run_turn(answered_turn({"days": 0}), [get_weather])
    # every violation is named, though the schema's checker stops at the first
    assert result.history[0].response.reason == (
        "arguments.city: required; arguments.days: minimum (must be bigger than or equal to 1)"
    )
    result = await run_turn(answered_turn({"city": "Paris", "days": 0}), [get_weather])
    reason = result.history[0].response.reason
    assert reason == "arguments.days: minimum (must be bigger than or equal to 1)"
    result = await run_turn(answered_turn({"city": "Paris", "hours": 3}), [get_weather])
    reason = result.history[0].response.reason
    assert reason == "arguments.hours: additionalProperties (not allowed)"


async def test_a_decorated_function_declaring_a_tool_context_receives_it() -> None:
    seen: list[tuple[str, int]] = []

    @tool
    async def get_weather(city: str, context: ToolContext) -> ToolResult:
        """Current weather."""
        seen.append((context.tool_name, context.dispatch))
        return ToolResult(data=city)

    assert set(get_weather.parameters["properties"]) == {"city"}  # not shown to the model
    result = await run_turn(answered_turn({"city": "Paris"}), [get_weather])
    assert result.history[0].response.data == "Paris"
    assert seen == [("get_weather", 1)]


async def test_a_decorated_plain_function_runs_in_a_worker_thread() -> None:
    threads: list[int] = []

    @tool
    def get_weather(city: str) -> ToolResult:
        """Current weather."""
        threads.append(threading.get_ident())
        return ToolResult(data=city)

    result = await run_turn(answered_turn({"city": "Paris"}), [get_weather])
    assert result.history[0].response.data == "Paris"
    assert threads and threads[0] != threading.get_ident()


class Place(BaseModel):
    lat: float
    lon: float


async def test_a_decorated_function_gets_its_arguments_in_their_annotated_types() -> None:
    received: list[tuple[Place, datetime.date, str]] = []

    @tool
    async def forecast(place: Place, day: datetime.date, units: Literal["C", "F"] = "C") -> Any:
        """Forecast for a place on a day."""
        received.append((place, day, units))
        return ToolResult(data={"lat": place.lat, "day": day.isoformat()})

    assert "$defs" in forecast.parameters  # the model's schema, kept as pydantic writes it
    arguments = {"place": {"lat": 48.85, "lon": 2.35}, "day": "2025-06-01"}
    result = await run_turn(answered_turn(arguments, "forecast"), [forecast])
    assert result.history[0].response.success, result.history[0].response.reason
    assert received == [(Place(lat=48.85, lon=2.35), datetime.date(2025, 6, 1), "C")]
    # the history keeps what the model sent
    assert result.history[0].call.arguments == arguments
    result = await run_turn(
        answered_turn({"place": {"lat": 1}, "day": "2025-06-01"}, "forecast"), [forecast]
    )
    assert result.history[0].response.reason == "arguments.place.lon: required"


def _no_blank(city: str) -> str:
    if not city.strip():
        raise ValueError("a city cannot be blank")
    return city


async def test_an_annotated_validator_refusing_an_argument_fails_the_call_in_the_same_form() -> (
    None
):
    @tool
    async def get_weather(city: Annotated[str, AfterValidator(_no_blank)]) -> ToolResult:
        """Current weather."""
        raise AssertionError("not called with a blank city")

    result = await run_turn(answered_turn({"city": "  "}), [get_weather])
    assert result.status is TurnStatus.COMPLETED
    assert result.history[0].response.reason == (
        "arguments.city: value_error (Value error, a city cannot be blank)"
    )


async def test_tool_options_override_what_the_function_says() -> None:
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    notes: list[Any] = []

    def hide(arguments: Any) -> Any:
        return {"note": "…"}

    @tool(
        name="update_short_term_memory",
        description="Remember a short note about the user.",
        schema=schema,
        timeout=20,
        requires_follow_up=False,
        replay="rerun",
        redact=hide,
    )
    async def remember(note: str) -> ToolResult:
        notes.append(note)
        return ToolResult(data={"saved": True})

    assert (remember.name, remember.description) == (
        "update_short_term_memory",
        "Remember a short note about the user.",
    )
    assert remember.parameters == schema
    assert (remember.timeout, remember.requires_follow_up, remember.replay) == (20, False, "rerun")
    assert remember.redact is hide
    result = await run_turn(answered_turn({"note": "likes tea"}, remember.name), [remember])
    assert result.history[0].response.success
    assert notes == ["likes tea"]


async def test_without_pydantic_tool_asks_for_the_extra_or_an_explicit_schema(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pydantic", None)  # as if it were not installed

    with pytest.raises(ImportError) as refused:

        @tool
        async def get_weather(city: str) -> ToolResult:
            """Current weather."""
            return ToolResult()

    assert "install toolloop-fsm[pydantic] or pass schema=" in str(refused.value)
    assert "get_weather" in str(refused.value)

    schema = {"type": "object", "properties": {"when": {"type": "string"}}}

    @tool(schema=schema)
    async def clock(when: str = "now") -> ToolResult:
        """The time somewhere."""
        return ToolResult(data=when)

    result = await run_turn(answered_turn({"when": "2025-06-01"}, "clock"), [clock])
    assert result.history[0].response.data == "2025-06-01"  # as the model sent it


def test_a_function_without_a_docstring_needs_a_description() -> None:
    async def get_weather(city: str) -> ToolResult:
        return ToolResult()

    with pytest.raises(TypeError, match=r"get_weather has no docstring .* pass description="):
        tool(get_weather)
    assert tool(description="Current weather.")(get_weather).description == "Current weather."


def test_a_function_taking_arguments_positionally_is_refused() -> None:
    async def by_position(city: str, /) -> ToolResult:
        """Current weather."""
        return ToolResult()

    async def star_args(*cities: str) -> ToolResult:
        """Current weather."""
        return ToolResult()

    for function in (by_position, star_args):
        with pytest.raises(TypeError, match="a tool's arguments are passed by name"):
            tool(function)


def test_a_function_whose_type_hints_cannot_be_read_is_refused_naming_it() -> None:
    async def get_weather(city: NoSuchType) -> ToolResult:  # type: ignore[name-defined]  # noqa: F821
        """Current weather."""
        return ToolResult()

    with pytest.raises(TypeError, match="cannot read the type hints of get_weather"):
        tool(get_weather)


def test_a_tool_is_not_idempotent_unless_marked_so() -> None:
    """A durable turn runs a tool again after a lost worker only when it is marked idempotent,
    so the mark is opt-in and must be a real bool."""

    @tool(idempotent=True)
    async def lookup(city: str) -> ToolResult:
        """Looks a city up."""
        return ToolResult(data=city)

    @tool
    async def charge(cents: int) -> ToolResult:
        """Charges the card."""
        return ToolResult(data=cents)

    assert lookup.idempotent is True
    assert charge.idempotent is False
    with pytest.raises(TypeError, match="idempotent"):
        Tool("t", "d", {}, charge.handler, idempotent="yes")  # type: ignore[arg-type]


def test_a_decorated_tool_carries_its_reconcile_hook_and_idempotence() -> None:
    async def look_the_payment_up(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"paid": arguments["cents"]})

    @tool(reconcile=look_the_payment_up)
    async def pay(cents: int) -> ToolResult:
        """Pays a bill."""
        return ToolResult(data={"paid": cents})

    @tool(idempotent=True)
    async def find_city(city: str) -> ToolResult:
        """Finds a city."""
        return ToolResult(data=city)

    assert pay.reconcile is look_the_payment_up
    assert (pay.idempotent, find_city.idempotent, find_city.reconcile) == (False, True, None)
    with pytest.raises(TypeError, match=r"Tool 'pay': reconcile must be a function"):
        tool(reconcile=5)(pay.handler)  # type: ignore[call-overload]
