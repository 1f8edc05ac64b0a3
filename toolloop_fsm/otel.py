"""OpenTelemetry traces and metrics of turns (the ``[otel]`` extra:
``pip install 'toolloop-fsm[otel]'``).

One line turns it on for every turn of the process::

    import toolloop_fsm.otel
    toolloop_fsm.otel.instrument()   # or instrument(tracer_provider=..., meter_provider=...)

or, for one turn, ``run_tool_loop(..., observer=TracingObserver())``. Each turn is a span
tree, following the OpenTelemetry semantic conventions for generative AI (docs/telemetry.md
maps every attribute to where it comes from):

- the turn: ``invoke_agent`` (``invoke_agent {agent_name}`` when one is given), with its
  provider, the host's ``gen_ai.conversation.id``, the machine's terminal status and
  sub-reason (``toolloop.status``, ``toolloop.reason``) and the turn's token usage;
- each attempt of a generation turn: ``attempt {label}`` (key index, route, model), a child
  of the turn;
- each provider pass: ``{operation} {model}`` (``chat``, ``text_completion``,
  ``generate_content``; kind ``CLIENT``: the well-known ``gen_ai.provider.name``,
  ``gen_ai.request.model``, ``server.address``/``server.port``, the ``gen_ai.response.model``
  and ``gen_ai.response.id`` the stream names, ``gen_ai.usage.input_tokens``/
  ``output_tokens``; a failure's ``error.type``, ``http.response.status_code`` and
  ``toolloop.retry_after``), a child of its attempt (or of the turn), and the current span
  while the provider's stream is read, so an HTTP client's own spans nest under it;
- each tool call the turn runs: ``execute_tool {name}`` (``gen_ai.tool.name``,
  ``gen_ai.tool.call.id``, ``toolloop.dispatch``; a tool that raised records an
  ``exception`` event and its class name as ``error.type``); the calls of one tool batch run
  at once, each its own span, ended as it ends, in any order. An outcome reused from the
  ledger (a replayed call) is no execution and has no span.

With a ``meter_provider``, the conventions' client metrics too (`Instruments`), their
durations taken from the turn's clock. A span of something that failed has status
``ERROR`` and an ``error.type``. No attribute holds
message text the library did not redact: under the outer tier every text is redacted of the
chain's keys first, and arguments, text and results are never recorded.

Zero cost when off: the core never imports OpenTelemetry; a turn started while nothing is
instrumented, or while the tracer provider records nothing (none configured, or not
sampled), gets no observer at all and runs the unobserved path.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from contextvars import Token
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics
    from opentelemetry import trace
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace import Status
    from opentelemetry.trace import StatusCode
    from opentelemetry.trace import TracerProvider
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "toolloop_fsm.otel needs OpenTelemetry: install the extra with "
        "pip install 'toolloop-fsm[otel]'"
    ) from err

from toolloop_fsm.observation import AttemptEnded
from toolloop_fsm.observation import AttemptStarted
from toolloop_fsm.observation import PassEnded
from toolloop_fsm.observation import PassStarted
from toolloop_fsm.observation import ToolEnded
from toolloop_fsm.observation import ToolStarted
from toolloop_fsm.observation import TurnAborted
from toolloop_fsm.observation import TurnEnded
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.observation import TurnStarted
from toolloop_fsm.observation import add_turn_observer
from toolloop_fsm.observation import listen_for_responses
from toolloop_fsm.observation import remove_turn_observer
from toolloop_fsm.observation import stop_listening
from toolloop_fsm.result import TurnStatus

#: The instrumentation scope every span is created under.
SCOPE = "toolloop_fsm"
#: Turn statuses a span reports as an error.
FAILED_STATUSES = frozenset({TurnStatus.ERROR, TurnStatus.TIMEOUT, TurnStatus.EMPTY_RESPONSE})
#: The ``error.type`` a metric gives an operation its caller cancelled.
CANCELLED = "cancelled"
#: The conventions' bucket boundaries: of a pass's and a tool call's duration (0.01 s to
#: 81.92 s, doubling), of a token count (1 to 4**13, by fours), of a turn's duration (0.1 s
#: to 409.6 s, doubling); rounded, so each is the decimal the conventions list.
OPERATION_SECONDS: Sequence[float] = tuple(round(0.01 * 2**i, 2) for i in range(14))
TOKEN_COUNTS: Sequence[float] = tuple(4**i for i in range(14))
AGENT_SECONDS: Sequence[float] = tuple(round(0.1 * 2**i, 1) for i in range(13))

Attributes = dict[str, Any]


@functools.cache
def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    try:
        return version("toolloop-fsm")
    except PackageNotFoundError:
        return None


class TracingObserver(TurnObserver):
    """The spans and metrics of one turn. Pass one to a run function's ``observer=`` (one per
    turn), or let `instrument` build one for every turn. ``tracer_provider`` defaults to the
    global one; metrics are recorded only with a ``meter_provider``."""

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        agent_name: str | None = None,
    ) -> None:
        instruments = None if meter_provider is None else Instruments(meter_provider)
        self._setup(_tracer(tracer_provider), agent_name, instruments)

    @classmethod
    def with_tracer(
        cls,
        tracer: trace.Tracer,
        agent_name: str | None = None,
        instruments: Instruments | None = None,
    ) -> TracingObserver:
        """An observer on a tracer (and the metric instruments) the caller already holds (one
        per process, not per turn)."""
        observer = cls.__new__(cls)
        observer._setup(tracer, agent_name, instruments)
        return observer

    def _setup(
        self, tracer: trace.Tracer, agent_name: str | None, instruments: Instruments | None
    ) -> None:
        self._tracer = tracer
        self._agent_name = agent_name
        self._instruments = instruments
        self._turn: Span | None = None
        self._started: TurnStarted | None = None
        self._attempt: Span | None = None
        self._pass: Span | None = None
        self._pass_started: PassStarted | None = None
        # what the stream of the pass being read said of its response: (model, id)
        self._response: tuple[str | None, str | None] = (None, None)
        # the open execute_tool spans and their starts, by (attempt, dispatch): a batch's
        # calls overlap
        self._tools: dict[tuple[int, int], tuple[Span, ToolStarted]] = {}
        # while a pass is read, in the task reading it: the chat span is current (the token
        # to take it back) and its stream's response names are listened for (the token to
        # stop)
        self._current: tuple[object, Token[Any], asyncio.Task[Any] | None] | None = None

    # ------------------------------------------------------------------ the turn
    def begin(self) -> bool:
        """Start the turn's span now (once); returns whether it records (a tracer provider
        that records nothing gives a span that does not)."""
        if self._turn is None:
            name = f"invoke_agent {self._agent_name}" if self._agent_name else "invoke_agent"
            attributes: Attributes = {"gen_ai.operation.name": "invoke_agent"}
            if self._agent_name:
                attributes["gen_ai.agent.name"] = self._agent_name
            self._turn = self._tracer.start_span(
                name, kind=SpanKind.INTERNAL, attributes=attributes
            )
        return self._turn.is_recording()

    def abandon(self) -> None:
        """End the turn's span unused: the turn will not be observed by this observer."""
        if self._turn is not None:
            self._turn.end()
            self._turn = None

    def turn_started(self, event: TurnStarted) -> None:
        self.begin()
        assert self._turn is not None
        self._started = event
        attributes: Attributes = {"toolloop.tier": event.tier}
        if event.provider:
            attributes["gen_ai.provider.name"] = event.provider
        if event.model:
            attributes["gen_ai.request.model"] = event.model
        if event.conversation_id:
            attributes["gen_ai.conversation.id"] = event.conversation_id
        self._turn.set_attributes(attributes)

    def turn_ended(self, event: TurnEnded) -> None:
        span = self._turn
        if span is None:
            return
        result = event.result
        self._close_children("the turn ended")
        attributes: Attributes = {
            "toolloop.status": result.status.value,
            "toolloop.iterations": result.iterations,
            "toolloop.tool_dispatches": result.tool_dispatches,
        }
        if result.reason is not None:
            attributes["toolloop.reason"] = result.reason
        if result.usage.entries:
            attributes["gen_ai.usage.input_tokens"] = result.usage.input_tokens
            attributes["gen_ai.usage.output_tokens"] = result.usage.output_tokens
            attributes["toolloop.usage.estimated"] = result.usage.has_estimates
        if result.attempts:
            attributes["toolloop.attempts"] = len(result.attempts)
        failed = result.status in FAILED_STATUSES
        error_type = (result.reason or result.status.value) if failed else None
        _end(span, attributes, error_type, result.error_message)
        self._turn = None
        self._measure_turn(event.at, error_type)

    def turn_aborted(self, event: TurnAborted) -> None:
        span = self._turn
        if span is None:
            return
        why = "the turn was cancelled" if event.cancelled else "the turn raised"
        self._close_children(why)
        if event.cancelled:
            span.set_attribute("toolloop.status", "cancelled")
            error_type = CANCELLED
        else:
            span.set_attribute("toolloop.status", "raised")
            error = event.error or ""
            error_type = _recorded_exception(span, error) or "raised"
            _fail(span, error_type, error)
        span.end()
        self._turn = None
        self._measure_turn(event.at, error_type)

    def _measure_turn(self, at: float, error_type: str | None) -> None:
        started = self._started
        instruments = self._instruments
        if instruments is None or started is None:
            return
        attributes: Attributes = {}
        if self._agent_name:
            attributes["gen_ai.agent.name"] = self._agent_name
        if started.model:  # a tool-loop turn has one model; a generation turn's chain has many
            attributes["gen_ai.request.model"] = started.model
        if error_type is not None:
            attributes["error.type"] = error_type
        instruments.agent_duration.record(at - started.at, attributes)

    def _close_children(self, why: str) -> None:
        """End what is still open when the turn ends (a caller's cancellation, a bug)."""
        tools = self._tools
        for key in sorted(tools):
            span, _started = tools.pop(key)
            span.set_attributes({"toolloop.status": "cancelled", "toolloop.reason": why})
            span.end()
        for name in ("_pass", "_attempt"):
            child: Span | None = getattr(self, name)
            if child is not None:
                child.set_attributes({"toolloop.status": "cancelled", "toolloop.reason": why})
                child.end()
                setattr(self, name, None)
        self._pass_started = None
        self._leave_pass()

    # ------------------------------------------------------------------ spans
    def _child(self, name: str, kind: SpanKind, attributes: Attributes) -> Span:
        parent = self._attempt or self._turn
        context = trace.set_span_in_context(parent) if parent is not None else None
        conversation = self._started.conversation_id if self._started is not None else None
        if conversation:
            attributes["gen_ai.conversation.id"] = conversation
        return self._tracer.start_span(name, context=context, kind=kind, attributes=attributes)

    def attempt_started(self, event: AttemptStarted) -> None:
        attributes: Attributes = {
            "toolloop.attempt.index": event.attempt,
            "toolloop.attempt.label": event.label,
            "toolloop.attempt.route": event.route,
        }
        if event.key_index is not None:
            attributes["toolloop.attempt.key_index"] = event.key_index
        if event.provider:
            attributes["gen_ai.provider.name"] = event.provider
            if self._turn is not None:  # the turn's provider: the attempt's that answers
                self._turn.set_attribute("gen_ai.provider.name", event.provider)
        if event.model:
            attributes["gen_ai.request.model"] = event.model
        parent = self._turn
        context = trace.set_span_in_context(parent) if parent is not None else None
        self._attempt = self._tracer.start_span(
            f"attempt {event.label}",
            context=context,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )

    def attempt_ended(self, event: AttemptEnded) -> None:
        span = self._attempt
        if span is None:
            return
        attributes: Attributes = {"toolloop.status": event.status.value}
        if event.reason is not None:
            attributes["toolloop.reason"] = event.reason
        _failure_facts(attributes, event.http_status, event.retry_after)
        failed = event.status in FAILED_STATUSES
        _end(
            span,
            attributes,
            (event.error_kind or event.reason or event.status.value) if failed else None,
            event.error,
        )
        self._attempt = None

    def pass_started(self, event: PassStarted) -> None:
        attributes = _pass_attributes(event)
        attributes["toolloop.iteration"] = event.iteration
        name = f"{event.operation} {event.model}" if event.model else event.operation
        span = self._child(name, SpanKind.CLIENT, attributes)
        self._pass = span
        self._pass_started = event
        self._response = (None, None)
        # current while the stream is read (in this task), so an HTTP client's spans nest
        # and the stream's response names reach this pass
        token = otel_context.attach(trace.set_span_in_context(span))
        listening = listen_for_responses(self._heard_response)
        self._current = (token, listening, _current_task())

    def _heard_response(self, model: str | None, response_id: str | None) -> None:
        heard_model, heard_id = self._response
        self._response = (model or heard_model, response_id or heard_id)

    def _leave_pass(self) -> None:
        current = self._current
        self._current = None
        if current is not None and current[2] is _current_task():
            stop_listening(current[1])
            otel_context.detach(current[0])  # type: ignore[arg-type]

    def pass_ended(self, event: PassEnded) -> None:
        self._leave_pass()
        span = self._pass
        started = self._pass_started
        if span is None:
            return
        attributes: Attributes = {"toolloop.pass.outcome": event.outcome}
        response_model, response_id = self._response
        if response_model:
            attributes["gen_ai.response.model"] = response_model
        if response_id:
            attributes["gen_ai.response.id"] = response_id
        if event.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = event.input_tokens
        if event.output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = event.output_tokens
            attributes["toolloop.usage.estimated"] = event.usage_estimated
        if event.finish is not None:
            attributes["gen_ai.response.finish_reasons"] = (event.finish,)
        _failure_facts(attributes, event.http_status, event.retry_after)
        error_type = (event.error_kind or event.outcome) if event.failed else None
        _end(span, attributes, error_type, event.error)
        self._pass = None
        self._pass_started = None
        if started is not None:
            self._measure_pass(started, event, error_type)

    def _measure_pass(self, started: PassStarted, ended: PassEnded, error: str | None) -> None:
        instruments = self._instruments
        if instruments is None:
            return
        attributes = _pass_attributes(started)
        if self._response[0]:
            attributes["gen_ai.response.model"] = self._response[0]
        # estimated usage is the library's own count, not the provider's: the conventions
        # allow offline counting only at the user's asking, so it is not reported
        if ended.input_tokens is not None and not ended.usage_estimated:
            instruments.token_usage.record(
                ended.input_tokens, {**attributes, "gen_ai.token.type": "input"}
            )
            instruments.token_usage.record(
                ended.output_tokens or 0, {**attributes, "gen_ai.token.type": "output"}
            )
        if error is None and ended.outcome == CANCELLED:
            error = CANCELLED
        if error is not None:
            attributes["error.type"] = error
        instruments.operation_duration.record(ended.at - started.at, attributes)

    def tool_started(self, event: ToolStarted) -> None:
        attributes: Attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": event.name,
            "gen_ai.tool.type": "function",
            "toolloop.dispatch": event.dispatch,
        }
        if event.call_id:
            attributes["gen_ai.tool.call.id"] = event.call_id
        span = self._child(f"execute_tool {event.name}", SpanKind.INTERNAL, attributes)
        self._tools[(event.attempt, event.dispatch)] = (span, event)

    def tool_ended(self, event: ToolEnded) -> None:
        opened = self._tools.pop((event.attempt, event.dispatch), None)
        if opened is None:
            return
        span, started = opened
        span.set_attribute("toolloop.tool.outcome", event.outcome)
        error_type: str | None = None
        if event.failed:
            error_type = event.outcome
            if event.outcome == "raised":
                error_type = _recorded_exception(span, event.error or "") or error_type
            _fail(span, error_type, event.error)
        span.end()
        instruments = self._instruments
        if instruments is not None:
            attributes: Attributes = {
                "gen_ai.tool.name": event.name,
                "gen_ai.tool.type": "function",
            }
            if self._agent_name:
                attributes["gen_ai.agent.name"] = self._agent_name
            if error_type is not None:
                attributes["error.type"] = error_type
            instruments.tool_duration.record(event.at - started.at, attributes)


