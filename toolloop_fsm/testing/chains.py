"""Hypothesis strategies for fuzzing the outer tier (the fallback chain), the harness that
runs them, and the chain invariant checker.

`generation_chains()` draws a `ChainScript`: a fallback chain of 1–4 models with 0–3 API
keys each, what each attempt does (per keyless model, per key), an optional shared route,
host signals at virtual instants, the host's behaviour (key book, channel) and a small
`TurnPolicy`. `run_chain(script)` runs it through `run_generation_turn` on a
`VirtualClock` and returns a `ChainRun` holding the result and every witness;
`check_chain_invariants(run)` raises `ChainInvariantViolation` naming what broke::

    @given(script=generation_chains())
    def test_my_chain_policy(script):
        run = asyncio.run(run_chain(script))
        check_chain_invariants(run)

The keys are fake but unique (``sk-test-<hex>``), so a key that leaks into a result, a
trace, a notice, a log record or an exception message is found by plain substring search.
With ``echo_keys`` the scripted providers and factories behave like careless real ones and
put their key into their error messages, which the engine must keep out of everything it
returns.

Strategies shrink toward short chains: one model, no keys, an attempt that simply answers,
no shared route, no signals. Like `toolloop_fsm.testing.strategies`, this module needs
Hypothesis; `toolloop_fsm.testing` imports it lazily.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from enum import Enum, StrEnum
from typing import Any

import attrs
from attrs import define, field, frozen
from hypothesis import strategies as st

from toolloop_fsm.attempts import AdmissionRequest, Attempt, KeyHealth, SharedRoute
from toolloop_fsm.events import FunctionCall, TextDelta
from toolloop_fsm.generation import FINAL_STATES
from toolloop_fsm.host import (
    DestinationUnreachable,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
    TurnRequest,
    TurnSignals,
)
from toolloop_fsm.policy import LoopPolicy, TurnPolicy
from toolloop_fsm.provider import Provider, ProviderError, ProviderRequest
from toolloop_fsm.pump import run_generation_turn
from toolloop_fsm.result import (
    AttemptRecord,
    GenerationTurnResult,
    Notice,
    TraceStep,
    TurnStatus,
    result_to_json,
)
from toolloop_fsm.scaffolding import is_verbatim_scaffolding
from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import VirtualClock, real_time_limit
from toolloop_fsm.testing.scripted import Fail, Pause, ScriptedProvider, ScriptItem

__all__ = [
    "CHAIN_INVARIANTS",
    "SHARED_TOOLS",
    "AttemptScript",
    "ChainChannel",
    "ChainInvariantViolation",
    "ChainRun",
    "ChainScript",
    "ChainSignal",
    "ChainToolExecution",
    "Ending",
    "ErrorKind",
    "FirstRequest",
    "KeyScript",
    "KeyState",
    "KeyUse",
    "ModelScript",
    "SharedRouteScript",
    "TimelineEntry",
    "ToolStep",
    "attempt_scripts",
    "chain_budget",
    "chain_signals",
    "check_chain_invariants",
    "generation_chains",
    "run_chain",
    "tool_call_key",
    "turn_policies",
]

# --------------------------------------------------------------------------- the tool universe
#: Tools every chain registers. Every attempt may call them with the same arguments, so a call
#: completed by one attempt is exactly what a later attempt asks for again (it must be reused).
#: ``send_sticker`` also delivers an expression (at most one per turn, across attempts).
SHARED_TOOLS: tuple[str, ...] = ("lookup", "remember", "send_sticker")
_ARGUMENTS: tuple[Mapping[str, Any], ...] = ({}, {"q": "Oslo"}, {"q": "Lima", "n": 2})
#: Each tool's dispatches take these virtual seconds in turn (every third one takes a while,
#: so that a stop, a follow-up or an unreachable report can arrive while a tool runs).
_TOOL_DELAYS: tuple[float, ...] = (0.0, 0.0, 0.5)
#: Every tool's deadline: longer than any scripted tool delay, so a tool always succeeds
#: (the no-call-twice property is then strict: any second execution is a re-run).
_TOOL_TIMEOUT = 5.0


def tool_call_key(name: str, arguments: Any) -> tuple[str, str]:
    """A call's canonical identity: its name and its arguments as sorted-key JSON.

    Computed here, independently of the engine's own keying, so that a bug there cannot
    hide itself.
    """
    try:
        canonical = json.dumps(arguments, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        canonical = repr(arguments)
    return (name, canonical)


# --------------------------------------------------------------------------- script values
def _short_repr(value: Any, omit: Collection[str] = ()) -> str:
    """``Class(field=value, …)`` without the fields at their default (nor those in
    ``omit``): a shrunk failing example then reads as what matters."""
    parts = []
    for spec in attrs.fields(type(value)):
        current = getattr(value, spec.name)
        default = spec.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]  # a class at runtime
            default = default.factory()
        if spec.name in omit or (default is not attrs.NOTHING and current == default):
            continue
        parts.append(f"{spec.name}={_value_repr(current)}")
    return f"{type(value).__name__}({', '.join(parts)})"


def _value_repr(value: Any) -> str:
    if isinstance(value, Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, TurnPolicy | LoopPolicy):
        return _short_repr(value)
    return repr(value)


class Ending(StrEnum):
    """How an attempt's last provider pass ends."""

    #: visible text, then the stream ends normally (the attempt answers: ``completed``)
    SUCCESS = "success"
    #: optional text (delivered), then the provider raises a `ProviderError`
    FAIL = "fail"
    #: optional text, then a stall longer than the first-token / inactivity budget
    STALL = "stall"
    #: the pass streams nothing (``empty_response``)
    EMPTY = "empty"


class ErrorKind(StrEnum):
    """The provider failures an attempt may end with."""

    SERVER = "server"
    RATE_LIMIT = "rate_limit"
    CONNECTION = "connection"
    AUTH = "auth"
    BAD_REQUEST = "bad_request"


_STATUS_CODES: dict[ErrorKind, int | None] = {
    ErrorKind.SERVER: 503,
    ErrorKind.RATE_LIMIT: 429,
    ErrorKind.CONNECTION: None,
    ErrorKind.AUTH: 401,
    ErrorKind.BAD_REQUEST: 400,
}
_RETRYABLE = frozenset({ErrorKind.SERVER, ErrorKind.RATE_LIMIT, ErrorKind.CONNECTION})


