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
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import ClassVar

import attrs

from toolloop_fsm.approvals import ApprovalKey
from toolloop_fsm.approvals import Decision
from toolloop_fsm.budgets import AttemptBudget
from toolloop_fsm.decisions import decide
from toolloop_fsm.effect_handlers import InnerEffectShell
from toolloop_fsm.effect_handlers import ShellEffectHandlers
from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import CancelReview
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import OfferSnapshot
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartStream
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import CHUNK_TYPES
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import MessageHeld
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.host import LOOP_CLOCK
from toolloop_fsm.host import Channel
from toolloop_fsm.host import Clock
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.notice_budget import NoticeBudget
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers._secrecy import provider_secrets
from toolloop_fsm.pump.arguments import check_loop_arguments
from toolloop_fsm.pump.deadlines import Deadlines
from toolloop_fsm.pump.deliveries import ChannelCalls
from toolloop_fsm.pump.deliveries import takes_idempotency_keys
from toolloop_fsm.pump.deliveries import wait_bounded
from toolloop_fsm.pump.observing import Observation
from toolloop_fsm.pump.observing import observe_turn
from toolloop_fsm.pump.records import TurnRecords
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.pump.redaction import StreamMask
from toolloop_fsm.pump.redaction import masked_stream
from toolloop_fsm.pump.tool_calls import ToolCalls
from toolloop_fsm.pump.tool_calls import ToolTurn
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import TraceStep
from toolloop_fsm.review import VERDICT_TYPES
from toolloop_fsm.review import Reviewer
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import Unavailable
from toolloop_fsm.snapshot import LoopSnapshot
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.states.build_result import count_late_deliveries
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import LedgerEntry


class _Unsignalled(TurnSignals):
    """Stands in when a turn is run without signals: nothing can be requested of it."""

    def request_stop(self, stop_message: str | None = None) -> None:
        raise RuntimeError("this turn was started without TurnSignals; pass signals= to stop it")

    def follow_up(self) -> None:
        raise RuntimeError("this turn was started without TurnSignals; pass signals=")

    def steer(self, text: str) -> HeldMessage:
        raise RuntimeError("this turn was started without TurnSignals; pass signals=")

    def queue(self, text: str) -> HeldMessage:
        raise RuntimeError("this turn was started without TurnSignals; pass signals=")

    def report_unreachable(self) -> None:
        raise RuntimeError("this turn was started without TurnSignals; pass signals=")


_NO_SIGNALS = _Unsignalled()
#: The records of a `run_tool_loop` turn whose provider holds no key: attempt 0, no keys known
#: (shared: it never changes).
_TOOL_LOOP_RECORDS = TurnRecords()
#: Events whose arrival is a failure worth a WARNING record.
_REPORTED = frozenset({StreamFailed, DeadlineExpired, DeliveryFailed})


#: Events before which the text the stream mask holds back is not let through: a
#: confirmation changes nothing about the stream, and after a refused delivery nothing more
#: is sent (the held text stays undelivered, as the refused text does: docs/behaviour.md
#: §9.12 rule 2)
_NOT_RELEASING = frozenset({DeliveryRecorded, DeliveryFailed})


@attrs.frozen
class AttemptEnding:
    """What the outer tier needs to know of how an attempt's run ended, besides its result:
    whether the attempt took the host's stop (the turn then honoured it), and the provider's
    last failure (named when the chain falls back)."""

    stop_fed: bool
    provider_failure: StreamFailed | None


