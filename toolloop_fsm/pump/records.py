"""The log records of a turn, on the standard `logging` module:

- ``toolloop_fsm.machine``, DEBUG: one record per transition of either machine (state, event,
  next state, the guard that fired, the attempt);
- ``toolloop_fsm.turn``, WARNING: what failed and why — a provider pass (its kind, HTTP
  status and ``retry_after``), a stream or tool deadline, the host's channel, code abandoned
  for ignoring its cancellation, a failed attempt and what the chain does next, an observer
  that raised.

Every text a record carries goes through the turn's `Secrets` first: under the outer tier a
record never holds a key, nor a run of one. No record carries a traceback (its frames may
quote what a record must not). The fields are also on the record (``extra``), for
structured handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.pump.redaction import NO_SECRETS
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import TraceStep

MACHINE_LOG = logging.getLogger("toolloop_fsm.machine")
TURN_LOG = logging.getLogger("toolloop_fsm.turn")


class TurnRecords:
    """What a turn's records say about where they come from: the attempt (0 in a
    `run_tool_loop` turn) and the keys to redact."""

    __slots__ = ("attempt", "secrets")

    def __init__(self, attempt: int = 0, secrets: Secrets = NO_SECRETS) -> None:
        self.attempt = attempt
        self.secrets = secrets

    def _where(self) -> str:
        return f" (attempt {self.attempt})" if self.attempt else ""

    # ------------------------------------------------------------------ transitions
    def logging_steps(
        self, machine: str, on_step: Callable[[TraceStep], None] | None
    ) -> Callable[[TraceStep], None] | None:
        """``on_step``, preceded by a DEBUG record of each step when ``toolloop_fsm.machine``
        logs DEBUG as the turn starts (otherwise ``on_step`` itself: nothing per step)."""
        if not MACHINE_LOG.isEnabledFor(logging.DEBUG):
            return on_step

        def log_step(step: TraceStep) -> None:
            self.log_step(machine, step)
            if on_step is not None:
                on_step(step)

        return log_step

    def log_step(self, machine: str, step: TraceStep) -> None:
        guard = f" [guard {step.guard}]" if step.guard is not None else ""
        detail = f" ({step.detail})" if step.detail is not None else ""
        text = (
            f"{machine}{self._where()}: {step.state} --{step.event}--> {step.next_state}"
            f"{guard}{detail}"
        )
        MACHINE_LOG.debug(
            "%s",
            self.secrets.clean(text) if self.secrets.holds_any(text) else text,
            extra={
                "machine": machine,
                "attempt": self.attempt,
                "state": step.state,
                "event": step.event,
                "next_state": step.next_state,
                "guard": step.guard,
                "at": step.at,
            },
        )

    # ------------------------------------------------------------------ failures
    def _warn(self, text: str, **fields: Any) -> None:
        fields.setdefault("attempt", self.attempt)
        TURN_LOG.warning("%s", self.secrets.clean(text), extra=fields)

    def stream_failed(self, provider: str, iteration: int, event: StreamFailed) -> None:
        """A provider pass failed: its kind, HTTP status and wait hint, and its message."""
        facts = [event.kind]
        if event.status_code is not None:
            facts.append(f"HTTP {event.status_code}")
        if event.retry_after is not None:
            facts.append(f"retry after {event.retry_after:g} s")
        facts.append("retryable" if event.retryable else "not retryable")
        self._warn(
            f"provider {provider} pass {iteration}{self._where()} failed "
            f"({', '.join(facts)}): {event.message}",
            failure="provider",
            provider=provider,
            iteration=iteration,
            kind=event.kind,
            status_code=event.status_code,
            retry_after=event.retry_after,
            retryable=event.retryable,
        )

    def deadline_expired(
        self,
        kind: DeadlineKind,
        seconds: float | None,
        *,
        provider: str,
        iteration: int,
        tool: str,
    ) -> None:
        """A deadline expired: the provider's (first token, inactivity, pass duration), a
        tool's, a review's, or the settle window of deliveries in flight."""
        within = f" within {seconds:g} s" if seconds is not None else ""
        if kind is DeadlineKind.TOOL:
            text, failure = f"{tool} did not finish{within}; it was cancelled", "tool"
        elif kind is DeadlineKind.REVIEW:
            text = f"the reviewer did not answer{within}; the review was cancelled"
            failure = "reviewer"
        elif kind is DeadlineKind.SETTLE:
            text = f"deliveries still in flight did not settle{within}; they were abandoned"
            failure = "host"
        else:
            budget = {
                DeadlineKind.FIRST_TOKEN: f"no first chunk{within}",
                DeadlineKind.INACTIVITY: f"no chunk{within}",
                DeadlineKind.PASS_DURATION: f"the pass did not end{within}",
            }.get(kind, f"{kind.value} deadline{within}")
            text, failure = f"provider {provider} pass {iteration} timed out: {budget}", "provider"
        self._warn(
            f"{text}{self._where()}",
            failure=failure,
            deadline=kind.value,
            seconds=seconds,
            provider=provider,
            iteration=iteration,
        )

    def host_failed(self, event: DeliveryFailed) -> None:
        """The host's channel raised, or did not return within the host-call budget."""
        what = "a delivery" if event.seq is not None else "a notice or the stop message"
        self._warn(
            f"the host's channel failed on {what}{self._where()}: {event.error}",
            failure="host",
            seq=event.seq,
            timed_out=event.timed_out,
        )

    def reviewer_failed(self, review: int, error: BaseException) -> None:
        """The reviewer raised: the review counts as unavailable."""
        self._warn(
            f"the reviewer raised on review {review}{self._where()}: "
            f"{type(error).__name__}: {error}",
            failure="reviewer",
        )

    def abandoned(self, name: str, grace: float, in_doubt: InDoubtCall | None = None) -> None:
        """Code that ignored its cancellation for the grace was given up on; a tool so
        abandoned is in doubt (``in_doubt``, on the record too: docs/behaviour.md §3.9)."""
        doubt = "; its outcome is in doubt" if in_doubt is not None else ""
        self._warn(
            f"{name} ignored its cancellation for {grace:g} s and was abandoned"
            f"{self._where()}{doubt}",
            failure="abandoned",
            call=name,
            in_doubt=in_doubt,
        )

    def settled(self, call: InDoubtCall) -> None:
        """A call in doubt was settled: by its reconcile hook's answer, or as unknown."""
        how = (
            "its reconcile hook's answer is its outcome"
            if call.reconciled
            else "nothing could tell what happened; the model is told its outcome is unknown"
        )
        self._warn(
            f"tool {call.tool} (dispatch {call.dispatch}){self._where()} was cut off mid-run "
            f"({call.cause.value}): {how}",
            failure="in_doubt",
            call=f"tool {call.tool} (dispatch {call.dispatch})",
            in_doubt=call,
        )

    def given_up(self, name: str, seconds: float) -> None:
        """A call into host code that ends nothing overran its budget and was given up on."""
        self.host_call_failed(name, f"did not return within {seconds:g} s; given up on")

    def host_call_failed(self, name: str, problem: str) -> None:
        """A call into host code that ends nothing (a notice, a hook, the admission policy)
        failed."""
        self._warn(f"{name} failed{self._where()}: {problem}", failure="host", call=name)

    def attempt_failed(
        self,
        attempt: int,
        label: str,
        key_index: int | None,
        result: GenerationTurnResult,
        failure: StreamFailed | None,
        next_step: str,
    ) -> None:
        """An attempt of the chain failed (``error`` or ``timeout``): how, the provider's
        HTTP status and wait hint when a provider failure ended it, and what the chain does
        next."""
        key = f", key {key_index}" if key_index is not None else ""
        status_code = failure.status_code if failure is not None else None
        facts = [result.reason or result.status.value]
        if result.provider_error_kind is not None:
            facts.append(result.provider_error_kind)
        if status_code is not None:
            facts.append(f"HTTP {status_code}")
        if result.retry_after is not None:
            facts.append(f"retry after {result.retry_after:g} s")
        message = f": {result.error_message}" if result.error_message else ""
        self._warn(
            f"attempt {attempt} ({label}{key}) failed {result.status.value} "
            f"({', '.join(facts)}){message}; {next_step}",
            failure="attempt",
            attempt=attempt,
            label=label,
            key_index=key_index,
            status=result.status.value,
            reason=result.reason,
            kind=result.provider_error_kind,
            status_code=status_code,
            retry_after=result.retry_after,
            next_step=next_step,
        )

    def observer_failed(self, observer: object, method: str, err: Exception) -> None:
        self._warn(
            f"turn observer {type(observer).__name__}.{method} raised "
            f"{type(err).__name__}: {err}; the turn goes on",
            failure="observer",
        )