@frozen(repr=False)
class ToolStep:
    """One provider pass that ends in a call to a shared tool (after optional text)."""

    tool: str
    arguments: Mapping[str, Any] = field(factory=dict)
    text: str = ""

    def __repr__(self) -> str:
        return _short_repr(self)


@frozen(repr=False)
class AttemptScript:
    """What one attempt's provider does: ``tool_steps`` passes that each call a shared tool,
    then one last pass that ends as ``ending``.

    ``text`` is the last pass's visible text (before the failure or the stall for those
    endings); ``pause`` a short wait (within every budget) in the middle of it; ``error`` and
    ``retry_after`` shape a ``FAIL``; ``stall`` is how long a ``STALL`` waits.
    """

    ending: Ending = Ending.SUCCESS
    text: str = "Hello."
    tool_steps: tuple[ToolStep, ...] = ()
    pause: float = 0.0
    error: ErrorKind = ErrorKind.SERVER
    retry_after: float | None = None
    stall: float = 30.0

    def __repr__(self) -> str:
        irrelevant = {"error", "retry_after", "stall"}
        if self.ending is Ending.FAIL:
            irrelevant -= {"error", "retry_after"}
        elif self.ending is Ending.STALL:
            irrelevant.discard("stall")
        if self.ending is Ending.EMPTY:
            irrelevant |= {"text", "pause"}
        return _short_repr(self, irrelevant)

    def provider_error(self, key: str | None, *, echo_key: bool) -> ProviderError:
        """The failure a ``FAIL`` raises; with ``echo_key`` its message quotes the key, as
        careless real providers do."""
        message = f"scripted {self.error.value} failure"
        if echo_key and key:
            message += f" (key {key})"
        return ProviderError(
            message,
            kind=self.error.value,
            retryable=self.error in _RETRYABLE,
            status_code=_STATUS_CODES[self.error],
            retry_after=self.retry_after if self.error is ErrorKind.RATE_LIMIT else None,
        )

    def passes(
        self, key: str | None, *, echo_key: bool, call_prefix: str
    ) -> tuple[tuple[ScriptItem, ...], ...]:
        """The scripted provider passes. Call ids start with ``call_prefix`` so that they
        differ between attempts, as real models' ids do."""
        out: list[tuple[ScriptItem, ...]] = []
        for index, step in enumerate(self.tool_steps):
            items: list[ScriptItem] = [TextDelta(step.text)] if step.text else []
            items.append(FunctionCall(step.tool, dict(step.arguments), f"{call_prefix}{index}"))
            out.append(tuple(items))
        last: list[ScriptItem] = []
        if self.ending is not Ending.EMPTY and self.text:
            half = len(self.text) // 2 or len(self.text)
            last.append(TextDelta(self.text[:half]))
            if self.pause > 0:
                last.append(Pause(self.pause))
            if self.text[half:]:
                last.append(TextDelta(self.text[half:]))
        if self.ending is Ending.FAIL:
            last.append(Fail(self.provider_error(key, echo_key=echo_key)))
        elif self.ending is Ending.STALL:
            last.append(Pause(self.stall))
        out.append(tuple(last))
        return tuple(out)


class KeyState(StrEnum):
    """A key's health in the host's key book before the turn starts."""

    HEALTHY = "healthy"
    COOLING = "cooling"
    RETIRED = "retired"


#: Cooling keys in the initial key book cool until far beyond any run's virtual time.
_COOLING_UNTIL = 1e9


@frozen(repr=False)
class KeyScript:
    """One API key of a model: the key, what an attempt with it does, its health in the key
    book before the turn, and whether the host's provider factory raises for it."""

    key: str
    attempt: AttemptScript = AttemptScript()
    state: KeyState = KeyState.HEALTHY
    factory_raises: bool = False

    def __repr__(self) -> str:
        return _short_repr(self)


@frozen(repr=False)
class ModelScript:
    """One model of the chain: a label, its keys, and (for a model without keys, which the
    chain gives as a provider rather than a factory) what its one attempt does."""

    label: str
    keys: tuple[KeyScript, ...] = ()
    keyless: AttemptScript = AttemptScript()
    tool_calling: str = "native"

    def __repr__(self) -> str:
        return _short_repr(self, ("keyless",) if self.keys else ())

    def attempt_for(self, key_index: int | None) -> AttemptScript:
        return self.keyless if key_index is None else self.keys[key_index].attempt


@frozen(repr=False)
class SharedRouteScript:
    """The shared route: its models, whether the host's admission policy admits, and how
    long (virtual seconds) it deliberates."""

    models: tuple[ModelScript, ...]
    admit: bool = True
    delay: float = 0.0

    def __repr__(self) -> str:
        return _short_repr(self)


@frozen(repr=False)
class ChainSignal:
    """A host signal at virtual instant ``at``: ``stop`` (/kill, with an optional message),
    ``follow_up`` (a new user message) or ``unreachable`` (the destination is gone)."""

    at: float
    kind: str = "stop"
    stop_message: str | None = None

    def __repr__(self) -> str:
        return _short_repr(self)