class EventPump(InnerEffectShell[bool | None]):
    """Runs one `ToolLoopMachine` against a provider, tools and a channel."""

    #: How it carries out each effect class of the tool loop, one handler each (a handler
    #: returns False when the batch it is part of ends there)
    effect_handlers: ClassVar[ShellEffectHandlers[EventPump, bool | None]]

    __slots__ = (
        "_abandoned",
        "_calls",
        "_children",
        "_deadlines",
        "_depth",
        "_failure",
        "_finished",
        "_follow_ups_seen",
        "_interrupted",
        "_iteration",
        "_late_confirmed",
        "_main",
        "_masked",
        "_observation",
        "_pending_stream",
        "_provider_failure",
        "_reading",
        "_records",
        "_result",
        "_review_grace",
        "_review_seq",
        "_review_task",
        "_secrets",
        "_signals_dirty",
        "_stop_fed",
        "_stream_generation",
        "_tools",
        "_wake",
        "channel",
        "clock",
        "consume_stop",
        "held_fed",
        "machine",
        "on_effect",
        "on_snapshot",
        "policy",
        "provider",
        "registry",
        "reviewer",
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
        observation: Observation | None = None,
        records: TurnRecords | None = None,
        reviewer: Reviewer | None = None,
        delivery_keys: str | None = None,
        on_snapshot: Callable[[LoopSnapshot], None] | None = None,
        notices: NoticeBudget | None = None,
    ) -> None:
        self.machine = machine
        # handed each snapshot the machine offers (it offers them when built with
        # ``snapshots=True``)
        self.on_snapshot = on_snapshot
        policy = machine.policy
        if reviewer is None and (policy.drafting or policy.review_tool_calls):
            switched = "drafting" if policy.drafting else "review_tool_calls"
            raise ValueError(
                f"LoopPolicy.{switched} is on, so the turn needs a reviewer: pass reviewer= "
                "(a toolloop_fsm.Reviewer, such as ModelReviewer)"
            )
        self.reviewer = reviewer
        self._review_task: asyncio.Task[None] | None = None
        self._review_seq = 0
        self._review_grace: Any = None
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
        self._iteration = 0
        self._tools: ToolCalls | None = None  # made for the turn's first tool call
        # the turn's deadlines, by token: what expires is fed to the machine
        self._deadlines = Deadlines()
        self._signals_dirty = False
        self._stop_fed = False
        self._follow_ups_seen = 0
        #: the steered and queued messages fed to the machine, in order
        self.held_fed: list[HeldMessage] = []
        self._depth = 0
        self.policy = machine.policy
        # the turn's calls into the channel: deliveries, notices, the stop message (sharing
        # the host-call budget of the turn's notices: the outer tier's, for an attempt)
        self._calls = ChannelCalls(
            self._deadlines,
            delivery_keys if takes_idempotency_keys(channel) else None,
            notices,
        )
        # code that ignored its cancellation past the grace: named, never awaited again
        self._abandoned: list[str] | None = None
        # deliveries the channel confirmed after the machine had already finished
        self._late_confirmed: list[int] | None = None
        # who watches the turn (``None``: nothing; checked at lifecycle points, never per
        # chunk), what its log records say, and the provider's last failure (the outer tier
        # names its HTTP status when it falls back)
        self._observation = observation
        self._records = records if records is not None else _TOOL_LOOP_RECORDS
        self._provider_failure: StreamFailed | None = None
        # the turn's keys and the provider's own: masked out of its stream (and its failures)
        # before the machine takes them, so that nothing downstream ever holds one
        self._secrets = self._records.secrets.with_provider(provider)
        self._masked: StreamMask | None = None  # the mask of the stream being read, if any

    # ------------------------------------------------------------------ running
    async def run(
        self,
        request: TurnRequest,
        *,
        continuation_style: bool | None = None,
        hold_timeout_notice: bool = False,
        ledger: Mapping[str, LedgerEntry] | None = None,
        expression_delivered: bool = False,
        draft: DraftState | None = None,
        attempt_budget: AttemptBudget | None = None,
        resume_from: LoopSnapshot | None = None,
    ) -> GenerationTurnResult:
        """Run the turn to its terminal state and return its result; with ``resume_from``,
        continue the turn that snapshot was taken of (``request`` and the carried state
        are then the snapshot's)."""
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
            if resume_from is not None:
                opening = self.machine.resume(resume_from, now=self.clock.now())
            else:
                opening = self.machine.start(
                    request,
                    continuation_style=continuation_style,
                    hold_timeout_notice=hold_timeout_notice,
                    ledger=ledger,
                    expression_delivered=expression_delivered,
                    draft=draft,
                    attempt_budget=attempt_budget,
                    now=self.clock.now(),
                )
            self._execute(opening)
            del opening  # carried out: not kept for as long as the turn waits
            self._signals_dirty = True
            self._take_signals()
            # The turn's own task: read each pass's stream as the machine starts it, and
            # wait between passes. A deadline, a stop or a failure elsewhere interrupts a
            # read by cancelling this task; that cancellation is taken back here
            # (`uncancel`), while the caller's own cancellation propagates as usual. (Inline
            # rather than a method: one frame less for every turn waiting on its provider.)
            main = self._main
            assert main is not None
            yielded = False
            while not self._finished:
                try:
                    pending = self._pending_stream
                    if pending is not None:
                        self._pending_stream = None
                        yielded = False
                        # the read holds its request: this frame keeps nothing of it
                        read, pending = self._read_stream(*pending), None
                        await read
                        if self._interrupted:  # a provider swallowed the interruption
                            self._interrupted = False
                            main.uncancel()
                    elif not yielded:
                        # a tool dispatched by the pass just read takes its first step
                        # before this task's next one: a tool that finishes there has
                        # started the next pass, read without waiting on a future (one
                        # pass of the event loop less per tool round)
                        yielded = True
                        await asyncio.sleep(0)
                    else:
                        yielded = False
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
            if self.held_fed and self.consume_stop:
                # the turn's result accounts for them: taken, or unanswered
                self.signals.release_held(self.held_fed)
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

    def ending(self) -> AttemptEnding:
        """How the run that returned ended, for the tier that runs it as an attempt."""
        return AttemptEnding(self._stop_fed, self._provider_failure)

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
        in_doubt = self._tools.in_doubt if self._tools is not None else None
        if in_doubt:
            changes["in_doubt_calls"] = (*result.in_doubt_calls, *in_doubt)
        return attrs.evolve(result, **changes) if changes else result

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
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
                self.abandon(straggler, straggler.get_name())
        for child in children:
            if child.done() and not child.cancelled() and child.exception() is not None:
                raise child.exception()  # type: ignore[misc]

    def abandon(self, task: asyncio.Task[Any], name: str) -> InDoubtCall | None:
        """Give up on a child that ignored its cancellation: it is named in the result and
        never awaited again. A tool so abandoned is in doubt (§3.9): returned, and listed."""
        children = self._children
        if children is None or task not in children:
            return None
        children.remove(task)
        if self._abandoned is None:
            self._abandoned = []
        self._abandoned.append(name)
        tools = self._tools
        in_doubt = tools.abandoned(task) if tools is not None else None
        self._records.abandoned(name, self.policy.cancel_grace, in_doubt)
        return in_doubt

    def give_up(self, name: str) -> None:
        """A call that overran its budget was given up on (and cancelled): it is named in the
        result, and ends nothing."""
        if self._abandoned is None:
            self._abandoned = []
        self._abandoned.append(name)
        self._records.given_up(name, self.policy.host_call_timeout)

    def _abandon_unless_done(self, task: asyncio.Task[Any], name: str) -> None:
        if not task.done():
            self.abandon(task, name)

    def _wind_down(self) -> None:
        """The turn is over (or the caller was cancelled): stop the stream and every running
        tool, abandon deliveries still in flight, disarm every deadline."""
        self._stream_generation += 1
        self._pending_stream = None
        if self._tools is not None:
            self._tools.stop()
        calls = self._calls
        for task in (calls.task, self._review_task):
            if task is not None and not task.done():
                task.cancel()
        calls.drop_waiting()
        self._cancel_timers()
        self._finished = True
        if self._observation is not None:
            self._observation.turn_over()

    # ------------------------------------------------------------------ feeding
    def feed(self, event: Any) -> None:
        """Feed one event and carry out its effects; a failure ends the run with it."""
        if self._finished or self.machine.is_finished:
            if type(event) is DeliveryRecorded and event.seq is not None:
                # confirmed: it belongs in the result
                if self._late_confirmed is None:
                    self._late_confirmed = []
                self._late_confirmed.append(event.seq)
            return
        masked = self._masked
        if masked is not None and masked.held and type(event) not in _NOT_RELEASING:
            self._take_released(masked.release())
            if self._finished or self.machine.is_finished:
                return
        if self._signals_dirty and type(event) is not DeliveryRecorded:
            # a signal that arrived before this event is taken first, in the state it met
            # (a delivery the channel already confirmed is recorded first: it happened)
            self._take_signals()
            if self._finished or self.machine.is_finished:
                return
        kind = type(event)
        if kind in _REPORTED:
            self._report(event)
        try:
            effects = self.machine.feed(event, now=self.clock.now())
        except BaseException as err:  # the machine rejected the event: surface it to run()
            self.fail(err)
            return
        observation = self._observation
        if observation is not None:
            observation.cause = event  # why the effects below are carried out
            if kind is StreamEnded or kind is StreamFailed:
                # the pass is closed and recorded: observed before what follows it (a tool)
                failure = event if kind is StreamFailed else None
                observation.pass_ended(self.machine.turn, failure)
        self._execute(effects)

    def _take_released(self, chunk: Any) -> None:
        """Text the stream mask held back as a possible start of a key is let through
        before what follows it (an event other than a confirmation, a chunk of another
        kind): it arrived first, so the machine (and a watching observer) takes it first,
        masked as far as it can be."""
        if chunk is None:
            return
        observation = self._observation
        if observation is not None and observation.wants_chunks and observation.observes(chunk):
            observation.chunk(chunk)
        self.feed(chunk)

    def _report(self, event: StreamFailed | DeadlineExpired | DeliveryFailed) -> None:
        """A WARNING record of a failure, as it is fed to the machine."""
        records = self._records
        if isinstance(event, StreamFailed):
            self._provider_failure = event
            records.stream_failed(self._provider_name(), self._iteration, event)
        elif isinstance(event, DeliveryFailed):
            records.host_failed(event)
        else:
            policy = self.policy
            seconds: float | None = {
                DeadlineKind.FIRST_TOKEN: policy.effective_first_token_timeout,
                DeadlineKind.INACTIVITY: policy.inactivity_timeout,
                DeadlineKind.PASS_DURATION: policy.max_pass_duration,
                DeadlineKind.REVIEW: policy.review_timeout,
            }.get(event.kind)
            tool_name = ""
            if event.kind is DeadlineKind.TOOL:
                # the call whose deadline this is: several of a batch may run at once
                tools = self._tools
                call = tools.with_deadline(event.token) if tools is not None else None
                seconds = policy.tool_timeout
                if call is not None:
                    tool_name = call.name
                    seconds = call.effect.timeout
                    if seconds is None:  # a machine that does not say: the tool's own
                        tool = self.registry.get(call.effect.name)
                        own = tool.timeout if tool is not None else None
                        seconds = own if own is not None else policy.tool_timeout
            records.deadline_expired(
                event.kind,
                seconds,
                provider=self._provider_name(),
                iteration=self._iteration,
                tool=tool_name,
            )

    def _provider_name(self) -> str:
        name = getattr(self.provider, "name", None)
        return name if isinstance(name, str) and name else type(self.provider).__name__

    def fail(self, err: BaseException) -> None:
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
        outcomes = self._calls.outcomes
        if self._depth == 0 and outcomes:
            # deliveries that completed at once are reported after the batch that issued
            # them, so every effect of a step is carried out before the next event
            while outcomes:
                self.feed(outcomes.pop(0))

    def _carry_out(self, effects: Iterable[Effect]) -> None:
        handlers = self.effect_handlers.by_class
        for effect in effects:
            if self.on_effect is not None:
                self.on_effect(effect)
            if handlers[type(effect)](self, effect) is False:
                return  # the host's snapshot hook failed: the turn ends with its exception

    def arm_deadline(self, effect: ArmDeadline) -> None:
        self._deadlines.arm(effect, self)
        if effect.kind is DeadlineKind.TOOL:
            # a call's own deadline: which dispatch it bounds, for the record when it expires
            self._tool_calls().deadline_armed(effect.token)

    def clear_deadline(self, effect: ClearDeadline) -> None:
        self._deadlines.clear(effect.token)

    def _cancel_timers(self) -> None:
        """Disarm every deadline, and the graces of the tools or reviewer being cancelled."""
        self._deadlines.cancel_all()
        if self._tools is not None:
            self._tools.cancel_graces()
        if self._review_grace is not None:
            self._review_grace.cancel()
        self._review_grace = None

    def cut_stream(self, effect: CutStream) -> None:
        # the pass reached the held-prose ceiling or its budget's room: the read stops here
        # (its stream is closed as the read unwinds, aborting the request), and the pass ends
        self.cancel_stream()
        self._calls.report_later(StreamEnded())

    def deliver(self, effect: Deliver) -> None:
        self._calls.deliver(effect, self)

    def _queue_host_call(self, effect: PostNotice | QueueStopResponse) -> None:
        self._calls.queue(effect, self)

    post_notice = queue_stop_response = _queue_host_call

    def offer_snapshot(self, effect: OfferSnapshot) -> bool:
        """Hand the host a snapshot, synchronously, before the pass it precedes starts. Like
        ``on_step``, the hook is the host's own code: an exception from it ends the run (it
        is raised from the run, after the turn's children are cancelled), and the last
        snapshot it took is where the turn can be resumed from."""
        hook = self.on_snapshot
        if hook is None or self._finished:
            return True
        try:
            hook(effect.snapshot)
        except BaseException as err:
            self.fail(err)
            return False
        return True

    def finish(self, effect: Finish) -> None:
        if self._finished:
            return
        self._stream_generation += 1
        calls = self._calls
        calls.drop_waiting()
        host_task = calls.host_task
        if host_task is not None and not host_task.done():
            # notices and the stop message are owed to the host: they finish first (each
            # bounded by the host-call budget), then the result is settled
            calls.pending_result = effect.result
            return
        self.settle_result(effect.result)

    def settle_result(self, result: GenerationTurnResult) -> None:
        if self._finished:
            return
        host_exception = self._calls.host_exception
        if host_exception is not None:
            result = attrs.evolve(result, exception=host_exception)
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
            self.feed(StopRequested(signals.stop_message))
        if signals.follow_ups > self._follow_ups_seen:
            self._follow_ups_seen = signals.follow_ups
            self.feed(FollowUpArrived())
        if signals.held and not (self._finished or self.machine.is_finished):
            fed = self.held_fed
            for message in [m for m in signals.held if all(m is not f for f in fed)]:
                fed.append(message)
                self.feed(MessageHeld(message))

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

    def start_stream(self, effect: StartStream) -> None:
        self._stream_generation += 1
        self._iteration = effect.iteration
        self._deadlines.last_activity = self.clock.now()
        self._pending_stream = (effect.request, self._stream_generation)
        self._wake_up()

    def cancel_stream(self, effect: CancelStream | None = None) -> None:
        self._stream_generation += 1
        self._pending_stream = None
        self._interrupt_read()

    async def _read_stream(self, request: ProviderRequest, generation: int) -> None:
        if generation != self._stream_generation:
            return  # cancelled before it was read
        observation = self._observation
        if observation is not None:
            observation.pass_started(self._iteration)
        secrets = self._secrets
        try:
            stream = self.provider.stream(request)
        except Exception as err:  # raised before any chunk: a failed pass all the same
            self.feed(secrets.masked_failure(err))
            return
        # observers, the machine and all it makes see the masked stream: each chunk is
        # handed through the turn's mask as it is read (no iterator layer), or, when chunks
        # are watched, before the tap shows it
        mask = None
        if secrets.keys:
            mask = self._masked = secrets.stream_mask()
        if observation is not None and observation.wants_chunks:
            if mask is not None:
                stream = masked_stream(mask, stream)
                mask = None
            stream = _tapped(stream, observation)  # a tap only when chunks are watched
        exhausted = False
        self._reading = True
        machine = self.machine
        turn = machine.turn
        # the fast path, called from here without the hop through feed(): the handlers of
        # the current state (kept current by the machine), and the effects they leave (only
        # what every chunk calls is held as a bound method: each costs every waiting turn)
        handler_for = machine.chunk_handlers.get
        now = self.clock.now
        deadlines = self._deadlines
        try:
            async for chunk in stream:
                deadlines.last_chunk = now()
                if mask is not None:
                    if mask.held:
                        self._take_released(mask.release_before(chunk))
                        if generation != self._stream_generation:
                            return
                    chunk = mask.admit(chunk)
                    if chunk is None:
                        continue
                try:
                    handler = handler_for(chunk.__class__)
                    if handler is not None:
                        handler(turn, chunk)
                        effects = machine.take_effects() if turn.effects else None
                    else:
                        effects = machine.feed(chunk, now=deadlines.last_chunk)
                except BaseException as err:
                    self._chunk_raised(chunk, err)
                    return
                if effects:
                    self._execute(effects)
                    effects = None  # carried out: not kept while the read waits for a chunk
                    if generation != self._stream_generation:
                        return
                if self._signals_dirty:
                    self._take_signals()
                    if generation != self._stream_generation:
                        return
            if mask is not None and mask.held:  # the held text goes before the end
                self._take_released(mask.release())
            exhausted = True
        except Exception as err:  # a provider bug is a failed pass, not a crashed turn
            if generation == self._stream_generation:
                self.feed(secrets.masked_failure(err))
            return
        finally:
            self._reading = False
            self._masked = None
            await _close_stream(stream)
            if observation is not None and not exhausted:
                # cut short: the loop recorded how (a deadline, a stop), or nothing (the
                # caller cancelled the turn); a failure was observed as it was fed
                observation.pass_ended(turn, None)
        if generation == self._stream_generation:
            self.feed(StreamEnded())
        if observation is not None:  # once: unless the end was fed, it is observed here
            observation.pass_ended(turn, None)

    def _chunk_raised(self, chunk: object, err: BaseException) -> None:
        """Taking ``chunk`` raised ``err``: the provider's protocol failure, or the turn's
        own. (A method rather than inline in the read: every turn waiting on its provider
        carries the read's frame, sized by its largest expression.)"""
        if type(chunk) not in CHUNK_TYPES:  # a provider bug: a failed pass
            self.feed(
                StreamFailed(
                    f"the provider yielded {type(chunk).__name__}, not a chunk event",
                    kind="protocol",
                    retryable=True,
                )
            )
        elif isinstance(err, InvalidEvent | ValueError | TypeError):
            # a chunk the machine refuses (a malformed field, non-finite usage) is the
            # provider's protocol failure, not a crash of the turn
            self.feed(
                StreamFailed(
                    f"the provider sent a malformed {type(chunk).__name__}: {err}",
                    kind="protocol",
                    retryable=True,
                )
            )
        else:
            self.fail(err)

    # ------------------------------------------------------------------ the reviewer
    def request_review(self, effect: RequestReview) -> None:
        self._review_seq = effect.review
        name = f"reviewer (review {effect.review})"
        self._review_task = self.spawn(self._review(effect), name)

    def cancel_review(self, effect: CancelReview | None = None) -> None:
        self._review_seq = -1
        task = self._review_task
        if task is not None and not task.done():
            task.cancel()
            # a reviewer that ignores its cancellation is abandoned after the grace (the
            # timer goes with the turn's other timers when it returns)
            self._review_grace = self.clock.call_later(
                self.policy.cancel_grace, self._abandon_unless_done, task, task.get_name()
            )

    async def _review(self, effect: RequestReview) -> None:
        """Ask the reviewer; whatever goes wrong is `Unavailable` (the machine's deadline
        bounds the wait), except the process going down. A packet holding one of the turn's
        keys is never shown to it."""
        packet = effect.packet
        verdict: Any
        if self._holds_secret(packet):
            verdict = Unavailable("secret")
        else:
            reviewer = self.reviewer
            assert reviewer is not None
            try:
                verdict = await reviewer.review(packet)
            except asyncio.CancelledError:
                raise  # the review was cancelled (a stop, its deadline) or the turn's caller
            except (KeyboardInterrupt, SystemExit) as err:
                self.fail(err)
                return
            except BaseException as err:
                # host code, as a tool is: anything it raises — a `BaseException` subclass
                # or `GeneratorExit` too — is a failed call, here an unavailable reviewer
                self._records.reviewer_failed(effect.review, err)
                verdict = Unavailable(f"raised {type(err).__name__}")
            if not isinstance(verdict, VERDICT_TYPES):
                verdict = Unavailable(f"not a verdict: {type(verdict).__name__}")
        if effect.review == self._review_seq:
            self.feed(ReviewReturned(effect.review, verdict))

    def _holds_secret(self, packet: ReviewPacket) -> bool:
        secrets = self._secrets
        if not secrets.keys:
            return False
        texts = [packet.candidate, repr(packet.tools), repr(packet.history)]
        if packet.proposed_call is not None:
            texts.append(repr(packet.proposed_call.arguments))
        return any(secrets.holds_any(text) for text in texts)

    # ------------------------------------------------------------------ tools
    def run_tool(self, effect: RunTool) -> None:
        self._tool_calls().run(effect, self._iteration, self)

    def cancel_tool(self, effect: CancelTool) -> None:
        self._tool_calls().cancel(effect, self._iteration, self)

    def _tool_calls(self) -> ToolCalls:
        tools = self._tools
        if tools is None:
            tools = self._tools = ToolCalls(
                ToolTurn(
                    self.machine,
                    self.registry,
                    self.clock,
                    self.policy,
                    self._observation,
                    self._records,
                    self._secrets,
                    self._calls.report_later,
                )
            )
        return tools


