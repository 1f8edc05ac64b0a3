"""OpenTelemetry traces of turns (the ``[otel]`` extra: ``pip install 'toolloop-fsm[otel]'``).

One line turns it on for every turn of the process::

    import toolloop_fsm.otel
    toolloop_fsm.otel.instrument()          # or instrument(tracer_provider=...)

or, for one turn, ``run_tool_loop(..., observer=TracingObserver())``. Each turn is a span
tree, following the OpenTelemetry semantic conventions for generative AI:

- the turn: ``invoke_agent`` (``invoke_agent {agent_name}`` when one is given), with the
  machine's terminal status and sub-reason (``toolloop.status``, ``toolloop.reason``) and the
  turn's token usage;
- each attempt of a generation turn: ``attempt {label}`` (key index, route, model), a child
  of the turn;
- each provider pass: ``chat {model}`` (kind ``CLIENT``: ``gen_ai.provider.name``,
  ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``/``output_tokens``; a failure's
  ``error.type``, ``http.response.status_code`` and ``toolloop.retry_after``), a child of its
  attempt (or of the turn), and the current span while the provider's stream is read, so an
  HTTP client's own spans nest under it;
- each tool call: ``execute_tool {name}`` (``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
  ``toolloop.dispatch``); the calls of one tool batch run at once, each its own span, ended
  as it ends, in any order.

A span of something that failed has status ``ERROR`` and an ``error.type``. No attribute holds
message text the library did not redact: under the outer tier every text is redacted of the
chain's keys first, and arguments, text and results are never recorded.

Zero cost when off: the core never imports OpenTelemetry; a turn started while nothing is
instrumented, or while the tracer provider records nothing (none configured, or not
sampled), gets no observer at all and runs the unobserved path.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
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
from toolloop_fsm.observation import remove_turn_observer
from toolloop_fsm.result import TurnStatus

#: The instrumentation scope every span is created under.
SCOPE = "toolloop_fsm"
#: Turn statuses a span reports as an error.
FAILED_STATUSES = frozenset({TurnStatus.ERROR, TurnStatus.TIMEOUT, TurnStatus.EMPTY_RESPONSE})

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
    """The spans of one turn. Pass one to a run function's ``observer=`` (one per turn), or let
    `instrument` build one for every turn. ``tracer_provider`` defaults to the global one."""

    def __init__(
        self, *, tracer_provider: TracerProvider | None = None, agent_name: str | None = None
    ) -> None:
        self._setup(_tracer(tracer_provider), agent_name)

    @classmethod
    def with_tracer(cls, tracer: trace.Tracer, agent_name: str | None = None) -> TracingObserver:
        """An observer on a tracer the caller already holds (one per process, not per turn)."""
        observer = cls.__new__(cls)
        observer._setup(tracer, agent_name)
        return observer

    def _setup(self, tracer: trace.Tracer, agent_name: str | None) -> None:
        self._tracer = tracer
        self._agent_name = agent_name
        self._turn: Span | None = None
        self._attempt: Span | None = None
        self._pass: Span | None = None
        # the open execute_tool spans, by (attempt, dispatch): a batch's calls overlap
        self._tools: dict[tuple[int, int], Span] = {}
        # the chat span is current while its stream is read: the token to take it back, in
        # the task that made it current
        self._current: tuple[object, asyncio.Task[Any] | None] | None = None

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
        attributes: Attributes = {"toolloop.tier": event.tier}
        if event.provider:
            attributes["gen_ai.provider.name"] = event.provider
        if event.model:
            attributes["gen_ai.request.model"] = event.model
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
        _end(
            span,
            attributes,
            (result.reason or result.status.value) if failed else None,
            result.error_message,
        )
        self._turn = None

    def turn_aborted(self, event: TurnAborted) -> None:
        span = self._turn
        if span is None:
            return
        why = "the turn was cancelled" if event.cancelled else "the turn raised"
        self._close_children(why)
        if event.cancelled:
            span.set_attribute("toolloop.status", "cancelled")
        else:
            span.set_attribute("toolloop.status", "raised")
            error = event.error or ""
            _fail(span, error.split(":", 1)[0] or "raised", error)
        span.end()
        self._turn = None

    def _close_children(self, why: str) -> None:
        """End what is still open when the turn ends (a caller's cancellation, a bug)."""
        tools = self._tools
        for key in sorted(tools):
            span = tools.pop(key)
            span.set_attributes({"toolloop.status": "cancelled", "toolloop.reason": why})
            span.end()
        for name in ("_pass", "_attempt"):
            child: Span | None = getattr(self, name)
            if child is not None:
                child.set_attributes({"toolloop.status": "cancelled", "toolloop.reason": why})
                child.end()
                setattr(self, name, None)
        self._leave_pass()

    # ------------------------------------------------------------------ spans
    def _child(self, name: str, kind: SpanKind, attributes: Attributes) -> Span:
        parent = self._attempt or self._turn
        context = trace.set_span_in_context(parent) if parent is not None else None
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
        attributes: Attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": event.provider,
            "toolloop.iteration": event.iteration,
        }
        if event.model:
            attributes["gen_ai.request.model"] = event.model
        name = f"chat {event.model}" if event.model else "chat"
        span = self._child(name, SpanKind.CLIENT, attributes)
        self._pass = span
        # current while the stream is read (in this task), so an HTTP client's spans nest
        token = otel_context.attach(trace.set_span_in_context(span))
        self._current = (token, _current_task())

    def _leave_pass(self) -> None:
        current = self._current
        self._current = None
        if current is not None and current[1] is _current_task():
            otel_context.detach(current[0])  # type: ignore[arg-type]

    def pass_ended(self, event: PassEnded) -> None:
        self._leave_pass()
        span = self._pass
        if span is None:
            return
        attributes: Attributes = {"toolloop.pass.outcome": event.outcome}
        if event.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = event.input_tokens
        if event.output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = event.output_tokens
            attributes["toolloop.usage.estimated"] = event.usage_estimated
        if event.finish is not None:
            attributes["gen_ai.response.finish_reasons"] = (event.finish,)
        _failure_facts(attributes, event.http_status, event.retry_after)
        _end(
            span,
            attributes,
            (event.error_kind or event.outcome) if event.failed else None,
            event.error,
        )
        self._pass = None

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
        self._tools[(event.attempt, event.dispatch)] = span

    def tool_ended(self, event: ToolEnded) -> None:
        span = self._tools.pop((event.attempt, event.dispatch), None)
        if span is None:
            return
        attributes: Attributes = {"toolloop.tool.outcome": event.outcome}
        _end(span, attributes, event.outcome if event.failed else None, event.error)


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
    """Builds each turn's `TracingObserver`, or none when its span would record nothing."""

    def __init__(self, tracer_provider: TracerProvider | None, agent_name: str | None) -> None:
        self.tracer_provider = tracer_provider
        self.agent_name = agent_name
        self.tracer = _tracer(tracer_provider)  # made once, not per turn

    def __call__(self) -> TracingObserver | None:
        observer = TracingObserver.with_tracer(self.tracer, self.agent_name)
        if observer.begin():
            return observer
        observer.abandon()
        return None


_installed: _Instrumentation | None = None


def instrument(
    *, tracer_provider: TracerProvider | None = None, agent_name: str | None = None
) -> None:
    """Trace every turn started from now on (calling it again replaces the settings).
    ``tracer_provider`` defaults to the global one; ``agent_name`` names the turn spans."""
    global _installed
    uninstrument()
    _installed = _Instrumentation(tracer_provider, agent_name)
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
    "FAILED_STATUSES",
    "SCOPE",
    "TracingObserver",
    "instrument",
    "is_instrumented",
    "uninstrument",
]