@frozen(repr=False)
class ChainScript:
    """A whole simulated generation turn, drawn by `generation_chains()`.

    ``broken_delivery``: ``(n, "unreachable" | "refused")`` makes the channel's n-th delivery
    raise `DestinationUnreachable` or `ConnectionError` (a host failure).
    ``supersede_delay``: virtual seconds the host's UI takes to mark a superseded attempt
    (the channel's ``attempt_superseded`` hook): time in which a signal may arrive between
    two attempts. ``echo_keys``: providers and factories quote their key in their errors.
    """

    models: tuple[ModelScript, ...]
    policy: TurnPolicy
    shared: SharedRouteScript | None = None
    signals: tuple[ChainSignal, ...] = ()
    broken_delivery: tuple[int, str] | None = None
    supersede_delay: float = 0.0
    echo_keys: bool = False

    def __repr__(self) -> str:
        return _short_repr(self)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the chain and the shared route (the strings that must never leak)."""
        models = (*self.models, *(self.shared.models if self.shared is not None else ()))
        return tuple(k.key for model in models for k in model.keys)

    def request(self) -> TurnRequest:
        return TurnRequest([{"role": "user", "content": "What is the weather in Oslo?"}])


def chain_budget(script: ChainScript, policy: TurnPolicy | None = None) -> int:
    """The most attempts the chain may make under ``policy`` (default: the script's): per
    model ``max(1, min(keys, max key attempts per model))``, the shared route's included."""
    per_model = (policy if policy is not None else script.policy).max_key_attempts_per_model
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    return sum(max(1, min(len(model.keys), per_model)) for model in models)


# --------------------------------------------------------------------------- strategies
# Menus are ordered simplest first: Hypothesis shrinks `sampled_from` toward the first entry.
_TEXTS: tuple[str, ...] = (
    "Hello.",
    "It is sunny ",
    "ü 日本 ",
    "The answer is 42. ",
    "Oslo: 3 °C. ",
)
_PAUSES: tuple[float, ...] = (0.0, 0.0, 0.5, 1.0)
_STALLS: tuple[float, ...] = (30.0, 8.0)
_RETRY_AFTER: tuple[float | None, ...] = (None, 7.0, 0.5)
_INSTANTS: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.5, 6.0, 9.0, 15.0, 40.0)
#: Failures and stalls (what moves a chain along) are two thirds of the endings; an empty
#: response (final, and ending the chain at once) one in twelve.
_ENDINGS: tuple[Ending, ...] = (
    *(Ending.SUCCESS, Ending.FAIL, Ending.FAIL, Ending.STALL),
    *(Ending.SUCCESS, Ending.FAIL, Ending.FAIL, Ending.STALL),
    *(Ending.SUCCESS, Ending.FAIL, Ending.FAIL, Ending.EMPTY),
)
_ERROR_KINDS: tuple[ErrorKind, ...] = tuple(ErrorKind)
#: (state in the key book, the factory raises): mostly healthy keys that build a provider
_KEY_HOST = st.sampled_from(
    ((KeyState.HEALTHY, False),) * 20
    + ((KeyState.COOLING, False), (KeyState.RETIRED, False), (KeyState.HEALTHY, True))
)


def _ending_menus() -> dict[Ending, tuple[AttemptScript, ...]]:
    """Every last pass worth drawing, per ending, simplest first. One draw picks the ending,
    one draw its details: Hypothesis spends ~60 µs a draw, and a chain holds up to 16
    attempt scripts."""
    texts = (*_TEXTS, "", " ")  # "": fails or stalls before the first token; " ": blank
    fails = [
        AttemptScript(Ending.FAIL, text, error=kind, retry_after=after)
        for kind in _ERROR_KINDS
        for after in (_RETRY_AFTER if kind is ErrorKind.RATE_LIMIT else (None,))
        for text in texts
    ]
    return {
        # an answer is visible text (blank once: whitespace only is an empty response)
        Ending.SUCCESS: tuple(
            AttemptScript(Ending.SUCCESS, text, pause=pause)
            for pause in _PAUSES
            for text in (*_TEXTS, *_TEXTS, " ")
        ),
        Ending.FAIL: tuple(fails),
        Ending.STALL: tuple(
            AttemptScript(Ending.STALL, text, stall=stall) for stall in _STALLS for text in texts
        ),
        Ending.EMPTY: (AttemptScript(Ending.EMPTY, ""),),
    }


_ENDING_MENUS = _ending_menus()
_LAST_PASSES = {ending: st.sampled_from(menu) for ending, menu in _ENDING_MENUS.items()}
_TOOL_STEPS: tuple[ToolStep, ...] = tuple(
    ToolStep(tool, arguments, text)
    for text in ("", "Let me check. ")
    for arguments in _ARGUMENTS
    for tool in SHARED_TOOLS
)


def attempt_scripts(*, max_tool_steps: int = 2) -> st.SearchStrategy[AttemptScript]:
    """What one attempt does: up to ``max_tool_steps`` passes calling shared tools (the same
    few calls in every attempt, so completed calls come back), then a last pass that
    answers, fails with every `ErrorKind` (rate limits with and without ``retry_after``)
    after optional partial text, stalls past the budgets, or is empty."""
    steps = st.lists(st.sampled_from(_TOOL_STEPS), max_size=max_tool_steps).map(tuple)

    @st.composite
    def scripts(draw: st.DrawFn) -> AttemptScript:
        last = draw(_LAST_PASSES[draw(st.sampled_from(_ENDINGS))])
        tool_steps = draw(steps)
        return attrs.evolve(last, tool_steps=tool_steps) if tool_steps else last

    return scripts()


def chain_signals() -> st.SearchStrategy[ChainSignal]:
    """A stop (with or without a message), a follow-up, or an unreachable report at a
    virtual instant from a small menu (so that signals coincide with other events)."""
    return st.builds(
        ChainSignal,
        at=st.sampled_from(_INSTANTS),
        kind=st.sampled_from(("stop", "follow_up", "stop", "unreachable")),
        stop_message=st.sampled_from((None, "sorry, stopping")),
    )


def turn_policies() -> st.SearchStrategy[TurnPolicy]:
    """`TurnPolicy` values with short budgets (stalls of the scripts always exceed them,
    their pauses never do), 1–3 key attempts per model, the shared route allowed or not,
    and deliveries flushed every 1–16 characters (so partial text is really delivered)."""
    loops = st.builds(
        LoopPolicy,
        max_function_call_iterations=st.sampled_from((6, 3, 2)),
        inactivity_timeout=st.sampled_from((2.0, 3.0)),
        first_token_timeout=st.sampled_from((3.0, 2.0, 4.0)),
        abandoned_stream_settle=st.sampled_from((1.0, 0.0)),
        tool_timeout=st.just(_TOOL_TIMEOUT),
        delivery_flush_chars=st.sampled_from((1, 4, 16)),
    )
    return st.builds(
        TurnPolicy,
        loop=loops,
        max_key_attempts_per_model=st.integers(1, 3),
        allow_shared_route=st.booleans(),
    )


def _fake_key(salt: int, route: str, model: int, key: int) -> str:
    digest = hashlib.sha256(f"{salt}:{route}:{model}:{key}".encode()).hexdigest()
    return f"sk-test-{digest[:24]}"