class Instruments:
    """The GenAI client metrics the conventions define, made once on a meter provider's
    meter: the duration of each pass (``gen_ai.client.operation.duration``) and its tokens
    (``gen_ai.client.token.usage``), of each tool call (``gen_ai.execute_tool.duration``) and
    of each turn (``gen_ai.invoke_agent.duration``), with the conventions' bucket
    boundaries. Durations come from the events' times: the turn's clock."""

    __slots__ = ("agent_duration", "operation_duration", "token_usage", "tool_duration")

    def __init__(self, meter_provider: MeterProvider) -> None:
        meter = metrics.get_meter(SCOPE, _version() or "", meter_provider)
        self.operation_duration = _histogram(
            meter, "gen_ai.client.operation.duration", "s", "GenAI operation duration."
        )
        self.token_usage = _histogram(
            meter,
            "gen_ai.client.token.usage",
            "{token}",
            "Number of input and output tokens used.",
            TOKEN_COUNTS,
        )
        self.tool_duration = _histogram(
            meter,
            "gen_ai.execute_tool.duration",
            "s",
            "The duration of a single tool execution.",
        )
        self.agent_duration = _histogram(
            meter,
            "gen_ai.invoke_agent.duration",
            "s",
            "The end-to-end duration of a single agent invocation.",
            AGENT_SECONDS,
        )


