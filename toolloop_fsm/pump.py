"""The event pump: the async shell around the sans-IO machines.

`EventPump` carries out a machine's effects — reading the provider stream, tool tasks,
deadline timers on the injected `Clock`, deliveries to the host's `Channel` — and turns
what happens into events, fed to the machine one at a time. Structured concurrency: every
task the pump starts is its child, and the run does not return before its children are
done; cancelling the caller cancels the stream, the tools and the deliveries and
propagates. (The children are tracked by hand rather than by an `asyncio.TaskGroup`: a turn
parked on its provider has no child at all, and a group's bookkeeping was a fifth of the
memory of a waiting turn.) A stop is the first-party `StopRequested` event, never a
swallowed `CancelledError`.

The per-chunk path has no hops: the turn's own task reads the stream and hands each chunk
to the machine's chunk handlers directly, checking the host's signals between chunks. Every
event source (the read, tool tasks, timers, the delivery worker) feeds the machine
synchronously on the loop's one thread, so the machine never sees two events at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import inspect
import math
import re
import types
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from functools import partial
from typing import Any

import attrs

from toolloop_fsm.attempts import AdmissionRequest, Attempt, KeyBook, SharedRoute
from toolloop_fsm.effects import (
    ArmDeadline,
    AskAdmission,
    CancelStream,
    CancelTool,
    ClearDeadline,
    Deliver,
    Effect,
    Finish,
    PostNotice,
    QueueStopResponse,
    RunTool,
    StartAttempt,
    StartStream,
    SupersedeAttempt,
    UpdateKeyHealth,
)
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import (
    CHUNK_TYPES,
    AdmissionDecided,
    AttemptFinished,
    DeadlineExpired,
    DeadlineKind,
    DeliveryFailed,
    DeliveryRecorded,
    FollowUpArrived,
    StopRequested,
    StreamEnded,
    StreamFailed,
    ToolFinished,
    ToolOutcomeKind,
    UnreachableReported,
)
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import (
    LOOP_CLOCK,
    Channel,
    Clock,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
    TurnRequest,
    TurnSignals,
)
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy, TurnPolicy
from toolloop_fsm.providers._secrecy import fragment_pattern, redact
from toolloop_fsm.providers.base import Provider, ProviderError, ProviderRequest
from toolloop_fsm.result import GenerationTurnResult, TraceStep, TurnStatus, converter
from toolloop_fsm.states.build_result import count_late_deliveries
from toolloop_fsm.turn import LedgerEntry


class _Unsignalled(TurnSignals):
    """Stands in when a turn is run without signals: nothing can be requested of it."""

    def request_stop(self, stop_message: str | None = None) -> None:
        raise RuntimeError("this turn was started without TurnSignals; pass signals= to stop it")

    def follow_up(self) -> None:
        raise RuntimeError("this turn was started without TurnSignals; pass signals=")

    def report_unreachable(self) -> None:
        raise RuntimeError("this turn was started without TurnSignals; pass signals=")


_NO_SIGNALS = _Unsignalled()


class EventPump:
    """Runs one `ToolLoopMachine` against a provider, tools and a channel."""

    __slots__ = (
        "_abandoned",
        "_children",
        "_deliveries",
        "_delivery_task",
        "_depth",
        "_failure",
        "_finished",
        "_follow_ups_seen",
        "_host_calls",
        "_host_exception",
        "_host_task",
        "_interrupted",
        "_iteration",
        "_last_activity",
        "_last_chunk",
        "_late_confirmed",
        "_main",
        "_outcomes",
        "_pending_result",
        "_pending_stream",
        "_reading",
        "_result",
        "_signals_dirty",
        "_stop_fed",
        "_stream_armed_at",
        "_stream_generation",
        "_timers",
        "_tool_dispatch",
        "_tool_grace",
        "_tool_name",
        "_tool_task",
        "_wake",
        "channel",
        "clock",
        "consume_stop",
        "machine",
        "on_effect",
        "policy",
        "provider",
        "registry",
        "signals",
    )

    def __init__(
        self,
        machine: ToolLoopMachine,
        provider: Provider,
        channel: Channel,
        *,
        signals: TurnSignals | None = None,
        clock: Clock | None = None,
        on_effect: Callable[[Effect], None] | None = None,
        consume_stop: bool = True,
    ) -> None:
        self.machine = machine
        # the turn that honours a stop consumes it (the outer tier does so for its attempts)
        self.consume_stop = consume_stop
        self.provider = provider
        self.channel = channel
        self.registry = machine.tools
        # without signals nothing can be requested: no listener, no checks
        self.signals = signals if signals is not None else _NO_SIGNALS
        self.clock: Clock = clock if clock is not None else LOOP_CLOCK
        self.on_effect = on_effect
        self._children: list[asyncio.Task[None]] | None = None  # made on the first spawn
        # how the run ended (plain state: read by the turn's own task when it wakes)
        self._finished = False
        self._result: GenerationTurnResult | None = None
        self._failure: BaseException | None = None
        # the stream is read by the turn's own task (no task per pass): a pass waiting to
        # be read, whether it is being read, and a wake-up for the task between passes
        self._main: asyncio.Task[Any] | None = None
        self._pending_stream: tuple[ProviderRequest, int] | None = None
        self._reading = False
        self._interrupted = False
        self._wake: asyncio.Future[None] | None = None
        self._stream_generation = 0
        self._tool_task: asyncio.Task[None] | None = None
        self._tool_dispatch = 0
        self._iteration = 0
        # [handle, effect] per armed deadline: rarely more than two, so a list of pairs
        self._timers: list[list[Any]] = []
        self._last_activity = 0.0
        self._last_chunk: float | None = None
        self._stream_armed_at = 0.0
        self._signals_dirty = False
        self._stop_fed = False
        self._follow_ups_seen = 0
        self._deliveries: list[Deliver] = []
        self._delivery_task: asyncio.Task[None] | None = None
        self._host_calls: list[PostNotice | QueueStopResponse] = []
        self._outcomes: list[DeliveryRecorded | DeliveryFailed] = []
        self._depth = 0
        self._host_task: asyncio.Task[None] | None = None
        self._host_exception: BaseException | None = None
        self.policy = machine.policy
        self._tool_name = ""
        self._tool_grace: Any = None
        # code that ignored its cancellation past the grace: named, never awaited again
        self._abandoned: list[str] = []
        # deliveries the channel confirmed after the machine had already finished
        self._late_confirmed: list[int] = []
        # the result waits for the host's notices and stop message still on their way
        self._pending_result: GenerationTurnResult | None = None

    # ------------------------------------------------------------------ running
    async def run(
        self,
        request: TurnRequest,
        *,
        continuation_style: bool | None = None,
        hold_timeout_notice: bool = False,
        ledger: Mapping[str, LedgerEntry] | None = None,
        expression_delivered: bool = False,
    ) -> GenerationTurnResult:
        """Run the turn to its terminal state and return its result."""
        self._main = asyncio.current_task()
        if continuation_style is None:
            continuation_style = bool(getattr(self.provider, "continuation_style", False))
        self._follow_ups_seen = self.signals.follow_ups
        listening = self.signals is not _NO_SIGNALS
        if listening:
            self.signals.add_listener(self._signal_arrived)
        failure: BaseException | None = None
        cancelled = True
        try:
            self._execute(
                self.machine.start(
                    request,
                    continuation_style=continuation_style,
                    hold_timeout_notice=hold_timeout_notice,
                    ledger=ledger,
                    expression_delivered=expression_delivered,
                )
            )
            self._signals_dirty = True
            self._take_signals()
            # The turn's own task: read each pass's stream as the machine starts it, and
            # wait between passes. A deadline, a stop or a failure elsewhere interrupts a
            # read by cancelling this task; that cancellation is taken back here
            # (`uncancel`), while the caller's own cancellation propagates as usual. (Inline
            # rather than a method: one frame less for every turn waiting on its provider.)
            main = self._main
            assert main is not None
            while not self._finished:
                try:
                    pending = self._pending_stream
                    if pending is not None:
                        self._pending_stream = None
                        await self._read_stream(*pending)
                        if self._interrupted:  # a provider swallowed the interruption
                            self._interrupted = False
                            main.uncancel()
                    else:
                        self._wake = asyncio.get_running_loop().create_future()
                        await self._wake
                except asyncio.CancelledError:
                    if not self._interrupted:
                        raise
                    self._interrupted = False
                    if main.uncancel() > 0:
                        raise
                finally:
                    self._wake = None
            if self._failure is not None:
                raise self._failure
            assert self._result is not None
            result = self._result
            cancelled = False
            if self._stop_fed and self.consume_stop:
                self.signals.consume_stop()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            cancelled = False
            failure = err
        finally:
            self._wind_down()
            try:
                await self._join_children(cancel=cancelled)
            finally:
                if listening:
                    self.signals.remove_listener(self._signal_arrived)
                self._cancel_timers()
        if failure is not None:
            raise failure
        return self._with_late_facts(result)

    def _with_late_facts(self, result: GenerationTurnResult) -> GenerationTurnResult:
        """Add what happened after the machine finished but before the run returned: a
        delivery the channel confirmed (it is in the result, whatever the interleaving, and
        read by the user) and the calls abandoned for ignoring their cancellation."""
        if self._late_confirmed:
            # delivered like any other: the final and undelivered text count it too
            result = count_late_deliveries(self.machine.turn, result, self._late_confirmed)
        changes: dict[str, Any] = {}
        if self._abandoned:
            changes["abandoned_calls"] = (*result.abandoned_calls, *self._abandoned)
        return attrs.evolve(result, **changes) if changes else result

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Start a child task; ``name`` says what it runs (an abandoned child is named)."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        children = self._children
        if children is None:
            self._children = [task]
        else:
            children[:] = [child for child in children if not child.done()]
            children.append(task)
        return task

    async def _join_children(self, *, cancel: bool) -> None:
        """Wait for every child (the host's notices and stop message may still be on their
        way); when the caller was cancelled, cancel them first. The wait is bounded: a child
        still running after the host-call budget (or, once cancelled, after the grace) is
        abandoned and named. A child's own failure — a bug, since children turn everything
        into events — is raised."""
        children = self._children
        if not children:
            return
        pending = [child for child in children if not child.done()]
        if cancel:
            for child in pending:
                child.cancel()
        policy = self.policy
        if pending:
            # a cancelled child has the grace to stop; one still working (a notice on its
            # way) has its own host-call budget first
            budget = policy.cancel_grace
            if any(child.cancelling() == 0 for child in pending):
                budget += policy.host_call_timeout
            for straggler in await wait_bounded(self.clock, pending, budget):
                straggler.cancel()
                self._abandon(straggler, straggler.get_name())
        for child in children:
            if child.done() and not child.cancelled() and child.exception() is not None:
                raise child.exception()  # type: ignore[misc]

    def _abandon(self, task: asyncio.Task[Any], name: str) -> None:
        """Give up on a child that ignored its cancellation: it is named in the result and
        never awaited again."""
        children = self._children
        if children is not None and task in children:
            children.remove(task)
            self._abandoned.append(name)

    def _abandon_unless_done(self, task: asyncio.Task[Any], name: str) -> None:
        if not task.done():
            self._abandon(task, name)

    def _wind_down(self) -> None:
        """The turn is over (or the caller was cancelled): stop the stream and the tool,
        abandon deliveries still in flight, disarm every deadline."""
        self._stream_generation += 1
        self._pending_stream = None
        for task in (self._tool_task, self._delivery_task):
            if task is not None and not task.done():
                task.cancel()
        self._deliveries.clear()
        self._cancel_timers()
        self._finished = True

    def _cancel_timers(self) -> None:
        for handle, _ in self._timers:
            handle.cancel()
        self._timers.clear()
        if self._tool_grace is not None:
            self._tool_grace.cancel()
            self._tool_grace = None

    # ------------------------------------------------------------------ feeding
    def _feed(self, event: Any) -> None:
        """Feed one event and carry out its effects; a failure ends the run with it."""
        if self._finished or self.machine.is_finished:
            if type(event) is DeliveryRecorded and event.seq is not None:
                self._late_confirmed.append(event.seq)  # confirmed: it belongs in the result
            return
        if self._signals_dirty and type(event) is not DeliveryRecorded:
            # a signal that arrived before this event is taken first, in the state it met
            # (a delivery the channel already confirmed is recorded first: it happened)
            self._take_signals()
            if self._finished or self.machine.is_finished:
                return
        try:
            effects = self.machine.feed(event)
        except BaseException as err:  # the machine rejected the event: surface it to run()
            self._fail(err)
            return
        self._execute(effects)

    def _fail(self, err: BaseException) -> None:
        if not self._finished:
            self._finished = True
            self._failure = err
        self._interrupt_read()
        self._wake_up()

    def _execute(self, effects: Iterable[Effect]) -> None:
        self._depth += 1
        try:
            self._carry_out(effects)
        finally:
            self._depth -= 1
        if self._depth == 0 and self._outcomes:
            # deliveries that completed at once are reported after the batch that issued
            # them, so every effect of a step is carried out before the next event
            outcomes = self._outcomes
            while outcomes:
                self._feed(outcomes.pop(0))

    def _carry_out(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if self.on_effect is not None:
                self.on_effect(effect)
            kind = type(effect)
            if kind is Deliver:
                self._deliver(effect)  # type: ignore[arg-type]
            elif kind is ArmDeadline:
                self._arm(effect)  # type: ignore[arg-type]
            elif kind is ClearDeadline:
                entry = self._timer(effect.token)  # type: ignore[union-attr]
                if entry is not None:
                    entry[0].cancel()
                    self._timers.remove(entry)
            elif kind is StartStream:
                self._start_stream(effect)  # type: ignore[arg-type]
            elif kind is CancelStream:
                self._cancel_stream()
            elif kind is RunTool:
                self._run_tool(effect)  # type: ignore[arg-type]
            elif kind is CancelTool:
                self._cancel_tool()
            elif kind is PostNotice or kind is QueueStopResponse:
                self._host_calls.append(effect)  # type: ignore[arg-type]
                self._ensure_host_worker()
            elif kind is Finish:
                self._finish(effect)  # type: ignore[arg-type]

    def _finish(self, effect: Finish) -> None:
        if self._finished:
            return
        self._stream_generation += 1
        self._deliveries.clear()
        host_task = self._host_task
        if host_task is not None and not host_task.done():
            # notices and the stop message are owed to the host: they finish first (each
            # bounded by the host-call budget), then the result is settled
            self._pending_result = effect.result
            return
        self._settle_result(effect.result)

    def _settle_result(self, result: GenerationTurnResult) -> None:
        if self._finished:
            return
        if self._host_exception is not None:
            result = attrs.evolve(result, exception=self._host_exception)
        self._finished = True
        self._result = result
        self._interrupt_read()
        self._wake_up()

    # ------------------------------------------------------------------ signals
    def _signal_arrived(self) -> None:
        self._signals_dirty = True
        asyncio.get_running_loop().call_soon(self._take_signals)

    def _take_signals(self) -> None:
        if not self._signals_dirty:
            return
        self._signals_dirty = False
        signals = self.signals
        if signals.stop_requested and not self._stop_fed:
            if self._finished or self.machine.is_finished:
                return  # too late for this turn: the stop stays for the next one
            self._stop_fed = True
            self._feed(StopRequested(signals.stop_message))
        if signals.follow_ups > self._follow_ups_seen:
            self._follow_ups_seen = signals.follow_ups
            self._feed(FollowUpArrived())

    # ------------------------------------------------------------------ the provider stream
    def _wake_up(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _interrupt_read(self) -> None:
        """Stop a read in progress in the turn's task (from a timer, a tool, a signal)."""
        main = self._main
        if self._reading and not self._interrupted and main is not asyncio.current_task():
            assert main is not None
            self._interrupted = True
            main.cancel()

    def _start_stream(self, effect: StartStream) -> None:
        self._stream_generation += 1
        self._iteration = effect.iteration
        self._last_activity = self.clock.now()
        self._pending_stream = (effect.request, self._stream_generation)
        self._wake_up()

    def _cancel_stream(self) -> None:
        self._stream_generation += 1
        self._pending_stream = None
        self._interrupt_read()

    async def _read_stream(self, request: ProviderRequest, generation: int) -> None:
        if generation != self._stream_generation:
            return  # cancelled before it was read
        stream = self.provider.stream(request)
        self._reading = True
        machine = self.machine
        feed = machine.feed
        turn = machine.turn
        # the fast path, called from here without the hop through feed(): the handlers of
        # the current state (kept current by the machine), and the effects they leave
        handler_for = machine.chunk_handlers.get
        execute = self._execute
        now = self.clock.now
        try:
            async for chunk in stream:
                self._last_chunk = now()
                try:
                    handler = handler_for(chunk.__class__)
                    if handler is not None:
                        handler(turn, chunk)
                        effects = machine.take_effects() if turn.effects else None
                    else:
                        effects = feed(chunk)
                except BaseException as err:
                    if type(chunk) not in CHUNK_TYPES:  # a provider bug: a failed pass
                        self._feed(
                            StreamFailed(
                                f"the provider yielded {type(chunk).__name__}, not a chunk event",
                                kind="protocol",
                                retryable=True,
                            )
                        )
                    elif isinstance(err, InvalidEvent | ValueError | TypeError):
                        # a chunk the machine refuses (a malformed field, non-finite usage)
                        # is the provider's protocol failure, not a crash of the turn
                        self._feed(
                            StreamFailed(
                                f"the provider sent a malformed {type(chunk).__name__}: {err}",
                                kind="protocol",
                                retryable=True,
                            )
                        )
                    else:
                        self._fail(err)
                    return
                if effects:
                    execute(effects)
                    if generation != self._stream_generation:
                        return
                if self._signals_dirty:
                    self._take_signals()
                    if generation != self._stream_generation:
                        return
        except ProviderError as err:
            if generation == self._stream_generation:
                self._feed(
                    StreamFailed(
                        err.message,
                        kind=err.kind,
                        retryable=err.retryable,
                        status_code=err.status_code,
                        retry_after=err.retry_after,
                    )
                )
            return
        except Exception as err:  # a provider bug is a failed pass, not a crashed turn
            if generation == self._stream_generation:
                self._feed(
                    StreamFailed(
                        f"the provider raised {type(err).__name__}: {err}",
                        kind="provider_error",
                        retryable=True,
                    )
                )
            return
        finally:
            self._reading = False
            await _close_stream(stream)
        if generation == self._stream_generation:
            self._feed(StreamEnded())

    # ------------------------------------------------------------------ tools
    def _run_tool(self, effect: RunTool) -> None:
        self._tool_dispatch = effect.dispatch
        self._tool_name = f"tool {effect.name} (dispatch {effect.dispatch})"
        self._tool_task = self._spawn(self._call_tool(effect), self._tool_name)

    def _cancel_tool(self) -> None:
        self._tool_dispatch = -1
        task = self._tool_task
        if task is not None and not task.done():
            task.cancel()
            # a tool that ignores its cancellation is abandoned after the grace
            self._tool_grace = self.clock.call_later(
                self.policy.cancel_grace, self._abandon_unless_done, task, self._tool_name
            )

    async def _call_tool(self, effect: RunTool) -> None:
        tool = self.registry.get(effect.name)
        event: ToolFinished
        if tool is None:  # the machine only dispatches registered tools; keep it a value
            event = ToolFinished(effect.dispatch, ToolOutcomeKind.RAISED, error="unknown tool")
        else:
            try:
                arguments = copy.deepcopy(dict(effect.arguments))
            except Exception:  # arguments come from JSON; a host-built oddity is shallow-copied
                arguments = dict(effect.arguments)
            ctx = ToolContext(
                effect.name,
                effect.dispatch,
                self._iteration,
                self.clock,
                self.machine.turn.disabled_enrichment_kinds,
            )
            try:
                event = await _call_handler(tool, effect.dispatch, arguments, ctx)
            except (KeyboardInterrupt, SystemExit) as err:
                # the process is going down: end the run with it, children cancelled first
                self._fail(err)
                return
        if effect.dispatch == self._tool_dispatch:
            self._feed(event)

    # ------------------------------------------------------------------ deadlines
    def _arm(self, effect: ArmDeadline) -> None:
        now = self.clock.now()
        seconds = effect.seconds
        if effect.first_seconds is not None:
            # the pass's stream deadline: first wake at the earliest of its windows
            seconds = min(seconds, effect.first_seconds)
            if effect.total_seconds is not None:
                seconds = min(seconds, effect.total_seconds)
            self._stream_armed_at = now
            self._last_chunk = None
        if effect.rolling:
            self._last_activity = now
        handle = self.clock.call_later(seconds, self._deadline_fired, effect)
        self._timers.append([handle, effect])

    def _timer(self, token: int) -> list[Any] | None:
        for entry in self._timers:
            if entry[1].token == token:
                return entry
        return None

    def _deadline_fired(self, effect: ArmDeadline) -> None:
        entry = self._timer(effect.token)
        if entry is None:
            return
        kind = effect.kind
        if effect.rolling:
            now = self.clock.now()
            total = effect.total_seconds
            pass_due = self._stream_armed_at + total if total is not None else math.inf
            if effect.first_seconds is not None and pass_due - now <= 1e-9:
                # the pass's total budget is spent, however steadily it streams
                kind = DeadlineKind.PASS_DURATION
            else:
                if effect.first_seconds is not None and self._last_chunk is None:
                    kind = DeadlineKind.FIRST_TOKEN  # no chunk yet in this pass
                    due = self._stream_armed_at + effect.first_seconds
                    # wake again within one inactivity window, so that a first chunk
                    # arriving late is followed by the inactivity budget, not the first due
                    wake = min(due, now + effect.seconds)
                else:
                    if effect.first_seconds is not None:
                        kind = DeadlineKind.INACTIVITY
                    # a rolling deadline counts from the last chunk or recorded delivery
                    # (chunks stamp _last_chunk only: one store per chunk on the hot path)
                    last = self._last_activity
                    if self._last_chunk is not None and self._last_chunk > last:
                        last = self._last_chunk
                    due = wake = last + effect.seconds
                if due - now > 1e-9:
                    wake = min(wake, pass_due)
                    entry[0] = self.clock.call_later(wake - now, self._deadline_fired, effect)
                    return
        self._timers.remove(entry)
        self._feed(DeadlineExpired(kind, effect.token))

    # ------------------------------------------------------------------ deliveries
    def _send(self, effect: Deliver) -> Coroutine[Any, Any, None]:
        if effect.expression is not None:
            return self.channel.send_expression(effect.expression)
        return self.channel.send_text(effect.text or "")

    def _deliver(self, effect: Deliver) -> None:
        """Start a delivery eagerly: a channel that does not need to wait (a buffer, a
        queue) completes here, without a task; one that waits is finished by a task, and
        later deliveries queue behind it, in order."""
        task = self._delivery_task
        if (task is not None and not task.done()) or self._deliveries:
            self._deliveries.append(effect)
            return
        coroutine = self._send(effect)
        try:
            waiting_on = coroutine.send(None)
        except StopIteration:
            self._last_activity = self.clock.now()
            self._outcomes.append(DeliveryRecorded(effect.seq))
            return
        except (KeyboardInterrupt, SystemExit) as err:
            self._fail(err)
            return
        except BaseException as err:  # any failure of host code is the turn's `host_error`
            self._host_exception = err
            self._outcomes.append(DeliveryFailed(effect.seq, f"{type(err).__name__}: {err}"))
            return
        self._delivery_task = self._spawn(
            self._deliver_in_order(effect, _resume(coroutine, waiting_on)),
            "channel.send_expression" if effect.expression is not None else "channel.send_text",
        )

    async def _deliver_in_order(
        self, first: Deliver, started: Awaitable[None] | None = None
    ) -> None:
        """Deliver in order, each send bounded by the host-call budget: a send that does not
        return ends the turn ``error`` (``host_timeout``), keeping every confirmed delivery;
        one that also ignores its cancellation is abandoned after the grace."""
        deliveries = self._deliveries
        effect: Deliver | None = first
        while effect is not None:
            seq = effect.seq
            name = "channel.send_expression" if effect.expression is not None else (
                "channel.send_text"
            )  # fmt: skip
            task = asyncio.current_task()
            if task is not None:
                task.set_name(name)  # abandoned at the end, it is named by its call
            guard = _HostCallGuard(
                self, name, on_abandon=partial(self._delivery_abandoned, seq, name)
            )
            try:
                await (started if started is not None else self._send(effect))
            except asyncio.CancelledError:
                if not guard.expired:
                    raise  # the turn is over, or its caller was cancelled
                guard.taken_back()
                self._deliveries.clear()
                self._feed(DeliveryFailed(seq, self._overdue_message(name), timed_out=True))
                return
            except (KeyboardInterrupt, SystemExit) as err:
                self._fail(err)
                return
            except BaseException as err:
                self._host_exception = err
                self._feed(DeliveryFailed(seq, f"{type(err).__name__}: {err}"))
                return
            finally:
                guard.disarm()
            if guard.expired:
                guard.taken_back()  # it returned after all, before the grace ran out
            started = None
            self._last_activity = self.clock.now()
            self._feed(DeliveryRecorded(seq))
            effect = deliveries.pop(0) if deliveries else None

    def _delivery_abandoned(self, seq: int, name: str) -> None:
        self._feed(DeliveryFailed(seq, self._overdue_message(name), timed_out=True))

    def _overdue_message(self, name: str) -> str:
        return f"{name} did not return within {self.policy.host_call_timeout:g} s"

    def _ensure_host_worker(self) -> None:
        if self._host_task is None or self._host_task.done():
            self._host_task = self._spawn(self._call_host_in_order(), "channel notices")

    async def _call_host_in_order(self) -> None:
        """Post notices and the stop message in order, each bounded by the host-call budget.
        A call that fails or does not return is a ``host_error``/``host_timeout`` while the
        turn runs; after it, it is only named (a late notice cannot change how it ended)."""
        channel = self.channel
        calls = self._host_calls
        me = asyncio.current_task()
        try:
            while calls and self._host_task is me:
                effect = calls.pop(0)
                if isinstance(effect, PostNotice):
                    name = "channel.send_notice"
                    call: Awaitable[None] = channel.send_notice(effect.notice)
                else:
                    name = "channel.queue_front"
                    call = channel.queue_front(effect.stop_message)
                if me is not None:
                    me.set_name(name)  # a worker abandoned at the end is named by its call
                guard = _HostCallGuard(
                    self, name, on_abandon=partial(self._host_worker_abandoned, name)
                )
                failure: DeliveryFailed | None = None
                try:
                    await call
                except asyncio.CancelledError:
                    if not guard.expired:
                        raise
                    guard.taken_back()
                    failure = DeliveryFailed(None, self._overdue_message(name), timed_out=True)
                except (KeyboardInterrupt, SystemExit) as err:
                    self._fail(err)
                    return
                except BaseException as err:
                    self._host_exception = err
                    failure = DeliveryFailed(None, f"{type(err).__name__}: {err}")
                finally:
                    guard.disarm()
                if guard.expired and failure is None:
                    guard.taken_back()
                if failure is not None and not self.machine.is_finished:
                    self._feed(failure)
        finally:
            if self._host_task is me:
                self._host_calls_done()

    def _host_worker_abandoned(self, name: str) -> None:
        """The host call in progress ignored its cancellation: it failed like one that did
        not return, and the worker carries on without it."""
        self._host_task = None
        if not self.machine.is_finished:
            self._feed(DeliveryFailed(None, self._overdue_message(name), timed_out=True))
        if self._host_calls:
            self._ensure_host_worker()
        else:
            self._host_calls_done()

    def _host_calls_done(self) -> None:
        pending = self._pending_result
        if pending is not None and not self._host_calls:
            self._pending_result = None
            self._settle_result(pending)