def _models(
    draw: st.DrawFn,
    route: str,
    count: int,
    salt: int,
    attempts: st.SearchStrategy[AttemptScript],
    keys: st.SearchStrategy[int],
) -> tuple[ModelScript, ...]:
    models = []
    for index in range(count):
        n_keys = draw(keys)
        scripts = tuple(
            KeyScript(_fake_key(salt, route, index, k), draw(attempts), *draw(_KEY_HOST))
            for k in range(n_keys)
        )
        keyless = draw(attempts) if n_keys == 0 else AttemptScript()
        label = f"{'s' if route == 'shared' else 'm'}{index}"
        models.append(ModelScript(label, scripts, keyless, draw(_TOOL_CALLING)))
    return tuple(models)


# Strategies are built once: building one per draw costs more than the draw itself.
_SALTS = st.integers(0, 2**32 - 1)
_SHARED_MODELS = st.integers(1, 2)
_ONE_IN_THREE = st.integers(0, 2)
_ONE_IN_TEN = st.integers(0, 9)
_BROKEN_INDEX = st.integers(0, 3)
_BROKEN_KIND = st.sampled_from(("unreachable", "refused"))
_ADMISSION_DELAYS = st.sampled_from((0.0, 0.0, 1.0))
_SUPERSEDE_DELAYS = st.sampled_from((0.0, 0.0, 0.0, 1.0))
_BOOLEANS = st.booleans()
#: One model in four writes its tool calls in text (gets the verbatim scaffolding).
_TOOL_CALLING = st.sampled_from(("native", "native", "native", "verbatim"))


def generation_chains(
    *,
    max_models: int = 4,
    max_keys: int = 3,
    max_signals: int = 2,
    shared_route: bool = True,
    echo_keys: bool | None = None,
) -> st.SearchStrategy[ChainScript]:
    """A whole simulated generation turn (see `ChainScript`): 1–``max_models`` models with
    0–``max_keys`` keys each, a scripted attempt per keyless model and per key, an optional
    shared route (one chain in three, when ``shared_route``) admitted or refused, up to
    ``max_signals`` host signals, a small `TurnPolicy`, cooling / retired keys in the key
    book, factories that raise, a channel whose delivery fails (one chain in ten), and
    the host's supersede-marking delay. ``echo_keys`` fixes whether providers and factories
    quote their key in their errors (``None``: drawn)."""
    attempts = attempt_scripts()
    model_counts = st.integers(1, max_models)
    key_counts = st.integers(0, max_keys)
    signals = st.lists(chain_signals(), max_size=max_signals).map(tuple)
    policies = turn_policies()
    echo = _BOOLEANS if echo_keys is None else st.just(echo_keys)

    @st.composite
    def chains(draw: st.DrawFn) -> ChainScript:
        salt = draw(_SALTS)
        models = _models(draw, "user", draw(model_counts), salt, attempts, key_counts)
        shared = None
        if shared_route and draw(_ONE_IN_THREE) == 2:
            shared = SharedRouteScript(
                models=_models(draw, "shared", draw(_SHARED_MODELS), salt, attempts, key_counts),
                admit=draw(_BOOLEANS),
                delay=draw(_ADMISSION_DELAYS),
            )
        broken: tuple[int, str] | None = None
        if draw(_ONE_IN_TEN) == 9:
            broken = (draw(_BROKEN_INDEX), draw(_BROKEN_KIND))
        return ChainScript(
            models=models,
            policy=draw(policies),
            shared=shared,
            signals=draw(signals),
            broken_delivery=broken,
            supersede_delay=draw(_SUPERSEDE_DELAYS),
            echo_keys=draw(echo),
        )

    return chains()


# --------------------------------------------------------------------------- running a chain
@frozen
class TimelineEntry:
    """Something the host saw, at a virtual instant, in the order it happened.

    ``kind``: ``signal`` (detail: stop / follow_up / unreachable), ``notice`` (the notice's
    key), ``superseded`` (the attempt's label), ``attempt`` (the model's label and key index
    when an attempt's provider was asked for the first time).
    """

    at: float
    kind: str
    detail: str
    #: the stop message a ``stop`` signal carried
    message: str | None = None


@define
class ChainToolExecution:
    """One time a shared tool's handler started: its canonical key, when, in which attempt."""

    name: str
    arguments: Mapping[str, Any]
    key: tuple[str, str]
    at: float
    attempt: int
    #: the provider pass of the attempt whose call this is (``ToolContext.iteration``)
    iteration: int = 0
    #: the handler returned (it was not cancelled by a stop or the destination going away)
    finished: bool = False


@frozen
class KeyUse:
    """The host's factory was called for key ``key_index`` of model ``model`` (the chain's
    index, shared-route models after the user's own)."""

    model: int
    label: str
    key_index: int
    at: float


@frozen
class FirstRequest:
    """The first provider request of one attempt, and what the channel held at that time."""

    label: str
    key_index: int | None
    prefill: str | None
    delivered_before: str
    #: the request carried the verbatim tool-calling scaffolding
    scaffolded: bool = False


class ChainChannel(RecordingChannel):
    """A `RecordingChannel` that also marks superseded attempts (the optional host hook
    ``attempt_superseded``, which takes ``supersede_delay`` virtual seconds) and logs
    notices and marks on a shared timeline."""

    def __init__(
        self,
        *,
        clock: VirtualClock,
        timeline: list[TimelineEntry],
        supersede_delay: float = 0.0,
        broken_delivery: tuple[int, str] | None = None,
    ) -> None:
        super().__init__(clock=clock)
        self.timeline = timeline
        self.supersede_delay = supersede_delay
        self.broken_delivery = broken_delivery
        self.superseded: list[tuple[int, str, str]] = []
        self._attempted_deliveries = 0
        #: a delivery raised `DestinationUnreachable`
        self.unreachable_raised = False
        self._clock = clock

    def _maybe_break(self) -> None:
        index = self._attempted_deliveries
        self._attempted_deliveries += 1
        broken = self.broken_delivery
        if broken is not None and broken[0] == index:
            if broken[1] == "unreachable":
                self.unreachable_raised = True
                raise DestinationUnreachable("the conversation was deleted")
            raise ConnectionError("the channel refused the message")

    async def send_text(self, text: str) -> None:
        self._maybe_break()
        await super().send_text(text)

    async def send_expression(self, expression: str) -> None:
        self._maybe_break()
        await super().send_expression(expression)

    async def send_notice(self, notice: Notice) -> None:
        self.timeline.append(TimelineEntry(self._clock.now(), "notice", notice.key))
        await super().send_notice(notice)

    async def attempt_superseded(self, attempt: int, label: str, delivered_text: str) -> None:
        self.superseded.append((attempt, label, delivered_text))
        self.timeline.append(TimelineEntry(self._clock.now(), "superseded", label))
        if self.supersede_delay > 0:
            await self._clock.sleep(self.supersede_delay)