def _histogram(
    meter: metrics.Meter,
    name: str,
    unit: str,
    description: str,
    boundaries: Sequence[float] = OPERATION_SECONDS,
) -> metrics.Histogram:
    """A histogram of the conventions' ``name``, with its unit, description and bucket
    boundaries (seconds by default)."""
    return meter.create_histogram(
        name, unit=unit, description=description, explicit_bucket_boundaries_advisory=boundaries
    )


def _pass_attributes(event: PassStarted) -> Attributes:
    """What a pass's span and its metrics both say of it from its start."""
    attributes: Attributes = {
        "gen_ai.operation.name": event.operation,
        "gen_ai.provider.name": event.provider,
    }
    if event.model:
        attributes["gen_ai.request.model"] = event.model
    if event.server_address:
        attributes["server.address"] = event.server_address
        if event.server_port is not None:
            attributes["server.port"] = event.server_port
    return attributes


def _recorded_exception(span: Span, error: str) -> str | None:
    """Record the exception ``error`` names on ``span`` (an ``exception`` event) and return
    its class name, when ``error`` is ``"{class name}: {message}"`` — how the library writes
    an exception a tool or a turn raised (already redacted); else ``None``."""
    head, colon, message = error.partition(":")
    if not colon or not all(part.isidentifier() for part in head.split(".")):
        return None
    span.add_event("exception", {"exception.type": head, "exception.message": message.strip()})
    return head