EventPump.effect_handlers = ShellEffectHandlers(EventPump)


async def _tapped(stream: AsyncIterator[Any], observation: Observation) -> AsyncIterator[Any]:
    """The provider's stream, each text, thought and call chunk shown to the observation
    before the loop takes it. After each one the turn lets the loop run once, so that a
    consumer waiting for it (a live event stream) has it before any delivery holding its
    text is sent."""
    try:
        async for chunk in stream:
            if observation.observes(chunk):
                observation.chunk(chunk)
                await asyncio.sleep(0)
            yield chunk
    finally:
        await _close_stream(stream)


async def _close_stream(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    # closing an async generator that is still running elsewhere raises RuntimeError (caught
    # here rather than by contextlib.suppress: a context manager less for every pass)
    try:
        await aclose()
    except RuntimeError:
        return


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
    observer: TurnObserver | None = None,
    reviewer: Reviewer | None = None,
    on_snapshot: Callable[[TurnSnapshot], None] | None = None,
) -> GenerationTurnResult:
    """Run one tool-loop turn (one attempt) and return its result.

    Cancelling the task that awaits this cancels the provider stream and any running tool
    and propagates `CancelledError`; an outer `asyncio.timeout` raises `TimeoutError`.
    ``on_step`` sees every step of the machine as it is taken; ``observer`` (and every
    observer registered with `toolloop_fsm.observation.add_turn_observer`) sees the turn's
    phases (`toolloop_fsm.observation`). ``reviewer`` is asked by drafting and the tool
    checkpoint (`LoopPolicy.drafting`, `LoopPolicy.review_tool_calls`), which need one.
    ``on_snapshot`` is called synchronously with a `TurnSnapshot` at each stable point
    (before each pass); `resume_tool_loop` continues the turn from one. An exception from
    it ends the run and is raised from it, as one from ``on_step`` is. A policy, provider or
    channel of the wrong kind is a `TypeError` at the call, naming the parameter.
    """
    check_loop_arguments("run_tool_loop", provider, channel, policy)
    request = named_turn(request)
    return await _run_loop(
        provider,
        tools,
        channel,
        request,
        None,
        policy=policy,
        signals=signals,
        clock=clock,
        continuation_style=continuation_style,
        on_step=on_step,
        observer=observer,
        reviewer=reviewer,
        on_snapshot=on_snapshot,
    )