class _ChainProvider(ScriptedProvider):
    """A scripted provider that notes, at its first request, the prefill it was given and
    what the channel had recorded by then (the continuation witness)."""

    def __init__(
        self,
        passes: Sequence[Sequence[ScriptItem]],
        *,
        clock: VirtualClock,
        label: str,
        key_index: int | None,
        channel: ChainChannel,
        firsts: list[FirstRequest],
        timeline: list[TimelineEntry],
    ) -> None:
        super().__init__(passes, clock=clock, name=label)
        self.label = label
        self.key_index = key_index
        self._channel = channel
        self._firsts = firsts
        self._timeline = timeline
        self._clock = clock

    def stream(self, request: ProviderRequest) -> Any:
        if not self.requests:
            self._firsts.append(
                FirstRequest(
                    self.label,
                    self.key_index,
                    request.prefill,
                    self._channel.delivered_text,
                    any(is_verbatim_scaffolding(m) for m in request.context),
                )
            )
            self._timeline.append(
                TimelineEntry(self._clock.now(), "attempt", f"{self.label}#{self.key_index}")
            )
        return super().stream(request)


@define(repr=False)
class ChainRun:
    """One finished simulated generation turn and every witness the checker uses."""

    script: ChainScript
    #: the policy the turn ran under (the script's, unless `run_chain` was given another)
    policy: TurnPolicy
    #: the turn's result (``None`` when `run_generation_turn` raised: see ``raised``)
    result: GenerationTurnResult | None
    raised: BaseException | None
    channel: ChainChannel
    executions: tuple[ChainToolExecution, ...]
    key_uses: tuple[KeyUse, ...]
    first_requests: tuple[FirstRequest, ...]
    timeline: tuple[TimelineEntry, ...]
    admission_requests: tuple[AdmissionRequest, ...]
    key_book_before: dict[tuple[str, int], KeyHealth]
    key_book: dict[tuple[str, int], KeyHealth]
    outer_steps: tuple[TraceStep, ...]
    log_text: str
    elapsed: float

    def check(self, *, skip: Collection[str] = ()) -> None:
        """Run `check_chain_invariants`; raises `ChainInvariantViolation`."""
        check_chain_invariants(self, skip=skip)

    def __repr__(self) -> str:
        # short on purpose: asyncio reprs a finished task's result, and the script is long
        status = self.result.status.value if self.result is not None else f"raised {self.raised!r}"
        return f"ChainRun({status}, {len(self.script.models)} models, {self.elapsed:g} s)"


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _initial_key_book(script: ChainScript) -> dict[tuple[str, int], KeyHealth]:
    book: dict[tuple[str, int], KeyHealth] = {}
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    for model in models:
        for index, key in enumerate(model.keys):
            if key.state is KeyState.COOLING:
                book[(model.label, index)] = KeyHealth(cooldown_until=_COOLING_UNTIL)
            elif key.state is KeyState.RETIRED:
                book[(model.label, index)] = KeyHealth(retired=True)
    return book


async def run_chain(
    script: ChainScript,
    *,
    policy: TurnPolicy | None = None,
    on_step: Callable[[TraceStep], None] | None = None,
    real_timeout: float | None = 30.0,
) -> ChainRun:
    """Run ``script`` through `run_generation_turn` on a fresh `VirtualClock`.

    ``policy`` replaces the script's own policy (to fuzz a policy under test: the checks
    then use it); ``on_step`` sees every step of the outer machine as it happens.

    Builds a provider factory per keyed model (key → that key's scripted provider; the
    factory raises where the script says so), a scripted provider for each keyless model,
    the shared tools (recording every execution with its canonical key), a `ChainChannel`,
    `TurnSignals` fired by timers on the clock, the shared route and the key book; captures
    the library's log records. ``real_timeout`` (real seconds) turns a deadlocked run into
    an error instead of a hung test.
    """
    clock = VirtualClock()
    signals = TurnSignals()
    timeline: list[TimelineEntry] = []
    channel = ChainChannel(
        clock=clock,
        timeline=timeline,
        supersede_delay=script.supersede_delay,
        broken_delivery=script.broken_delivery,
    )
    executions: list[ChainToolExecution] = []
    key_uses: list[KeyUse] = []
    firsts: list[FirstRequest] = []
    current_attempt = [0]

    def provider_for(model: ModelScript, key_index: int | None) -> Provider:
        key = model.keys[key_index].key if key_index is not None else None
        attempt = model.attempt_for(key_index)
        return _ChainProvider(
            attempt.passes(
                key, echo_key=script.echo_keys, call_prefix=f"call_{model.label}_{key_index}_"
            ),
            clock=clock,
            label=model.label,
            key_index=key_index,
            channel=channel,
            firsts=firsts,
            timeline=timeline,
        )

    def factory_for(model_index: int, model: ModelScript) -> Callable[[str | None], Provider]:
        def factory(key: str | None) -> Provider:
            index = next(i for i, k in enumerate(model.keys) if k.key == key)
            key_uses.append(KeyUse(model_index, model.label, index, clock.now()))
            if model.keys[index].factory_raises:
                detail = f" with {key}" if script.echo_keys else ""
                raise RuntimeError(f"cannot build a client{detail}")
            return provider_for(model, index)

        return factory

    def attempt_of(model_index: int, model: ModelScript) -> Attempt:
        if model.keys:
            return Attempt(
                factory_for(model_index, model),
                keys=tuple(k.key for k in model.keys),
                label=model.label,
                tool_calling=model.tool_calling,
            )
        return Attempt(
            provider_for(model, None),
            label=model.label,
            tool_calling=model.tool_calling,
        )

    attempts = [attempt_of(i, m) for i, m in enumerate(script.models)]
    admission_requests: list[AdmissionRequest] = []
    shared_route = None
    if script.shared is not None:
        shared_script = script.shared
        offset = len(script.models)

        async def admit(request: AdmissionRequest) -> bool:
            admission_requests.append(request)
            if shared_script.delay > 0:
                await clock.sleep(shared_script.delay)
            return shared_script.admit

        shared_attempts = tuple(
            attempt_of(offset + i, m) for i, m in enumerate(shared_script.models)
        )
        shared_route = SharedRoute(shared_attempts, admit)

    tools = ToolRegistry(_tool(name, executions, clock, current_attempt) for name in SHARED_TOOLS)
    key_book = _initial_key_book(script)
    key_book_before = dict(key_book)
    outer_steps: list[TraceStep] = []
    turn_policy = policy if policy is not None else script.policy

    def step_taken(step: TraceStep) -> None:
        outer_steps.append(step)
        if on_step is not None:
            on_step(step)

    def on_attempt_step(attempt: int, _step: TraceStep) -> None:
        current_attempt[0] = attempt

    def fire(signal: ChainSignal) -> None:
        timeline.append(TimelineEntry(clock.now(), "signal", signal.kind, signal.stop_message))
        if signal.kind == "stop":
            signals.request_stop(signal.stop_message)
        elif signal.kind == "follow_up":
            signals.follow_up()
        else:
            signals.report_unreachable()

    def firing(signal: ChainSignal) -> Callable[[], None]:
        return lambda: fire(signal)

    timers = [clock.call_later(signal.at, firing(signal)) for signal in script.signals]
    capture = _LogCapture()
    library_logger = logging.getLogger("toolloop_fsm")
    previous_level = library_logger.level
    library_logger.addHandler(capture)
    library_logger.setLevel(logging.DEBUG)
    result: GenerationTurnResult | None = None
    raised: BaseException | None = None
    started = clock.now()
    try:
        turn = run_generation_turn(
            attempts,
            tools,
            channel,
            script.request(),
            policy=turn_policy,
            signals=signals,
            clock=clock,
            shared_route=shared_route,
            key_book=key_book,
            on_step=step_taken,
            on_attempt_step=on_attempt_step,
        )
        try:
            async with real_time_limit(real_timeout):
                result = await turn
        except TimeoutError:
            raised = TimeoutError(
                f"the generation turn did not finish within {real_timeout:g} real seconds "
                f"(virtual time {clock.now():g}): a wait without a deadline?"
            )
        except Exception as err:  # kept as a witness: a turn must return, not raise
            raised = err
    finally:
        library_logger.removeHandler(capture)
        library_logger.setLevel(previous_level)
        for timer in timers:
            timer.cancel()
    return ChainRun(
        script=script,
        policy=turn_policy,
        result=result,
        raised=raised,
        channel=channel,
        executions=tuple(executions),
        key_uses=tuple(key_uses),
        first_requests=tuple(firsts),
        timeline=tuple(timeline),
        admission_requests=tuple(admission_requests),
        key_book_before=key_book_before,
        key_book=key_book,
        outer_steps=tuple(outer_steps),
        log_text="\n".join(capture.lines),
        elapsed=clock.now() - started,
    )


