"""The pumps' side of observation: `Observation`, one turn's observers as the pumps call them.

A turn gets an `Observation` only when something observes it — an observer passed to the run
function, or one a registered factory built for it (`observe_turn`); otherwise the pumps hold
``None`` and check it at lifecycle points only, never per chunk. The observation builds the
phase events from what the pump and the machine know, redacts their texts with the turn's
`Secrets`, and isolates the turn from its observers: one that raises is logged and skipped.
It also keeps the little a turn's observation needs between calls (the open pass, the open
tools by dispatch — the calls of a tool batch run at once and end in any order — and the
event whose effects are being carried out).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable
from collections.abc import Sequence
from typing import TYPE_CHECKING

from toolloop_fsm.event_checks import event_shapes
from toolloop_fsm.event_checks import malformation
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.observation import OBSERVED_CHUNKS
from toolloop_fsm.observation import OBSERVER_METHOD
from toolloop_fsm.observation import AttemptEnded
from toolloop_fsm.observation import AttemptStarted
from toolloop_fsm.observation import ObservedChunk
from toolloop_fsm.observation import PassEnded
from toolloop_fsm.observation import PassStarted
from toolloop_fsm.observation import PhaseEvent
from toolloop_fsm.observation import ProviderIdentity
from toolloop_fsm.observation import ToolEnded
from toolloop_fsm.observation import ToolStarted
from toolloop_fsm.observation import TurnAborted
from toolloop_fsm.observation import TurnEnded
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.observation import TurnStarted
from toolloop_fsm.observation import identify_provider
from toolloop_fsm.observation import turn_observer_factories
from toolloop_fsm.pump.records import TurnRecords
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus

if TYPE_CHECKING:
    from toolloop_fsm.effects import RunTool
    from toolloop_fsm.events import ToolFinished
    from toolloop_fsm.host import Clock
    from toolloop_fsm.turn import TurnState

#: What a pass's end is recorded as when the loop recorded nothing (the caller cancelled).
_CANCELLED = "cancelled"
#: How a pass recorded by the loop ended in failure.
_FAILED_PASS = frozenset({"error", "timeout"})
#: The fields of the chunks observers are shown, checked before they are.
_CHUNK_SHAPES = event_shapes(OBSERVED_CHUNKS)


def observe_turn(
    observer: TurnObserver | None, clock: Clock, records: TurnRecords
) -> Observation | None:
    """The observation of a turn starting now: ``observer`` and what every registered factory
    builds for it; ``None`` when nothing observes it."""
    factories = turn_observer_factories()
    if observer is None and not factories:
        return None
    observers: list[TurnObserver] = []
    for factory in factories:
        try:
            built = factory()
        except Exception as err:
            records.observer_failed(factory, "factory", err)
            continue
        if built is not None:
            observers.append(built)
    if observer is not None:
        observers.append(observer)
    if not observers:
        return None
    return Observation(observers, clock, records)


class Observation:
    """One turn's observers, called by the pumps."""

    __slots__ = (
        "_chunk_observers",
        "_observers",
        "attempt",
        "cause",
        "clock",
        "identity",
        "model",
        "pass_iteration",
        "provider",
        "records",
        "tools",
    )

    def __init__(
        self, observers: Sequence[TurnObserver], clock: Clock, records: TurnRecords
    ) -> None:
        self._observers = tuple(observers)
        self._chunk_observers = tuple(o for o in observers if getattr(o, "wants_chunks", False))
        self.clock = clock
        self.records = records
        # the attempt running (0: a `run_tool_loop` turn, or none yet)
        self.attempt = 0
        # the attempt's provider, named once per attempt
        self.provider = ""
        self.model: str | None = None
        self.identity = ProviderIdentity("")
        # the pass being read (0: none), the tools running by dispatch (made for the first),
        # and the event whose effects the pump is carrying out (it says why a running tool
        # was cancelled)
        self.pass_iteration = 0
        self.tools: dict[int, ToolStarted] | None = None
        self.cause: object = None

    @property
    def secrets(self) -> Secrets:
        return self.records.secrets

    @property
    def wants_chunks(self) -> bool:
        return bool(self._chunk_observers)

    def _clean(self, text: str | None) -> str | None:
        return None if text is None else self.records.secrets.clean(text)

    def _emit(self, event: PhaseEvent) -> None:
        method = OBSERVER_METHOD[type(event)]
        for observer in self._observers:
            try:
                getattr(observer, method)(event)
            except Exception as err:  # an observer never breaks the turn it watches
                self.records.observer_failed(observer, method, err)

    def chunk(self, chunk: ObservedChunk) -> None:
        for observer in self._chunk_observers:
            try:
                observer.chunk(chunk)
            except Exception as err:
                self.records.observer_failed(observer, "chunk", err)

    def observes(self, chunk: object) -> bool:
        """Whether ``chunk`` is one the chunk observers are shown: a text, thought or call
        chunk whose fields are what they must be (a malformed one fails the pass instead)."""
        return type(chunk) in _CHUNK_SHAPES and malformation(_CHUNK_SHAPES, chunk) is None

    # ------------------------------------------------------------------ the turn
    def for_provider(self, provider: object) -> None:
        self.identity = identify_provider(provider)
        self.provider, self.model = self.identity.name, self.identity.model

    async def watching(
        self, run: Awaitable[GenerationTurnResult], tier: str, conversation_id: str | None
    ) -> GenerationTurnResult:
        """``run``, the turn of ``tier`` (in the host's conversation ``conversation_id``),
        with its start, its end or its abort shown to the observers."""
        self.turn_started(tier, conversation_id)
        try:
            result = await run
        except BaseException as err:
            self.turn_aborted(err)
            raise
        self.turn_ended(result)
        return result

    def turn_started(self, tier: str, conversation_id: str | None = None) -> None:
        if tier == "tool_loop":
            event = TurnStarted(tier, self.clock.now(), self.provider, self.model, conversation_id)
        else:
            event = TurnStarted(tier, self.clock.now(), conversation_id=conversation_id)
        self._emit(event)

    def turn_ended(self, result: GenerationTurnResult) -> None:
        self._emit(TurnEnded(result, self.clock.now()))

    def turn_aborted(self, err: BaseException) -> None:
        cancelled = isinstance(err, asyncio.CancelledError)
        error = None if cancelled else self._clean(f"{type(err).__name__}: {err}")
        self._emit(TurnAborted(self.clock.now(), cancelled, error))

    # ------------------------------------------------------------------ attempts
    def attempt_started(
        self, attempt: int, label: str, key_index: int | None, route: str, provider: object
    ) -> None:
        self.attempt = attempt
        if provider is None:
            self.provider, self.model = "", None
            self.identity = ProviderIdentity("")
        else:
            self.for_provider(provider)
        event = AttemptStarted(
            attempt,
            label,
            key_index,
            route,
            self.clock.now(),
            self.provider or None,
            self.model,
        )
        self._emit(event)

    def attempt_ended(
        self,
        attempt: int,
        label: str,
        result: GenerationTurnResult,
        failure: StreamFailed | None,
    ) -> None:
        failed = result.status in (TurnStatus.ERROR, TurnStatus.TIMEOUT)
        self._emit(
            AttemptEnded(
                attempt,
                label,
                result.status,
                self.clock.now(),
                reason=result.reason,
                error_kind=result.provider_error_kind,
                http_status=failure.status_code if failure is not None and failed else None,
                retry_after=result.retry_after,
                error=self._clean(result.error_message),
            )
        )

    # ------------------------------------------------------------------ passes
    def pass_started(self, iteration: int) -> None:
        self.pass_iteration = iteration
        identity = self.identity
        event = PassStarted(
            self.attempt,
            iteration,
            self.provider,
            self.model,
            self.clock.now(),
            identity.operation,
            identity.server_address,
            identity.server_port,
        )
        self._emit(event)

    def pass_ended(self, turn: TurnState | None, failure: StreamFailed | None) -> None:
        """The pass being read ended (once: later calls do nothing). What the loop recorded
        of it (``turn``'s stream result and usage) says how; ``failure`` is the provider's
        failure that ended it."""
        iteration = self.pass_iteration
        if not iteration:
            return
        self.pass_iteration = 0
        outcome, error, finish = _CANCELLED, None, None
        usage = None
        if turn is not None:
            for recorded in reversed(turn.produced.stream_results or ()):
                if recorded.iteration == iteration:
                    outcome, error = recorded.outcome, recorded.error
                    finish = recorded.finish.value if recorded.finish is not None else None
                    break
            for entry in reversed(turn.produced.usage or ()):
                if entry.iteration == iteration:
                    usage = entry
                    break
            if (
                usage is None
                and turn.current_pass.usage is not None
                and turn.iterations == iteration
            ):
                usage = turn.current_pass.usage
        event = PassEnded(
            self.attempt,
            iteration,
            outcome,
            self.clock.now(),
            failed=outcome in _FAILED_PASS,
            input_tokens=usage.input_tokens if usage is not None else None,
            output_tokens=usage.output_tokens if usage is not None else None,
            usage_estimated=usage.estimated if usage is not None else False,
            finish=finish,
            error_kind=failure.kind if failure is not None else None,
            http_status=failure.status_code if failure is not None else None,
            retry_after=failure.retry_after if failure is not None else None,
            error=self._clean(failure.message if failure is not None else error),
        )
        self._emit(event)

    # ------------------------------------------------------------------ tools
    def tool_started(self, effect: RunTool) -> None:
        """Dispatch ``effect.dispatch`` began; it stays open until it ends, whatever its
        siblings in the batch do."""
        try:
            arguments = copy.deepcopy(dict(effect.arguments))
        except Exception:  # arguments come from JSON; a host-built oddity is shallow-copied
            arguments = dict(effect.arguments)
        event = ToolStarted(
            self.attempt,
            effect.dispatch,
            effect.name,
            arguments,
            effect.call_id,
            self.clock.now(),
        )
        tools = self.tools
        if tools is None:
            tools = self.tools = {}
        tools[effect.dispatch] = event
        self._emit(event)

    def tool_finished(self, finished: ToolFinished) -> None:
        """Dispatch ``finished.dispatch`` returned (or raised): its outcome, as the loop
        takes it."""
        error = finished.error
        if error is None and finished.kind is ToolOutcomeKind.FAILED:
            error = finished.message
        self._end_tool(finished.dispatch, finished.kind.value, error)

    def tool_cancelled(self, dispatch: int) -> None:
        """The machine cancelled dispatch ``dispatch``: its deadline expired, a stop, or a
        failure elsewhere (the event whose effects are being carried out says which)."""
        cause = self.cause
        if isinstance(cause, DeadlineExpired) and cause.kind is DeadlineKind.TOOL:
            self._end_tool(dispatch, "timeout", "the tool's deadline expired")
        elif isinstance(cause, StopRequested):
            self._end_tool(dispatch, "cancelled", "the user stopped the turn")
        else:
            what = type(cause).__name__ if cause is not None else "the turn ending"
            self._end_tool(dispatch, "cancelled", f"cancelled on {what}")

    def turn_over(self) -> None:
        """The turn is over (or its caller cancelled it): every tool still open is cancelled,
        in dispatch order."""
        tools = self.tools
        if tools:
            for dispatch in sorted(tools):
                self._end_tool(dispatch, "cancelled", "the turn ended while it ran")

    def _end_tool(self, dispatch: int, outcome: str, error: str | None) -> None:
        tools = self.tools
        tool = tools.pop(dispatch, None) if tools else None
        if tool is None:
            return
        event = ToolEnded(
            tool.attempt,
            dispatch,
            tool.name,
            outcome,
            self.clock.now(),
            self._clean(error),
            tool.call_id,
        )
        self._emit(event)