def _tracer(tracer_provider: TracerProvider | None) -> trace.Tracer:
    """The library's tracer from ``tracer_provider`` (the global one: a proxy that follows
    the provider the host sets, whenever it sets it)."""
    return trace.get_tracer(SCOPE, _version(), tracer_provider)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


def _failure_facts(attributes: Attributes, http_status: int | None, retry: float | None) -> None:
    if http_status is not None:
        attributes["http.response.status_code"] = http_status
    if retry is not None:
        attributes["toolloop.retry_after"] = retry


def _end(span: Span, attributes: Attributes, failed_as: str | None, error: str | None) -> None:
    """End ``span`` with ``attributes``; failed, with ``failed_as`` as its ``error.type``,
    unless that is ``None``."""
    span.set_attributes(attributes)
    if failed_as is not None:
        _fail(span, failed_as, error)
    span.end()


def _fail(span: Span, error_type: str, description: str | None) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, description or error_type))


# --------------------------------------------------------------------------- instrumenting
class _Instrumentation:
    """Builds each turn's `TracingObserver`, or none when it would record nothing (no
    metrics, and a turn span that does not record)."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
        agent_name: str | None,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.agent_name = agent_name
        # made once, not per turn
        self.tracer = _tracer(tracer_provider)
        self.instruments = None if meter_provider is None else Instruments(meter_provider)

    def __call__(self) -> TracingObserver | None:
        observer = TracingObserver.with_tracer(self.tracer, self.agent_name, self.instruments)
        if observer.begin() or self.instruments is not None:
            return observer
        observer.abandon()
        return None


_installed: _Instrumentation | None = None


def instrument(
    *,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    agent_name: str | None = None,
) -> None:
    """Trace every turn started from now on (calling it again replaces the settings).
    ``tracer_provider`` defaults to the global one; with a ``meter_provider`` (pass
    ``opentelemetry.metrics.get_meter_provider()`` for the global one) the turns' metrics
    are recorded too; ``agent_name`` names the turn spans."""
    global _installed
    uninstrument()
    _installed = _Instrumentation(tracer_provider, meter_provider, agent_name)
    add_turn_observer(_installed)


def uninstrument() -> None:
    """Stop tracing turns started from now on."""
    global _installed
    if _installed is not None:
        remove_turn_observer(_installed)
        _installed = None


def is_instrumented() -> bool:
    return _installed is not None


__all__ = [
    "AGENT_SECONDS",
    "CANCELLED",
    "FAILED_STATUSES",
    "OPERATION_SECONDS",
    "SCOPE",
    "TOKEN_COUNTS",
    "Instruments",
    "TracingObserver",
    "instrument",
    "is_instrumented",
    "uninstrument",
]