def _tool(
    name: str,
    executions: list[ChainToolExecution],
    clock: VirtualClock,
    current_attempt: list[int],
) -> Tool:
    calls = 0

    async def handler(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        nonlocal calls
        delay = _TOOL_DELAYS[calls % len(_TOOL_DELAYS)]
        calls += 1
        execution = ChainToolExecution(
            name,
            dict(arguments),
            tool_call_key(name, arguments),
            clock.now(),
            current_attempt[0],
            ctx.iteration,
        )
        executions.append(execution)
        if delay > 0:
            await ctx.clock.sleep(delay)
        execution.finished = True
        expression = "sticker:wave" if name == "send_sticker" else None
        return ToolResult(
            data={"tool": name, "args": arguments}, message=f"{name} done", expression=expression
        )

    return Tool(name, f"the shared {name} tool", {"type": "object"}, handler, timeout=_TOOL_TIMEOUT)


# --------------------------------------------------------------------------- the checker
#: The names `check_chain_invariants` reports (and accepts in ``skip``), in check order.
CHAIN_INVARIANTS: tuple[str, ...] = (
    "terminal",
    "key_secrecy",
    "attempt_budget",
    "tool_once",
    "delivered",
    "retry_only_after_failure",
    "no_fallback_notice_while_pending",
    "failures_listed",
    "continuation",
    "unreachable_skips",
    "stop_message_queued",
)


class ChainInvariantViolation(AssertionError):
    """A generation turn broke a chain invariant; ``invariant`` is its name (one of
    `CHAIN_INVARIANTS`) and the message says what was seen."""

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"chain invariant {invariant!r}: {message}")


def _fail(invariant: str, message: str) -> None:
    raise ChainInvariantViolation(invariant, message)


def _masked(key: str) -> str:
    return key[:11] + "…"


def check_chain_invariants(run: ChainRun, *, skip: Collection[str] = ()) -> None:
    """Check one finished chain run; raises `ChainInvariantViolation` for the first broken
    invariant (see `CHAIN_INVARIANTS`; names in ``skip`` are not checked).

    * ``terminal``: the turn returned a result; the outer trace starts in ``ready``, is
      contiguous, reaches exactly one final state (`FINAL_STATES`), last, and the status
      is that state.
    * ``key_secrecy``: no key in the JSON result, ``repr(result)``, the notices, the outer
      and inner traces, the error message, the attached exception, anything raised, the
      admission requests, the superseded marks or the library's log records.
    * ``attempt_budget``: attempts ≤ `chain_budget`; per model at most
      ``min(keys, max_key_attempts_per_model)`` keys are used, each at most once, never one
      that was cooling or retired in the key book.
    * ``tool_once``: no tool call (canonical key) executes twice in the turn.
    * ``delivered``: what the channel recorded is exactly ``result.delivered``, in order
      (texts and expressions), and at most one expression was delivered.
    * ``retry_only_after_failure``: only ``error`` / ``timeout`` attempts are followed by
      another; a final status is the turn's status.
    * ``no_fallback_notice_while_pending``: no ``fallback_used`` notice after a stop or a
      follow-up arrived, at most one per turn, and one exactly when a completed turn
      followed failures with no signal pending.
    * ``failures_listed``: ``attempt_failures`` lists every superseded attempt and, when the
      chain was exhausted, every failed attempt.
    * ``continuation``: each attempt's first request carries what the channel had been
      delivered so far as its prefill, and the verbatim scaffolding exactly when its model
      writes tool calls in text.
    * ``unreachable_skips``: an unreachable report or delivery ends the turn ``skipped``,
      and no attempt asks its provider after the report.
    * ``stop_message_queued``: a turn stopped by a stop that carried a message queues that
      message at the front of the channel, once, and keeps it in ``stop_message``.
    """
    unknown = set(skip) - set(CHAIN_INVARIANTS)
    if unknown:
        raise ValueError(f"unknown chain invariants in skip: {sorted(unknown)}")
    if "key_secrecy" not in skip:
        _check_key_secrecy(run)
    result = run.result
    if result is None:
        if "terminal" not in skip:
            _fail("terminal", f"the turn raised instead of returning a result: {run.raised!r}")
        return
    for name, check in _CHECKS:
        if name not in skip:
            check(run, result)


