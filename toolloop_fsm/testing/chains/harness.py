"""Running a drawn chain: `run_chain` plays a `ChainScript` through `run_generation_turn` on a
`VirtualClock` and returns a `ChainRun` with the result and every witness."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attrs import define
from attrs import frozen

from toolloop_fsm.attempts import AdmissionRequest
from toolloop_fsm.attempts import Attempt
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.attempts import SharedRoute
from toolloop_fsm.host import DestinationUnreachable
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.pump import run_generation_turn
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import TraceStep
from toolloop_fsm.scaffolding import is_verbatim_scaffolding
from toolloop_fsm.testing.chains.script import _COOLING_UNTIL
from toolloop_fsm.testing.chains.script import _TOOL_DELAYS
from toolloop_fsm.testing.chains.script import _TOOL_TIMEOUT
from toolloop_fsm.testing.chains.script import SHARED_TOOLS
from toolloop_fsm.testing.chains.script import ChainScript
from toolloop_fsm.testing.chains.script import ChainSignal
from toolloop_fsm.testing.chains.script import KeyState
from toolloop_fsm.testing.chains.script import ModelScript
from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import VirtualClock
from toolloop_fsm.testing.clock import real_time_limit
from toolloop_fsm.testing.harness import LibraryLogCapture
from toolloop_fsm.testing.harness import WitnessedReviewer
from toolloop_fsm.testing.invariants import ReviewAsked
from toolloop_fsm.testing.invariants import call_identity
from toolloop_fsm.testing.reviewer import ScriptedReviewer
from toolloop_fsm.testing.scripted import ScriptedProvider
from toolloop_fsm.testing.scripted import ScriptItem


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
    key: str
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

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        self._maybe_break()
        await super().send_text(text, idempotency_key=idempotency_key)

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        self._maybe_break()
        await super().send_expression(expression, idempotency_key=idempotency_key)

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
    """One finished simulated generation turn and every witness the checker uses.

    A plain record: `check_chain_invariants(run)` (`toolloop_fsm.testing.chains.invariants`)
    reads it, and the record knows nothing of the checker."""

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
    #: every time the reviewer was asked, in order, by whichever attempt (drafting, the
    #: tool checkpoint)
    reviews_asked: tuple[ReviewAsked, ...] = ()

    def __repr__(self) -> str:
        # short on purpose: asyncio reprs a finished task's result, and the script is long
        status = self.result.status.value if self.result is not None else f"raised {self.raised!r}"
        return f"ChainRun({status}, {len(self.script.models)} models, {self.elapsed:g} s)"


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
    the library's log records. A policy with drafting or the tool checkpoint on gets one
    `ScriptedReviewer` for the whole turn, playing the script's ``reviews`` and watched
    (`ChainRun.reviews_asked`). ``real_timeout`` (real seconds) turns a deadlocked run into
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
    reviewer: WitnessedReviewer | None = None
    if turn_policy.loop.drafting or turn_policy.loop.review_tool_calls:
        scripted = ScriptedReviewer(script.reviews, clock=clock)
        reviewer = WitnessedReviewer(scripted, channel, clock, attempt=lambda: current_attempt[0])

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
    capture = LibraryLogCapture()
    capture.attach()
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
            reviewer=reviewer,
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
        capture.detach()
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
        log_text=capture.text,
        elapsed=clock.now() - started,
        reviews_asked=tuple(reviewer.asked) if reviewer is not None else (),
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
            call_identity(name, arguments),
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
