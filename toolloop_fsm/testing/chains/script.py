"""What one fuzzed fallback chain does: the shared tool universe and the script values
(`ChainScript`, its models, keys, attempts, signals and shared route)."""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Mapping
from enum import Enum
from enum import StrEnum
from typing import Any

import attrs
from attrs import field
from attrs import frozen

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.testing.reviewer import ReviewerAct
from toolloop_fsm.testing.scripted import Fail
from toolloop_fsm.testing.scripted import Pause
from toolloop_fsm.testing.scripted import ScriptItem

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
            head, rest = self.text[:half], self.text[half:]
            if echo_key and key:  # the model echoes its key, split over the two chunks
                head, rest = f"{head} {key[:5]}", f"{key[5:]} {rest}"
            last.append(TextDelta(head))
            if self.pause > 0:
                last.append(Pause(self.pause))
            if rest:
                last.append(TextDelta(rest))
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
    two attempts. ``echo_keys``: providers and factories quote their key in their errors,
    and a model echoes its key in its reply, split over two chunks.
    ``reviews``: what the reviewer answers to the turn's 1st, 2nd, … review, whichever
    attempt asks (read only when the policy turns drafting or the tool checkpoint on).
    """

    models: tuple[ModelScript, ...]
    policy: TurnPolicy
    shared: SharedRouteScript | None = None
    signals: tuple[ChainSignal, ...] = ()
    broken_delivery: tuple[int, str] | None = None
    supersede_delay: float = 0.0
    echo_keys: bool = False
    reviews: tuple[ReviewerAct, ...] = ()

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