def named_turn(request: TurnRequest) -> TurnRequest:
    """``request``, named with a fresh ``turn_id`` unless it names its turn. Its other fields
    were converted and checked when it was built, so they are copied as they are:
    `attrs.evolve` would convert and check them all again (the whole context, every turn).
    A subclass of `TurnRequest` is evolved."""
    if request.turn_id is not None:
        return request
    turn_id = uuid.uuid4().hex
    if type(request) is not TurnRequest:
        return attrs.evolve(request, turn_id=turn_id)
    named = object.__new__(TurnRequest)
    for field in attrs.fields(TurnRequest):
        object.__setattr__(named, field.name, getattr(request, field.name))
    object.__setattr__(named, "turn_id", turn_id)
    return named


async def resume_tool_loop(
    snapshot: TurnSnapshot,
    provider: Provider,
    tools: ToolRegistry | Iterable[Tool],
    channel: Channel,
    *,
    policy: LoopPolicy | None = None,
    signals: TurnSignals | None = None,
    clock: Clock | None = None,
    on_step: Callable[[TraceStep], None] | None = None,
    observer: TurnObserver | None = None,
    reviewer: Reviewer | None = None,
    on_snapshot: Callable[[TurnSnapshot], None] | None = None,
    decisions: Iterable[Decision] = (),
    approval_key: ApprovalKey | None = None,
) -> GenerationTurnResult:
    """Continue the tool-loop turn ``snapshot`` was taken of, in a fresh machine, and return
    its result (the whole turn's: what was delivered and recorded before the snapshot
    included).

    The host passes again what a snapshot cannot hold: the provider, the tools (every tool
    the snapshot names must be registered), the channel, the policy and the reviewer. Tools
    the turn completed are never run again (their outcomes are in the history and the
    ledger); delivered text is never sent again; the pass that was running when the turn
    was cut runs again from its start, its deliveries under the same sequence numbers — and
    so the same idempotency keys — as the first time, as are the deliveries the snapshot
    had in flight. A channel that takes idempotency keys drops what it already showed.
    Raises `toolloop_fsm.snapshot.SnapshotError` for a generation turn's snapshot or tools
    that do not match.

    A turn that ended ``awaiting_approval`` resumes with ``decisions``, one per call it waits
    on (`PendingApproval.approve`, `.deny`), checked by `toolloop_fsm.decisions.decide`
    against the snapshot's calls (and their signatures, with ``approval_key``) before
    anything runs: `toolloop_fsm.approvals.ApprovalError` names what does not match.
    """
    check_loop_arguments("resume_tool_loop", provider, channel, policy)
    if snapshot.chain is not None or snapshot.loop is None:
        raise SnapshotError(
            "chain: this is a generation turn's snapshot: resume it with resume_generation_turn"
        )
    loop = decide(snapshot, decisions, key=approval_key).loop
    assert loop is not None
    return await _run_loop(
        provider,
        tools,
        channel,
        loop.request,
        loop,
        policy=policy,
        signals=signals,
        clock=clock,
        continuation_style=None,
        on_step=on_step,
        observer=observer,
        reviewer=reviewer,
        on_snapshot=on_snapshot,
    )


