"""Watching a turn as it runs: the phase events of a turn (turn, attempt, provider pass, tool
call — each started and ended), `TurnObserver`, which receives them, the registry of
observers every turn gets (`add_turn_observer`), what a provider says of itself to them
(`identify_provider`), and how a stream tells them the model and id of its response while
it is read (`report_response`, `listen_for_responses`).

One observation point serves every consumer: the OpenTelemetry spans (`toolloop_fsm.otel`)
and the live event stream (`toolloop_fsm.stream`) are both observers. The pumps call an
observer at a turn's lifecycle points only when one is attached; a turn nothing observes runs
exactly as it would without this module. Chunks reach an observer only when it asks for them
(``wants_chunks``): the provider's stream is then read through a tap, and only then.

Every text in these events that the library wrote from something that failed (an error
message) has been redacted of the turn's API keys, as results are. Times (``at``) are the
turn's clock (`toolloop_fsm.host.Clock`), the same as the trace's.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from contextvars import ContextVar
from contextvars import Token
from typing import Any
from typing import TypeVar

from attrs import field
from attrs import frozen

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus


# --------------------------------------------------------------------------- the turn
@frozen
class TurnStarted:
    """A turn began. ``tier`` is ``tool_loop`` (`run_tool_loop`: one provider, named by
    ``provider`` and ``model``) or ``generation`` (`run_generation_turn`: each attempt names
    its own)."""

    tier: str
    at: float
    provider: str | None = None
    model: str | None = None
    #: the host's id of the conversation the turn belongs to (`TurnRequest.conversation_id`)
    conversation_id: str | None = None


@frozen
class TurnEnded:
    """The turn returned ``result`` (redacted, as the run function returns it)."""

    result: GenerationTurnResult
    at: float


@frozen
class TurnAborted:
    """The turn did not return a result: its caller cancelled it (``cancelled``) or it raised
    (``error`` names the exception, redacted)."""

    at: float
    cancelled: bool
    error: str | None = None


# --------------------------------------------------------------------------- attempts
@frozen
class AttemptStarted:
    """Attempt ``attempt`` (1-based) of a generation turn began: model ``label`` of the chain
    with key ``key_index`` (an index, never the key) on the ``route`` (``user``/``shared``).
    ``provider`` and ``model`` name what its factory built (``None`` when the factory
    raised)."""

    attempt: int
    label: str
    key_index: int | None
    route: str
    at: float
    provider: str | None = None
    model: str | None = None


@frozen
class AttemptEnded:
    """Attempt ``attempt`` ended with ``status`` and ``reason``. A provider failure names its
    ``error_kind``, ``http_status`` and ``retry_after``; ``error`` is the attempt's error
    message (redacted)."""

    attempt: int
    label: str
    status: TurnStatus
    at: float
    reason: str | None = None
    error_kind: str | None = None
    http_status: int | None = None
    retry_after: float | None = None
    error: str | None = None


# --------------------------------------------------------------------------- provider passes
@frozen
class PassStarted:
    """Provider pass ``iteration`` (1-based, within its attempt) began to stream.
    ``attempt`` is 0 in a `run_tool_loop` turn. ``operation`` is what the provider calls a
    pass (`ProviderIdentity`), ``server_address`` and ``server_port`` where it goes."""

    attempt: int
    iteration: int
    provider: str
    model: str | None
    at: float
    operation: str = "chat"
    server_address: str | None = None
    server_port: int | None = None


@frozen
class PassEnded:
    """Pass ``iteration`` ended. ``outcome`` is how the loop recorded it (``completed``,
    ``function_call``, ``empty``, ``error``, ``timeout``, …; ``cancelled`` when the turn's
    caller cancelled it); ``failed`` says it ended in a failure — the provider raised
    (``error_kind``, ``http_status``, ``retry_after`` and ``error`` say how) or a stream
    deadline expired. Usage is the pass's, ``usage_estimated`` when the provider reported
    none."""

    attempt: int
    iteration: int
    outcome: str
    at: float
    failed: bool = False
    input_tokens: int | None = None
    output_tokens: int | None = None
    usage_estimated: bool = False
    finish: str | None = None
    error_kind: str | None = None
    http_status: int | None = None
    retry_after: float | None = None
    error: str | None = None


# --------------------------------------------------------------------------- tool calls
@frozen
class ToolStarted:
    """Dispatch ``dispatch`` of tool ``name`` began (``call_id``: the model's id for the call,
    when it gave one). Several may be open at once: the calls of one tool batch."""

    attempt: int
    dispatch: int
    name: str
    arguments: Mapping[str, Any] = field(repr=False)
    call_id: str | None
    at: float


@frozen
class ToolEnded:
    """Dispatch ``dispatch`` of tool ``name`` ended: ``outcome`` is ``succeeded``, ``failed``
    (the tool said so), ``raised``, ``timeout`` (its deadline expired) or ``cancelled`` (a
    stop, a failure elsewhere, or the turn ending); ``error`` says why (redacted).
    ``call_id`` is its `ToolStarted`'s: the calls of a tool batch run at once and end in any
    order, each told apart by its dispatch and call id."""

    attempt: int
    dispatch: int
    name: str
    outcome: str
    at: float
    error: str | None = None
    call_id: str | None = None

    @property
    def failed(self) -> bool:
        return self.outcome != "succeeded"


# --------------------------------------------------------------------------- providers
@frozen
class ProviderIdentity:
    """What a provider says of itself to the observers: ``name`` (the OpenTelemetry GenAI
    conventions' ``gen_ai.provider.name``: an adapter's well-known value or the host's
    ``provider_name=``), the ``model`` it asks for, its ``operation`` (``chat``,
    ``text_completion``, ``generate_content``) and the server it talks to."""

    name: str
    model: str | None = None
    operation: str = "chat"
    server_address: str | None = None
    server_port: int | None = None


_T = TypeVar("_T")
#: How deep `identify_provider` looks through wrappers (their ``provider``).
_WRAPPER_DEPTH = 4


def identify_provider(provider: object) -> ProviderIdentity:
    """``provider``'s identity, looking through wrappers (`VerbatimToolCalls`,
    `ContinuationSession`: their ``provider``) for the adapter that names a ``model``: its
    ``provider_name`` (else its ``name``), ``operation_name``, ``server_address`` and
    ``server_port``. A provider without them is named by its ``name`` (else its class), and
    its operation is ``chat``. A host's attribute that raises or holds no text names
    nothing."""
    name = _attribute(provider, "name", str) or type(provider).__name__
    seen: object = provider
    for _ in range(_WRAPPER_DEPTH):
        model = _attribute(seen, "model", str)
        if model is not None:
            port = _attribute(seen, "server_port", int)
            return ProviderIdentity(
                _attribute(seen, "provider_name", str) or _attribute(seen, "name", str) or name,
                model,
                _attribute(seen, "operation_name", str) or "chat",
                _attribute(seen, "server_address", str),
                port if port is None or port > 0 else None,
            )
        inner = getattr(seen, "provider", None)
        if inner is None or inner is seen:
            break
        seen = inner
    return ProviderIdentity(_attribute(provider, "provider_name", str) or name)


def _attribute(owner: object, name: str, kind: type[_T]) -> _T | None:
    try:
        value = getattr(owner, name, None)
    except Exception:  # a host's property that raises names nothing
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or not value:
        return None
    return value


# --------------------------------------------------------------------------- responses
#: What a stream reports the model and id of its response to while the stream is read
ResponseListener = Callable[[str | None, str | None], None]

_response_listener: ContextVar[ResponseListener | None] = ContextVar(
    "toolloop_fsm_response_listener", default=None
)


def report_response(model: str | None, response_id: str | None) -> None:
    """A provider's stream learned the model that writes its response and the response's id
    (either may be ``None``): tell the listener of the pass being read, if any. The adapters
    call it as their decoders read the names, before the chunks that came with them."""
    listener = _response_listener.get()
    if listener is not None and (model or response_id):
        listener(model, response_id)


def listen_for_responses(listener: ResponseListener) -> Token[ResponseListener | None]:
    """Have the streams read from now on in this task (and the tasks it starts) report their
    response's names to ``listener``; give the token back to `stop_listening`. An observer's
    `TurnObserver.pass_started` runs in the task that reads the pass: listening there hears
    that pass."""
    return _response_listener.set(listener)


def stop_listening(token: Token[ResponseListener | None]) -> None:
    """Undo the `listen_for_responses` that gave ``token`` (in the task it was given in)."""
    _response_listener.reset(token)


#: The phase events of a turn that ran to its result: what a live stream yields of its phases.
ProgressEvent = (
    TurnStarted
    | AttemptStarted
    | AttemptEnded
    | PassStarted
    | PassEnded
    | ToolStarted
    | ToolEnded
    | TurnEnded
)
#: Every phase event an observer is told of: the progress, or that the turn raised.
PhaseEvent = ProgressEvent | TurnAborted
#: The `TurnObserver` method each phase event is given to.
OBSERVER_METHOD: Mapping[type, str] = {
    TurnStarted: "turn_started",
    TurnEnded: "turn_ended",
    TurnAborted: "turn_aborted",
    AttemptStarted: "attempt_started",
    AttemptEnded: "attempt_ended",
    PassStarted: "pass_started",
    PassEnded: "pass_ended",
    ToolStarted: "tool_started",
    ToolEnded: "tool_ended",
}
#: The chunks an observer that ``wants_chunks`` is shown, as the provider streamed them.
ObservedChunk = TextDelta | ThoughtDelta | FunctionCall
OBSERVED_CHUNKS: tuple[type, ...] = (TextDelta, ThoughtDelta, FunctionCall)


class TurnObserver:
    """Receives one turn's phase events as they happen; override what you need (every method
    does nothing here). An observer serves one turn at a time: the pumps call it on the
    event loop's thread, in order, never two calls at once.

    Calls must be quick and must not await: they run inside the turn. An observer that
    raises is logged (WARNING, ``toolloop_fsm.turn``) and the turn goes on. With
    ``wants_chunks``, `chunk` sees every text, thought and call chunk the provider streams,
    before the loop takes it.
    """

    wants_chunks: bool = False

    def turn_started(self, event: TurnStarted) -> None:
        """The turn began."""

    def turn_ended(self, event: TurnEnded) -> None:
        """The turn returned its result."""

    def turn_aborted(self, event: TurnAborted) -> None:
        """The turn was cancelled or raised."""

    def attempt_started(self, event: AttemptStarted) -> None:
        """An attempt of a generation turn began."""

    def attempt_ended(self, event: AttemptEnded) -> None:
        """An attempt of a generation turn ended."""

    def pass_started(self, event: PassStarted) -> None:
        """A provider pass began to stream."""

    def pass_ended(self, event: PassEnded) -> None:
        """A provider pass ended."""

    def tool_started(self, event: ToolStarted) -> None:
        """A tool call began."""

    def tool_ended(self, event: ToolEnded) -> None:
        """A tool call ended."""

    def chunk(self, event: ObservedChunk) -> None:
        """A chunk arrived from the provider (only with ``wants_chunks``)."""


#: Builds the observer of one turn, or ``None`` to leave that turn unobserved.
ObserverFactory = Callable[[], TurnObserver | None]

_factories: list[ObserverFactory] = []


def add_turn_observer(factory: ObserverFactory) -> None:
    """Give every turn started from now on the observer ``factory`` builds for it (called once
    per turn, as it starts; returning ``None`` leaves the turn unobserved by it). Adding the
    same factory twice adds it once."""
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    if factory not in _factories:
        _factories.append(factory)


def remove_turn_observer(factory: ObserverFactory) -> None:
    """Stop giving new turns ``factory``'s observers (a factory not added is ignored)."""
    if factory in _factories:
        _factories.remove(factory)


def turn_observer_factories() -> tuple[ObserverFactory, ...]:
    """The factories every new turn is observed by, in the order they were added."""
    return tuple(_factories)


__all__ = [
    "OBSERVED_CHUNKS",
    "OBSERVER_METHOD",
    "AttemptEnded",
    "AttemptStarted",
    "ObservedChunk",
    "ObserverFactory",
    "PassEnded",
    "PassStarted",
    "PhaseEvent",
    "ProgressEvent",
    "ProviderIdentity",
    "ResponseListener",
    "ToolEnded",
    "ToolStarted",
    "TurnAborted",
    "TurnEnded",
    "TurnObserver",
    "TurnStarted",
    "add_turn_observer",
    "identify_provider",
    "listen_for_responses",
    "remove_turn_observer",
    "report_response",
    "stop_listening",
    "turn_observer_factories",
]
