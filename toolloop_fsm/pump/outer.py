"""The outer pump: runs `GenerationTurnMachine`, each attempt's `ToolLoopMachine` through an
`EventPump`, admission and key health, and hands back a result with no key in it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import attrs

from toolloop_fsm.approvals import ApprovalKey
from toolloop_fsm.approvals import Decision
from toolloop_fsm.attempts import AdmissionRequest
from toolloop_fsm.attempts import Attempt
from toolloop_fsm.attempts import KeyBook
from toolloop_fsm.attempts import SharedRoute
from toolloop_fsm.decisions import decide
from toolloop_fsm.effect_handlers import OuterEffectShell
from toolloop_fsm.effect_handlers import ShellEffectHandlers
from toolloop_fsm.effects import AskAdmission
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.effects import StartAttempt
from toolloop_fsm.effects import SupersedeAttempt
from toolloop_fsm.effects import UpdateKeyHealth
from toolloop_fsm.events import AdmissionDecided
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import UnreachableReported
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import LOOP_CLOCK
from toolloop_fsm.host import Channel
from toolloop_fsm.host import Clock
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.notice_budget import SEND_NOTICE
from toolloop_fsm.notice_budget import NoticeBudget
from toolloop_fsm.notice_budget import NoticeOutcome
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.providers._secrecy import fragment_pattern
from toolloop_fsm.providers._secrecy import redact
from toolloop_fsm.pump.arguments import check_chain_arguments
from toolloop_fsm.pump.deliveries import _resolve
from toolloop_fsm.pump.deliveries import post_notice
from toolloop_fsm.pump.deliveries import wait_bounded
from toolloop_fsm.pump.inner import EventPump
from toolloop_fsm.pump.inner import named_turn
from toolloop_fsm.pump.observing import Observation
from toolloop_fsm.pump.observing import observe_turn
from toolloop_fsm.pump.records import TurnRecords
from toolloop_fsm.pump.redaction import RedactedError
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.pump.redaction import _scrub
from toolloop_fsm.pump.redaction import may_hold_key
from toolloop_fsm.result import RETRYABLE_STATUSES
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import converter
from toolloop_fsm.result import with_attempts_outcomes
from toolloop_fsm.review import Reviewer
from toolloop_fsm.snapshot import ChainSnapshot
from toolloop_fsm.snapshot import LoopSnapshot
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.snapshot_capture import capture_chain
from toolloop_fsm.turn import DraftState


class GenerationPump(OuterEffectShell[Awaitable[list[Effect]]]):
    """Runs a `GenerationTurnMachine`: each `StartAttempt` becomes an inner `EventPump` run on
    the attempt's provider; admission, notices and key health go to the host."""

    effect_handlers: ClassVar[ShellEffectHandlers[GenerationPump, Awaitable[list[Effect]]]]

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
        observation: Observation | None = None,
        records: TurnRecords | None = None,
        reviewer: Reviewer | None = None,
        on_snapshot: Callable[[TurnSnapshot], None] | None = None,
    ) -> None:
        self.machine = machine
        self.reviewer = reviewer
        self.on_snapshot = on_snapshot
        # the steered and queued messages fed to the attempts (each attempt is fed them all)
        self._held_fed: list[HeldMessage] = []
        # a resumed turn's running attempt continues from its tool loop's snapshot
        self._resume_loop: tuple[int, LoopSnapshot] | None = None
        loop_policy = machine.policy.loop
        if reviewer is None and (loop_policy.drafting or loop_policy.review_tool_calls):
            switched = "drafting" if loop_policy.drafting else "review_tool_calls"
            raise ValueError(
                f"LoopPolicy.{switched} is on, so the turn needs a reviewer: pass reviewer= "
                "(a toolloop_fsm.Reviewer, such as ModelReviewer)"
            )
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
        # one budget for every notice of the turn, the attempts' and the closing ones
        self._notices = NoticeBudget(loop_policy.host_call_timeout)
        self._keys = [key for attempt in (*self.attempts, *self.shared) for key in attempt.keys]
        self._leak = fragment_pattern(self._keys)  # finds any piece of a key, in one pass
        # the texts the turn's results were found clean of keys in (see `may_hold_key`)
        self._clean_texts: dict[int, str] = {}
        # log records and observed events are redacted with every key of the chain
        self.records = records if records is not None else TurnRecords(0, Secrets(self._keys))
        self.observation = observation
        self._result: GenerationTurnResult | None = None  # the turn's, once it finished

    async def run(
        self, request: TurnRequest, *, resume_from: TurnSnapshot | None = None
    ) -> GenerationTurnResult:
        """Run the turn to its end; with ``resume_from`` (a generation turn's snapshot),
        continue the turn it was taken of (``request`` is then the snapshot's)."""
        self._follow_ups_seen = self.signals.follow_ups
        if resume_from is not None:
            chain = resume_from.chain
            assert chain is not None
            if resume_from.loop is not None:
                self._resume_loop = (chain.attempts, resume_from.loop)
            opening = self.machine.resume(chain, now=self.clock.now())
            # the key book learns the health the snapshot carried
            for (label, key), health in self.machine.generation.health.items():
                self.key_book[(label, key)] = health
        else:
            opening = self.machine.start(request, health=self.key_book, now=self.clock.now())
        pending = collections.deque(opening)
        carry_out = self.effect_handlers
        while pending:
            pending.extend(await carry_out(self, pending.popleft()))
            if self._result is not None:
                return self._result
        raise RuntimeError("the generation turn stopped without a result")

    def _feed(self, event: object) -> list[Effect]:
        """Feed the machine one event, at the clock's time (stamped on its trace steps)."""
        return self.machine.feed(event, now=self.clock.now())

    async def finish(self, effect: Finish) -> list[Effect]:
        if self._stop_honoured or effect.result.status is TurnStatus.STOPPED_BY_USER:
            self.signals.consume_stop()  # the turn that honours a stop consumes it
        if self._held_fed:
            # the last attempt's result accounts for them: taken, or unanswered
            self.signals.release_held(self._held_fed)
        result = with_attempts_outcomes(
            effect.result, self.machine.generation.results, self._abandoned
        )
        self._result = self._redacted(result)
        return []

    async def post_notice(self, effect: PostNotice) -> list[Effect]:
        """A notice the host cannot show ends nothing."""
        policy = self.machine.policy.loop
        outcome = await post_notice(
            self.channel, effect.notice, self._notices, self.clock, policy.cancel_grace
        )
        if outcome is NoticeOutcome.GIVEN_UP:
            self._abandoned.append(SEND_NOTICE)
            self.records.given_up(SEND_NOTICE, policy.host_call_timeout)
        elif isinstance(outcome, KeyboardInterrupt | SystemExit):
            raise outcome  # the process is going down
        elif isinstance(outcome, BaseException):
            self.records.host_call_failed(SEND_NOTICE, f"{type(outcome).__name__}: {outcome}")
        return []

    async def supersede_attempt(self, effect: SupersedeAttempt) -> list[Effect]:
        mark = getattr(self.channel, "attempt_superseded", None)
        if mark is not None:
            await self._call_host(
                mark(effect.attempt, effect.label, effect.delivered_text),
                "channel.attempt_superseded",
            )
        return []

    async def update_key_health(self, effect: UpdateKeyHealth) -> list[Effect]:
        self.key_book[(effect.label, effect.key_index)] = effect.health
        return []

    async def queue_stop_response(self, effect: QueueStopResponse) -> list[Effect]:
        await self._call_host(self.channel.queue_front(effect.stop_message), "channel.queue_front")
        return []

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
                    self.records.abandoned(name, policy.cancel_grace)
                    return None
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.cancelled():
            overdue = f"did not return within {policy.host_call_timeout:g} s"
            self.records.host_call_failed(name, overdue)
            return None
        failure = task.exception()
        if failure is not None:
            self.records.host_call_failed(name, f"{type(failure).__name__}: {failure}")
            return None
        return task.result()

    def _attempt_for(self, model: int) -> Attempt:
        chain = [*self.attempts, *self.shared]
        return chain[model]

    async def start_attempt(self, effect: StartAttempt) -> list[Effect]:
        if self.signals.unreachable:  # reported between attempts: do not start another
            return self._feed(UnreachableReported())
        resume_loop = None
        if self._resume_loop is not None and self._resume_loop[0] == effect.attempt:
            resume_loop = self._resume_loop[1]
        self._resume_loop = None
        offer = self._snapshot_offer(resume_loop)
        attempt = self._attempt_for(effect.model)
        key = attempt.keys[effect.key_index] if effect.key_index is not None else None
        report = self.on_attempt_step
        on_step = None if report is None else (lambda step: report(effect.attempt, step))
        records = TurnRecords(effect.attempt, self.records.secrets)
        on_step = records.logging_steps(ToolLoopMachine.name, on_step)
        inner = ToolLoopMachine(
            self.machine.policy.loop, tools=self.tools, on_step=on_step, snapshots=offer is not None
        )
        observation = self.observation
        try:
            provider = attempt.make_provider(key)
        except Exception as err:  # the host's factory is host code: no fallback
            result = GenerationTurnResult(
                status=TurnStatus.ERROR,
                reason="host_error",
                error_message=f"the provider factory raised {type(err).__name__}: {err}",
                exception=err,
            )
            if observation is not None:
                observation.attempt_started(
                    effect.attempt, effect.label, effect.key_index, effect.route, None
                )
            return self._attempt_ended(effect, result, {}, None)
        if observation is not None:
            observation.attempt_started(
                effect.attempt, effect.label, effect.key_index, effect.route, provider
            )
        pump = EventPump(
            inner,
            provider,
            self.channel,
            signals=self.signals,
            clock=self.clock,
            consume_stop=False,
            observation=observation,
            records=records,
            reviewer=self.reviewer,
            delivery_keys=f"{effect.request.turn_id}:{effect.attempt}",
            on_snapshot=offer,
            notices=self._notices,
        )
        run = asyncio.ensure_future(
            pump.run(
                effect.request,
                hold_timeout_notice=True,
                ledger=effect.ledger,
                expression_delivered=effect.expression_delivered,
                draft=effect.draft,
                attempt_budget=effect.budget,
                resume_from=resume_loop,
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
            if observation is not None:
                skipped = GenerationTurnResult(TurnStatus.SKIPPED, "destination_unreachable")
                observation.attempt_ended(effect.attempt, effect.label, partial or skipped, None)
            return self._feed(UnreachableReported(partial))
        result = run.result()
        ending = pump.ending()
        if ending.stop_fed:
            self._stop_honoured = True
        self._held_fed.extend(m for m in pump.held_fed if all(m is not f for f in self._held_fed))
        ledger = inner.turn.ledger if inner.is_finished else {}
        draft = inner.turn.draft if inner.is_finished else None
        if draft is not None:
            draft.history = list(inner.turn.history or ())
        failure = ending.provider_failure if result.reason == "provider_error" else None
        return self._attempt_ended(effect, result, ledger, failure, draft)

    def _snapshot_offer(
        self, resume_loop: LoopSnapshot | None
    ) -> Callable[[LoopSnapshot], None] | None:
        """The stable point between attempts: the host is handed the chain as this attempt
        starts (with the tool loop it resumes from, if any), then the chain with each stable
        point of the attempt's tool loop. ``None`` when the host takes no snapshots."""
        hook = self.on_snapshot
        if hook is None:
            return None
        chain: ChainSnapshot = capture_chain(self.machine.generation)
        hook(TurnSnapshot(resume_loop, chain))

        def offer(loop: LoopSnapshot) -> None:
            hook(TurnSnapshot(loop, chain))

        return offer

    def _attempt_ended(
        self,
        effect: StartAttempt,
        result: GenerationTurnResult,
        ledger: Mapping[str, Any],
        failure: StreamFailed | None,
        draft: DraftState | None = None,
    ) -> list[Effect]:
        """Feed the machine how an attempt ended; observe it, and when it failed, say so in
        a WARNING record with the provider's failure and what the chain does next."""
        finished = self._finished(effect, result, ledger, draft)
        clean = finished.result
        if self.observation is not None:
            self.observation.attempt_ended(effect.attempt, effect.label, clean, failure)
        effects = self._feed(finished)
        if clean.status in RETRYABLE_STATUSES:
            records = self.records
            records.attempt_failed(
                effect.attempt,
                effect.label,
                effect.key_index,
                clean,
                failure,
                _next_step(effects),
            )
        return effects

    def _finished(
        self,
        effect: StartAttempt,
        result: GenerationTurnResult,
        ledger: Mapping[str, Any],
        draft: DraftState | None = None,
    ) -> AttemptFinished:
        signals = self.signals
        pending = signals.stop_requested or signals.follow_ups > self._follow_ups_seen
        return AttemptFinished(
            effect.attempt,
            self._redacted(result),
            dict(ledger),
            self.clock.now(),
            pending,
            draft=draft.carried(draft.history) if draft is not None else None,
        )

    async def ask_admission(self, effect: AskAdmission) -> list[Effect]:
        """Ask the host's admission policy, while still listening for a stop or an
        unreachable destination (either ends the wait)."""
        route = self.shared_route
        if route is None:
            return self._feed(AdmissionDecided(False, self.clock.now()))
        request = AdmissionRequest(tuple(effect.failures), self.clock.now())
        admission = asyncio.ensure_future(_admit(route, request, self.records))
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
                    self.records.abandoned("shared_route.admit", grace)
            interrupted.cancel()
        if self.signals.unreachable:
            return self._feed(UnreachableReported())
        if self.signals.stop_requested:
            return self._feed(StopRequested(self.signals.stop_message))
        admitted = admission.done() and not admission.cancelled() and admission.result()
        return self._feed(AdmissionDecided(bool(admitted), self.clock.now()))

    def _redacted(self, result: GenerationTurnResult) -> GenerationTurnResult:
        """Defence in depth: no key may leave the turn — not in a message a careless provider
        or factory wrote, not in an exception, not even in part."""
        keys = [key for key in self._keys if key]
        leak = self._leak
        if leak is None:
            return result
        exception = result.exception
        if exception is None and not may_hold_key(result, keys, leak, self._clean_texts):
            return result  # nothing to redact: the result leaves as it is, unconverted
        data = converter.unstructure(result)
        scrubbed = _scrub(data, keys, leak)
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


# how it carries out each effect class of the chain: each handler returns the effects of the
# events it fed the machine (a table for the class: bound methods held by each pump would
# make every finished turn a cycle for the collector)
GenerationPump.effect_handlers = ShellEffectHandlers(GenerationPump)


async def _admit(route: SharedRoute, request: AdmissionRequest, records: TurnRecords) -> bool:
    try:
        answer = route.admit(request)
        return bool(await answer) if inspect.isawaitable(answer) else bool(answer)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # a failing admission policy admits nobody
        records.host_call_failed(
            "shared_route.admit", f"{type(err).__name__}: {err}; nobody is admitted"
        )
        return False


def _next_step(effects: Iterable[Effect]) -> str:
    """What the chain does after a failed attempt, from the effects the machine returned."""
    for effect in effects:
        if isinstance(effect, StartAttempt):
            key = f", key {effect.key_index}" if effect.key_index is not None else ""
            return f"next: attempt {effect.attempt} ({effect.label}{key})"
        if isinstance(effect, AskAdmission):
            return "next: asking the host to admit the shared route"
        if isinstance(effect, Finish):
            return f"no fallback left: the turn ends {effect.result.status.value}"
    return "the chain goes on"


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
    observer: TurnObserver | None = None,
    reviewer: Reviewer | None = None,
    on_snapshot: Callable[[TurnSnapshot], None] | None = None,
) -> GenerationTurnResult:
    """Run a whole generation turn over a fallback chain of attempts (docs/behaviour.md §9).

    Each attempt runs the tool loop; ``error`` rotates keys, ``timeout`` or no key left
    advances to the next model; what a failed attempt delivered stays delivered and the next
    attempt continues from it; a completed tool call is never run again. ``key_book`` keeps
    key health (cooldowns, retirements) across turns when the host passes the same one.
    ``on_step`` sees every step of the outer machine, ``on_attempt_step`` every step of each
    attempt's tool loop; ``observer`` (and every observer registered with
    `toolloop_fsm.observation.add_turn_observer`) sees the turn's phases. ``reviewer`` is
    asked by drafting and the tool checkpoint (`LoopPolicy.drafting`,
    `LoopPolicy.review_tool_calls`); their budgets and rejections are the turn's, shared by
    every attempt. ``on_snapshot`` is called synchronously with a `TurnSnapshot` as each
    attempt starts and at each stable point of its tool loop; `resume_generation_turn`
    continues the turn from one. An exception from it ends the run and is raised from it,
    as one from ``on_step`` is. A policy or channel of the wrong kind is a `TypeError` at the
    call, naming the parameter.
    """
    check_chain_arguments("run_generation_turn", channel, policy)
    request = named_turn(request)
    return await _run_chain(
        attempts,
        tools,
        channel,
        request,
        None,
        policy=policy,
        signals=signals,
        clock=clock,
        shared_route=shared_route,
        key_book=key_book,
        on_step=on_step,
        on_attempt_step=on_attempt_step,
        observer=observer,
        reviewer=reviewer,
        on_snapshot=on_snapshot,
    )


async def resume_generation_turn(
    snapshot: TurnSnapshot,
    attempts: Sequence[Attempt],
    tools: ToolRegistry | Iterable[Tool],
    channel: Channel,
    *,
    policy: TurnPolicy | None = None,
    signals: TurnSignals | None = None,
    clock: Clock | None = None,
    shared_route: SharedRoute | None = None,
    key_book: KeyBook | None = None,
    on_step: Callable[[TraceStep], None] | None = None,
    on_attempt_step: Callable[[int, TraceStep], None] | None = None,
    observer: TurnObserver | None = None,
    reviewer: Reviewer | None = None,
    on_snapshot: Callable[[TurnSnapshot], None] | None = None,
    decisions: Iterable[Decision] = (),
    approval_key: ApprovalKey | None = None,
) -> GenerationTurnResult:
    """Continue the generation turn ``snapshot`` was taken of, in fresh machines, and return
    the whole turn's result.

    The host passes again the same chain (``attempts`` and ``shared_route``: their labels
    must match the snapshot's), tools, channel, policy and reviewer. The attempt that was
    running continues from its tool loop's last stable point (or starts again, when the
    snapshot was taken as it started), with the same attempt number, so its deliveries carry
    the same idempotency keys; earlier attempts' results, failures, carried text, ledger and
    key health stand, and the chain goes on from there. Cooldowns keep the time they had
    left. Raises `toolloop_fsm.snapshot.SnapshotError` for a tool loop's snapshot or a chain
    or tools that do not match. A turn that ended ``awaiting_approval`` resumes with
    ``decisions``, as `resume_tool_loop` does.
    """
    check_chain_arguments("resume_generation_turn", channel, policy)
    chain = snapshot.chain
    if chain is None:
        raise SnapshotError(
            "chain: this is a tool loop's snapshot: resume it with resume_tool_loop"
        )
    snapshot = decide(snapshot, decisions, key=approval_key)
    return await _run_chain(
        attempts,
        tools,
        channel,
        chain.request,
        snapshot,
        policy=policy,
        signals=signals,
        clock=clock,
        shared_route=shared_route,
        key_book=key_book,
        on_step=on_step,
        on_attempt_step=on_attempt_step,
        observer=observer,
        reviewer=reviewer,
        on_snapshot=on_snapshot,
    )


async def _run_chain(
    attempts: Sequence[Attempt],
    tools: ToolRegistry | Iterable[Tool],
    channel: Channel,
    request: TurnRequest,
    resume_from: TurnSnapshot | None,
    *,
    policy: TurnPolicy | None,
    signals: TurnSignals | None,
    clock: Clock | None,
    shared_route: SharedRoute | None,
    key_book: KeyBook | None,
    on_step: Callable[[TraceStep], None] | None,
    on_attempt_step: Callable[[int, TraceStep], None] | None,
    observer: TurnObserver | None,
    reviewer: Reviewer | None,
    on_snapshot: Callable[[TurnSnapshot], None] | None,
) -> GenerationTurnResult:
    registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
    chain = (*attempts, *(shared_route.attempts if shared_route is not None else ()))
    records = TurnRecords(0, Secrets(key for attempt in chain for key in attempt.keys))
    plans = [attempt.plan(i, "user") for i, attempt in enumerate(attempts)]
    shared = [
        attempt.plan(len(plans) + i, "shared")
        for i, attempt in enumerate(shared_route.attempts if shared_route is not None else ())
    ]
    machine = GenerationTurnMachine(
        policy,
        plans=plans,
        shared=shared,
        tools=[tool.spec() for tool in registry],
        on_step=records.logging_steps(GenerationTurnMachine.name, on_step),
    )
    clock = clock if clock is not None else LOOP_CLOCK
    observation = observe_turn(observer, clock, records)
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
        observation=observation,
        records=records,
        reviewer=reviewer,
        on_snapshot=on_snapshot,
    )
    run = pump.run(request, resume_from=resume_from)
    if observation is None:
        return await run
    return await observation.watching(run, "generation", request.conversation_id)