def _run_loop(
    provider: Provider,
    tools: ToolRegistry | Iterable[Tool],
    channel: Channel,
    request: TurnRequest,
    resume_from: LoopSnapshot | None,
    *,
    policy: LoopPolicy | None,
    signals: TurnSignals | None,
    clock: Clock | None,
    continuation_style: bool | None,
    on_step: Callable[[TraceStep], None] | None,
    observer: TurnObserver | None,
    reviewer: Reviewer | None,
    on_snapshot: Callable[[TurnSnapshot], None] | None,
) -> Coroutine[Any, Any, GenerationTurnResult]:
    """The turn's run, for the caller to await. An unobserved turn is the pump's own run,
    not a coroutine awaiting it: one frame less for every turn waiting on its provider."""
    # the turn's keys are the provider's own (an adapter's key and credential headers)
    own = provider_secrets(provider)
    records = TurnRecords(0, Secrets(own)) if own else _TOOL_LOOP_RECORDS
    machine = ToolLoopMachine(
        policy,
        tools=tools,
        on_step=records.logging_steps(ToolLoopMachine.name, on_step),
        snapshots=on_snapshot is not None,
    )
    clock = clock if clock is not None else LOOP_CLOCK
    observation = observe_turn(observer, clock, records)
    pump = EventPump(
        machine,
        provider,
        channel,
        signals=signals,
        clock=clock,
        observation=observation,
        records=records,
        reviewer=reviewer,
        delivery_keys=f"{request.turn_id}:1",
        on_snapshot=None if on_snapshot is None else (lambda loop: on_snapshot(TurnSnapshot(loop))),
    )
    run = pump.run(request, continuation_style=continuation_style, resume_from=resume_from)
    if observation is None:
        return run
    observation.for_provider(provider)
    return observation.watching(run, "tool_loop", request.conversation_id)