def _records(result: GenerationTurnResult) -> tuple[AttemptRecord, ...]:
    return result.attempts


def _check_terminal(run: ChainRun, result: GenerationTurnResult) -> None:
    if not isinstance(result.status, TurnStatus):
        _fail("terminal", f"status {result.status!r} is not a TurnStatus")
    trace = result.trace
    if not trace or trace[0].state != "ready":
        _fail("terminal", f"the outer trace does not start in 'ready': {trace[:1]}")
    for index in range(1, len(trace)):
        if trace[index].state != trace[index - 1].next_state:
            _fail(
                "terminal",
                f"the outer trace jumps at step {index}: {trace[index - 1]} then {trace[index]}",
            )
    finals = [i for i, step in enumerate(trace) if step.next_state in FINAL_STATES]
    if finals != [len(trace) - 1]:
        _fail(
            "terminal",
            f"expected exactly one final step, the last of {len(trace)}; final steps at {finals}",
        )
    if trace[-1].next_state != result.status.value:
        _fail(
            "terminal",
            f"the outer trace ends in {trace[-1].next_state!r} but the status "
            f"is {result.status.value!r}",
        )
    machine_steps = tuple(s for s in trace if s.event != "attempt_superseded")
    if machine_steps != run.outer_steps:
        _fail("terminal", "the result's trace differs from the steps reported to on_step")


def _check_key_secrecy(run: ChainRun) -> None:
    result = run.result
    places: dict[str, str] = {
        "the notices": repr(run.channel.notices),
        "the superseded marks": repr(run.channel.superseded),
        "the admission requests": repr(run.admission_requests),
        "the log records": run.log_text,
    }
    if run.raised is not None:
        places["the raised exception"] = f"{run.raised!r} {run.raised}"
    if result is not None:
        places["result_to_json(result)"] = result_to_json(result)
        places["repr(result)"] = repr(result)
        places["the trace"] = repr(result.trace) + repr([a.trace for a in result.attempts])
        places["the error message"] = result.error_message or ""
        if result.exception is not None:
            places["the result's exception"] = f"{result.exception!r} {result.exception}"
    for key in run.script.keys:
        found = [where for where, text in places.items() if key in text]
        if found:
            _fail("key_secrecy", f"key {_masked(key)} appears in {', '.join(found)}")


def _check_attempt_budget(run: ChainRun, result: GenerationTurnResult) -> None:
    script = run.script
    budget = chain_budget(script, run.policy)
    started = sum(1 for step in result.trace if step.next_state == "attempting")
    if started > budget:
        _fail("attempt_budget", f"{started} attempts for a chain budget of {budget}")
    if len(result.attempts) > started:
        _fail(
            "attempt_budget",
            f"{len(result.attempts)} attempt records but only {started} attempts started",
        )
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    per_model = run.policy.max_key_attempts_per_model
    for index, model in enumerate(models):
        used = [use.key_index for use in run.key_uses if use.model == index]
        limit = min(len(model.keys), per_model)
        if len(used) > limit:
            _fail(
                "attempt_budget",
                f"model {model.label} used {len(used)} keys {used}, above "
                f"min(keys={len(model.keys)}, max_key_attempts={per_model})",
            )
        if len(set(used)) != len(used):
            _fail("attempt_budget", f"model {model.label} used a key twice: {used}")
        for key_index in used:
            health = run.key_book_before.get((model.label, key_index))
            if health is not None and not health.usable_at(0.0):
                _fail(
                    "attempt_budget",
                    f"model {model.label} used key #{key_index}, which was "
                    f"{'retired' if health.retired else 'cooling'}",
                )


def _check_tool_once(run: ChainRun, result: GenerationTurnResult) -> None:
    """No call runs twice because the turn replayed it: the n-th identical call of an
    attempt reuses the n-th one an earlier attempt completed; a deliberate repeat inside one
    attempt (an occurrence no earlier attempt reached) runs."""
    models = {m.label: m for m in run.script.models}
    if run.script.shared is not None:
        models.update({m.label: m for m in run.script.shared.models})
    recorded: dict[tuple[str, str], int] = {}  # occurrences completed by earlier attempts
    for record in result.attempts:
        model = models.get(record.label)
        if model is None:
            continue
        steps = [tool_call_key(s.tool, s.arguments) for s in model.attempt_for(
            record.key_index).tool_steps]  # fmt: skip
        reached = 0
        for execution in (e for e in run.executions if e.attempt == record.index):
            occurrence = steps[: execution.iteration].count(execution.key)
            if occurrence <= recorded.get(execution.key, 0):
                _fail(
                    "tool_once",
                    f"{execution.name}({execution.key[1]}) ran again at t={execution.at:g} "
                    f"in attempt {execution.attempt} (pass {execution.iteration}); occurrence "
                    f"{occurrence} of it was already completed by an earlier attempt",
                )
            if execution.finished:
                reached = max(reached, execution.iteration)
        for key in set(steps[:reached]):
            recorded[key] = max(recorded.get(key, 0), steps[:reached].count(key))


def _check_delivered(run: ChainRun, result: GenerationTurnResult) -> None:
    seen = [(d.text, d.expression) for d in run.channel.delivered]
    kept = [(d.text, d.expression) for d in result.delivered]
    if seen != kept:
        _fail(
            "delivered",
            f"the channel recorded {seen!r} but the result keeps {kept!r} "
            f"(status {result.status.value}, reason {result.reason})",
        )
    if result.delivered_text != run.channel.delivered_text:
        _fail(
            "delivered",
            f"delivered_text {result.delivered_text!r} != the channel's "
            f"{run.channel.delivered_text!r}",
        )
    expressions = run.channel.expressions
    if len(expressions) > 1:
        _fail("delivered", f"{len(expressions)} expressions delivered in one turn: {expressions}")