class _HostCallGuard:
    """Bounds one call into host code running in the current task: after the policy's
    ``host_call_timeout`` the task is cancelled (`expired`); if the host code ignores that
    for ``cancel_grace``, the task is abandoned — named, never awaited again — and
    ``on_abandon`` runs in its place."""

    __slots__ = ("_handle", "_name", "_on_abandon", "_pump", "_task", "expired")

    def __init__(
        self, pump: EventPump, name: str, *, on_abandon: Callable[[], None] | None = None
    ) -> None:
        self._pump = pump
        self._name = name
        self._on_abandon = on_abandon
        self._task = asyncio.current_task()
        self.expired = False
        self._handle: Any = pump.clock.call_later(pump.policy.host_call_timeout, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._handle = self._pump.clock.call_later(self._pump.policy.cancel_grace, self._give_up)
        if self._task is not None:
            self._task.cancel()

    def _give_up(self) -> None:
        self._handle = None
        task = self._task
        if task is not None and not task.done():
            self._pump._abandon(task, self._name)
            if self._on_abandon is not None:
                self._on_abandon()

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def taken_back(self) -> None:
        """The cancellation this guard sent was absorbed: take it back from the task."""
        if self._task is not None:
            self._task.uncancel()


async def wait_bounded(
    clock: Clock, tasks: Iterable[asyncio.Task[Any]], seconds: float
) -> list[asyncio.Task[Any]]:
    """Wait for ``tasks`` at most ``seconds`` on ``clock``; returns those still pending."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    if not pending:
        return []
    expired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handle = clock.call_later(seconds, _resolve, expired)
    try:
        while pending and not expired.done():
            waits: set[asyncio.Future[Any]] = {*pending, expired}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            pending.difference_update(done)
    finally:
        handle.cancel()
        if not expired.done():
            expired.cancel()
    return [task for task in tasks if not task.done()]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@types.coroutine
def _resume(coroutine: Coroutine[Any, Any, None], waiting_on: Any) -> Generator[Any, Any, None]:
    """Go on awaiting a coroutine that was started by hand and suspended on ``waiting_on``:
    what `yield from` does, for a coroutine whose first step already ran."""
    value = waiting_on
    while True:
        try:
            sent = yield value
        except GeneratorExit:
            coroutine.close()
            raise
        except BaseException as exc:  # cancellation and the like go to the coroutine
            try:
                value = coroutine.throw(exc)
            except StopIteration:
                return
        else:
            try:
                value = coroutine.send(sent)
            except StopIteration:
                return


async def _call_handler(
    tool: Tool, dispatch: int, arguments: dict[str, Any], ctx: ToolContext
) -> ToolFinished:
    """Run a tool handler on its own copy of the arguments; whatever it does becomes a
    `ToolFinished` value — any exception, `BaseException` subclasses and `GeneratorExit`
    included — except cancellation and the process going down, which propagate."""
    try:
        result = await tool.handler(arguments, ctx)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        return ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=f"{type(err).__name__}: {err}")
    if not isinstance(result, ToolResult):
        return ToolFinished(
            dispatch,
            ToolOutcomeKind.RAISED,
            error=f"the handler returned {type(result).__name__}, not ToolResult",
        )
    return ToolFinished(
        dispatch,
        ToolOutcomeKind.SUCCEEDED if result.success else ToolOutcomeKind.FAILED,
        data=result.data,
        message=result.message,
        end_turn=result.end_turn,
        delivered=result.delivered,
        expression=result.expression,
        context_restart=result.context_restart,
        error=None if result.success else (result.message or "the tool reported a failure"),
    )


async def _close_stream(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        # closing an async generator that is still running elsewhere raises RuntimeError
        with contextlib.suppress(RuntimeError):
            await aclose()


async def run_tool_loop(
    provider: Provider,
    tools: ToolRegistry | Iterable[Tool],
    channel: Channel,
    request: TurnRequest,
    *,
    policy: LoopPolicy | None = None,
    signals: TurnSignals | None = None,
    clock: Clock | None = None,
    continuation_style: bool | None = None,
    on_step: Callable[[TraceStep], None] | None = None,
) -> GenerationTurnResult:
    """Run one tool-loop turn (one attempt) and return its result.

    Cancelling the task that awaits this cancels the provider stream and any running tool
    and propagates `CancelledError`; an outer `asyncio.timeout` raises `TimeoutError`.
    """
    machine = ToolLoopMachine(policy, tools=tools, on_step=on_step)
    pump = EventPump(machine, provider, channel, signals=signals, clock=clock)
    return await pump.run(request, continuation_style=continuation_style)


class GenerationPump:
    """Runs a `GenerationTurnMachine`: each `StartAttempt` becomes an inner `EventPump` run on
    the attempt's provider; admission, notices and key health go to the host."""

    def __init__(
        self,
        machine: GenerationTurnMachine,
        attempts: Sequence[Attempt],
        tools: ToolRegistry,
        channel: Channel,
        *,
        shared_route: SharedRoute | None = None,
        signals: TurnSignals | None = None,
        clock: Clock | None = None,
        key_book: KeyBook | None = None,
        on_attempt_step: Callable[[int, TraceStep], None] | None = None,
    ) -> None:
        self.machine = machine
        self.attempts = list(attempts)
        self.shared = list(shared_route.attempts) if shared_route is not None else []
        self.shared_route = shared_route
        self.tools = tools
        self.channel = channel
        self.signals = signals if signals is not None else TurnSignals()
        self.clock: Clock = clock if clock is not None else LOOP_CLOCK
        self.key_book: KeyBook = key_book if key_book is not None else {}
        self.on_attempt_step = on_attempt_step
        self._follow_ups_seen = 0
        self._stop_honoured = False
        self._abandoned: list[str] = []
        self._keys = [key for attempt in (*self.attempts, *self.shared) for key in attempt.keys]
        self._leak = fragment_pattern(self._keys)  # finds any piece of a key, in one pass

    async def run(self, request: TurnRequest) -> GenerationTurnResult:
        self._follow_ups_seen = self.signals.follow_ups
        pending = collections.deque(
            self.machine.start(request, health=self.key_book, now=self.clock.now())
        )
        while pending:
            effect = pending.popleft()
            if isinstance(effect, Finish):
                if self._stop_honoured or effect.result.status is TurnStatus.STOPPED_BY_USER:
                    self.signals.consume_stop()  # the turn that honours a stop consumes it
                result = effect.result
                abandoned = [
                    *(name for attempt in self.machine.generation.results for name in
                      attempt.abandoned_calls),
                    *self._abandoned,
                ]  # fmt: skip
                if abandoned:
                    result = attrs.evolve(result, abandoned_calls=tuple(abandoned))
                return self._redacted(result)
            pending.extend(await self._carry_out(effect))
        raise RuntimeError("the generation turn stopped without a result")

    async def _carry_out(self, effect: Effect) -> list[Effect]:
        if isinstance(effect, StartAttempt):
            return await self._run_attempt(effect)
        if isinstance(effect, AskAdmission):
            return await self._ask_admission(effect)
        if isinstance(effect, PostNotice):  # a notice the host cannot show ends nothing
            await self._call_host(self.channel.send_notice(effect.notice), "channel.send_notice")
            return []
        if isinstance(effect, SupersedeAttempt):
            mark = getattr(self.channel, "attempt_superseded", None)
            if mark is not None:
                await self._call_host(
                    mark(effect.attempt, effect.label, effect.delivered_text),
                    "channel.attempt_superseded",
                )
            return []
        if isinstance(effect, UpdateKeyHealth):
            self.key_book[(effect.label, effect.key_index)] = effect.health
            return []
        if isinstance(effect, QueueStopResponse):
            await self._call_host(
                self.channel.queue_front(effect.stop_message), "channel.queue_front"
            )
            return []
        raise TypeError(f"the generation pump cannot carry out {type(effect).__name__}")

    async def _call_host(self, call: Awaitable[Any], name: str) -> Any:
        """Await host code that cannot end the turn (a notice, a hook), bounded by the
        host-call budget; a failure is ignored, code that ignores its cancellation is
        abandoned after the grace and named in the result. Returns what it returned, or
        ``None``."""
        task = asyncio.ensure_future(call)
        policy = self.machine.policy.loop
        try:
            if await wait_bounded(self.clock, [task], policy.host_call_timeout):
                task.cancel()
                if await wait_bounded(self.clock, [task], policy.cancel_grace):
                    self._abandoned.append(name)
                    return None
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    def _attempt_for(self, model: int) -> Attempt:
        chain = [*self.attempts, *self.shared]
        return chain[model]

    async def _run_attempt(self, effect: StartAttempt) -> list[Effect]:
        if self.signals.unreachable:  # reported between attempts: do not start another
            return self.machine.feed(UnreachableReported())
        attempt = self._attempt_for(effect.model)
        key = attempt.keys[effect.key_index] if effect.key_index is not None else None
        report = self.on_attempt_step
        on_step = None if report is None else (lambda step: report(effect.attempt, step))
        inner = ToolLoopMachine(self.machine.policy.loop, tools=self.tools, on_step=on_step)
        try:
            provider = attempt.make_provider(key)
        except Exception as err:  # the host's factory is host code: no fallback
            result = GenerationTurnResult(
                status=TurnStatus.ERROR,
                reason="host_error",
                error_message=f"the provider factory raised {type(err).__name__}: {err}",
                exception=err,
            )
            return self.machine.feed(self._finished(effect, result, {}))
        pump = EventPump(
            inner, provider, self.channel, signals=self.signals, clock=self.clock,
            consume_stop=False,
        )  # fmt: skip
        run = asyncio.ensure_future(
            pump.run(
                effect.request,
                hold_timeout_notice=True,
                ledger=effect.ledger,
                expression_delivered=effect.expression_delivered,
            )
        )
        unreachable = asyncio.get_running_loop().create_future()

        def watch() -> None:
            if self.signals.unreachable and not unreachable.done():
                unreachable.set_result(None)

        self.signals.add_listener(watch)
        watch()
        try:
            await asyncio.wait({run, unreachable}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            run.cancel()
            with contextlib.suppress(BaseException):
                await run
            raise
        finally:
            self.signals.remove_listener(watch)
            unreachable.cancel()
        if not run.done():
            run.cancel()
            with contextlib.suppress(BaseException):
                await run
            partial = None
            if inner.state != "ready":
                partial = self._redacted(
                    inner.interrupted_result(TurnStatus.SKIPPED, "destination_unreachable")
                )
            return self.machine.feed(UnreachableReported(partial))
        if pump._stop_fed:
            self._stop_honoured = True
        result = run.result()
        ledger = inner.turn.ledger if inner.is_finished else {}
        return self.machine.feed(self._finished(effect, result, ledger))

    def _finished(
        self, effect: StartAttempt, result: GenerationTurnResult, ledger: Mapping[str, Any]
    ) -> AttemptFinished:
        signals = self.signals
        pending = signals.stop_requested or signals.follow_ups > self._follow_ups_seen
        return AttemptFinished(
            effect.attempt, self._redacted(result), dict(ledger), self.clock.now(), pending
        )

    async def _ask_admission(self, effect: AskAdmission) -> list[Effect]:
        """Ask the host's admission policy, while still listening for a stop or an
        unreachable destination (either ends the wait)."""
        route = self.shared_route
        if route is None:
            return self.machine.feed(AdmissionDecided(False, self.clock.now()))
        request = AdmissionRequest(tuple(effect.failures), self.clock.now())
        admission = asyncio.ensure_future(_admit(route, request))
        interrupted = asyncio.get_running_loop().create_future()

        def watch() -> None:
            signals = self.signals
            if (signals.unreachable or signals.stop_requested) and not interrupted.done():
                interrupted.set_result(None)

        self.signals.add_listener(watch)
        watch()
        # an admission policy that does not answer within the host-call budget refuses
        overdue = self.clock.call_later(
            self.machine.policy.loop.host_call_timeout, _resolve, interrupted
        )
        try:
            await asyncio.wait({admission, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            overdue.cancel()
            self.signals.remove_listener(watch)
            if not admission.done():
                admission.cancel()
                grace = self.machine.policy.loop.cancel_grace
                if await wait_bounded(self.clock, [admission], grace):
                    self._abandoned.append("shared_route.admit")
            interrupted.cancel()
        if self.signals.unreachable:
            return self.machine.feed(UnreachableReported())
        if self.signals.stop_requested:
            return self.machine.feed(StopRequested(self.signals.stop_message))
        admitted = admission.done() and not admission.cancelled() and admission.result()
        return self.machine.feed(AdmissionDecided(bool(admitted), self.clock.now()))

    def _redacted(self, result: GenerationTurnResult) -> GenerationTurnResult:
        """Defence in depth: no key may leave the turn — not in a message a careless provider
        or factory wrote, not in an exception, not even in part."""
        keys = [key for key in self._keys if key]
        leak = self._leak
        if leak is None:
            return result
        data = converter.unstructure(result)
        scrubbed = _scrub(data, keys, leak)
        exception = result.exception
        if exception is not None:
            said = f"{exception!s}{exception!r}"
            if redact(said, keys) != said:
                exception = RedactedError(
                    f"{type(exception).__name__}: {redact(str(exception), keys)}"
                )
        if scrubbed == data and exception is result.exception:
            return result
        clean = converter.structure(scrubbed, GenerationTurnResult)
        return attrs.evolve(clean, exception=exception)


async def _admit(route: SharedRoute, request: AdmissionRequest) -> bool:
    try:
        answer = route.admit(request)
        return bool(await answer) if inspect.isawaitable(answer) else bool(answer)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # a failing admission policy admits nobody
        return False


class RedactedError(Exception):
    """Stands in for a host exception whose message quoted an API key."""


def _scrub(value: Any, keys: Sequence[str], leak: re.Pattern[str]) -> Any:
    """Every text in ``value`` with every key, and every 8-character run of one, redacted
    (the adapters' own rule: a server may quote a key cut short or partly masked). ``leak``
    finds the texts that need it."""
    if isinstance(value, str):
        return redact(value, keys) if leak.search(value) else value
    if isinstance(value, dict):
        return {name: _scrub(item, keys, leak) for name, item in value.items()}
    if isinstance(value, list):
        return [_scrub(item, keys, leak) for item in value]
    return value


async def run_generation_turn(
    attempts: Sequence[Attempt],
    tools: ToolRegistry | Iterable[Tool],
    channel: Channel,
    request: TurnRequest,
    *,
    policy: TurnPolicy | None = None,
    signals: TurnSignals | None = None,
    clock: Clock | None = None,
    shared_route: SharedRoute | None = None,
    key_book: KeyBook | None = None,
    on_step: Callable[[TraceStep], None] | None = None,
    on_attempt_step: Callable[[int, TraceStep], None] | None = None,
) -> GenerationTurnResult:
    """Run a whole generation turn over a fallback chain of attempts (docs/behaviour.md §9).

    Each attempt runs the tool loop; ``error`` rotates keys, ``timeout`` or no key left
    advances to the next model; what a failed attempt delivered stays delivered and the next
    attempt continues from it; a completed tool call is never run again. ``key_book`` keeps
    key health (cooldowns, retirements) across turns when the host passes the same one.
    """
    registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
    plans = [attempt.plan(i, "user") for i, attempt in enumerate(attempts)]
    shared = [
        attempt.plan(len(plans) + i, "shared")
        for i, attempt in enumerate(shared_route.attempts if shared_route is not None else ())
    ]
    machine = GenerationTurnMachine(
        policy, plans=plans, shared=shared, tools=[tool.spec() for tool in registry],
        on_step=on_step,
    )  # fmt: skip
    pump = GenerationPump(
        machine,
        attempts,
        registry,
        channel,
        shared_route=shared_route,
        signals=signals,
        clock=clock,
        key_book=key_book,
        on_attempt_step=on_attempt_step,
    )
    return await pump.run(request)


__all__ = ["EventPump", "GenerationPump", "run_generation_turn", "run_tool_loop"]