_RETRYABLE_STATUSES = (TurnStatus.ERROR, TurnStatus.TIMEOUT)


def _check_retries(run: ChainRun, result: GenerationTurnResult) -> None:
    records = _records(result)
    for record, following in itertools.pairwise(records):
        if record.status not in _RETRYABLE_STATUSES:
            _fail(
                "retry_only_after_failure",
                f"attempt {record.index} ({record.label}) ended {record.status.value} and "
                f"attempt {following.index} ({following.label}) followed it",
            )
    for record in records:
        if record.superseded and record.status not in _RETRYABLE_STATUSES:
            _fail(
                "retry_only_after_failure",
                f"attempt {record.index} ended {record.status.value} but was superseded",
            )
    if records and records[-1].status not in _RETRYABLE_STATUSES:
        last = records[-1]
        if result.status is not last.status and result.status is not TurnStatus.SKIPPED:
            _fail(
                "retry_only_after_failure",
                f"the last attempt ended {last.status.value} (final) but the turn ended "
                f"{result.status.value}",
            )


def _check_fallback_notice(run: ChainRun, result: GenerationTurnResult) -> None:
    posted = [
        i for i, e in enumerate(run.timeline) if e.kind == "notice" and e.detail == "fallback_used"
    ]
    if len(posted) > 1:
        _fail("no_fallback_notice_while_pending", f"{len(posted)} fallback_used notices")
    signalled = [
        i
        for i, e in enumerate(run.timeline)
        if e.kind == "signal" and e.detail in ("stop", "follow_up")
    ]
    if posted and signalled and signalled[0] < posted[0]:
        entry = run.timeline[signalled[0]]
        _fail(
            "no_fallback_notice_while_pending",
            f"a fallback_used notice was posted after a {entry.detail} arrived at t={entry.at:g}",
        )
    if (
        result.status is TurnStatus.COMPLETED
        and result.attempt_failures
        and not signalled
        and not posted
    ):
        _fail(
            "no_fallback_notice_while_pending",
            f"a completed turn followed {len(result.attempt_failures)} failures with no "
            "signal pending, but no fallback_used notice was posted",
        )


def _check_failures_listed(run: ChainRun, result: GenerationTurnResult) -> None:
    records = _records(result)

    def facts(label: str, status: TurnStatus, reason: str | None, key: int | None) -> str:
        return f"{label}#{key}:{status.value}({reason})"

    expected = [r for r in records if r.superseded]
    exhausted = (
        bool(records)
        and result.status in _RETRYABLE_STATUSES
        and records[-1].status is result.status
        and records[-1].reason != "host_error"
    )
    if exhausted and not records[-1].superseded:
        expected.append(records[-1])
    want = [facts(r.label, r.status, r.reason, r.key_index) for r in expected]
    got = [facts(f.label, f.status, f.reason, f.key_index) for f in result.attempt_failures]
    if got != want:
        _fail(
            "failures_listed",
            f"attempt_failures lists {got} but the failed attempts were "
            f"{want} (status {result.status.value}, reason "
            f"{result.reason}, exhausted={exhausted})",
        )


def _check_continuation(run: ChainRun, _result: GenerationTurnResult) -> None:
    script = run.script
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    verbatim = {m.label for m in models if m.tool_calling == "verbatim"}
    for first in run.first_requests:
        if first.scaffolded != (first.label in verbatim):
            _fail(
                "continuation",
                f"attempt {first.label}#{first.key_index} "
                f"({'verbatim' if first.label in verbatim else 'native'}) was sent "
                f"{'the' if first.scaffolded else 'no'} verbatim scaffolding",
            )
        want = first.delivered_before or None
        if first.prefill != want:
            _fail(
                "continuation",
                f"attempt {first.label}#{first.key_index} started with prefill "
                f"{first.prefill!r}, but the channel had been delivered "
                f"{first.delivered_before!r}",
            )


def _check_unreachable(run: ChainRun, result: GenerationTurnResult) -> None:
    reported = [e for e in run.timeline if e.kind == "signal" and e.detail == "unreachable"]
    if reported and result.status is not TurnStatus.SKIPPED:
        _fail(
            "unreachable_skips",
            f"the host reported the destination unreachable at t={reported[0].at:g}, but "
            f"the turn ended {result.status.value} ({result.reason})",
        )
    if reported:
        first = run.timeline.index(reported[0])
        later = [e for e in run.timeline[first:] if e.kind == "attempt"]
        if later:
            _fail(
                "unreachable_skips",
                f"the host reported the destination unreachable at t={reported[0].at:g}, but "
                f"attempt {later[0].detail} asked its provider afterwards (t={later[0].at:g})",
            )
    if run.channel.unreachable_raised and result.status is not TurnStatus.SKIPPED:
        _fail(
            "unreachable_skips",
            f"a delivery raised DestinationUnreachable but the turn "
            f"ended {result.status.value} ({result.reason})",
        )


def _check_stop_message(run: ChainRun, result: GenerationTurnResult) -> None:
    queued = run.channel.queued_front
    if len(queued) > 1:
        _fail("stop_message_queued", f"{len(queued)} stop messages queued: {queued}")
    if result.status is not TurnStatus.STOPPED_BY_USER:
        return
    # the first stop is the one the turn takes (later ones find it stopping already)
    stops = [e for e in run.timeline if e.kind == "signal" and e.detail == "stop"]
    message = stops[0].message if stops else None
    if message is None:
        return
    if queued != [message] or result.stop_message != message:
        _fail(
            "stop_message_queued",
            f"the turn was stopped ({result.reason}) by a stop carrying a message, but the "
            f"channel's queue front got {queued} and the result keeps {result.stop_message!r}",
        )


_CHECKS: tuple[tuple[str, Callable[[ChainRun, GenerationTurnResult], None]], ...] = (
    ("terminal", _check_terminal),
    ("attempt_budget", _check_attempt_budget),
    ("tool_once", _check_tool_once),
    ("delivered", _check_delivered),
    ("retry_only_after_failure", _check_retries),
    ("no_fallback_notice_while_pending", _check_fallback_notice),
    ("failures_listed", _check_failures_listed),
    ("continuation", _check_continuation),
    ("unreachable_skips", _check_unreachable),
    ("stop_message_queued", _check_stop_message),
)
