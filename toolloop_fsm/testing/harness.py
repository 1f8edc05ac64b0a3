"""Running a drawn script: `run_script(script, policy)` plays a `TurnScript` through the
engine (the tool loop, or a one-model generation turn for a script holding a provider key) on
a `VirtualClock`, with the kit's hostile channel, provider and tools, and returns a
`ScriptRun` holding the result and every witness the invariant checker reads
(`ScriptRun.check()`). `build_tools` builds the scripted tools a script's plan drives.

A policy with drafting or the tool checkpoint on gets a `ScriptedReviewer` playing the
script's ``reviews``, watched by `WitnessedReviewer`: each time it is asked, what it was
asked and how many deliveries the channel had confirmed (and begun) by then
(`ReviewAsked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import attrs
from attrs import define
from attrs import field

from toolloop_fsm.attempts import Attempt
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.pump import run_generation_turn
from toolloop_fsm.pump import run_tool_loop
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TraceStep
from toolloop_fsm.review import Reviewer
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import Verdict
from toolloop_fsm.testing._lazy_names import HARNESS_NAMES
from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import VirtualClock
from toolloop_fsm.testing.hostile import HostileChannel
from toolloop_fsm.testing.hostile import HostileProvider
from toolloop_fsm.testing.hostile import RogueBaseException
from toolloop_fsm.testing.hostile import Stragglers
from toolloop_fsm.testing.hostile import TurnDidNotReturn
from toolloop_fsm.testing.hostile import fire_from_thread
from toolloop_fsm.testing.hostile import mutate_in_place
from toolloop_fsm.testing.hostile import returns_within
from toolloop_fsm.testing.invariants import InvariantViolation
from toolloop_fsm.testing.invariants import ReviewAsked
from toolloop_fsm.testing.invariants import ToolExecution
from toolloop_fsm.testing.invariants import check_invariants
from toolloop_fsm.testing.reviewer import ScriptedReviewer
from toolloop_fsm.testing.strategies import DEFAULT_BEHAVIOUR
from toolloop_fsm.testing.strategies import TimedSignal
from toolloop_fsm.testing.strategies import ToolAction
from toolloop_fsm.testing.strategies import ToolBehaviour
from toolloop_fsm.testing.strategies import ToolConfig
from toolloop_fsm.testing.strategies import TurnScript
from toolloop_fsm.tools import copy_arguments

__all__ = list(HARNESS_NAMES)


# --------------------------------------------------------------------------- running a script
@define
class ScriptRun:
    """One finished simulated turn and every witness the invariant checker uses."""

    script: TurnScript
    policy: LoopPolicy
    request: TurnRequest
    result: GenerationTurnResult
    channel: HostileChannel
    provider: HostileProvider
    tools: ToolRegistry
    #: per provider pass, the chunks the provider actually yielded (a call's arguments as
    #: they were when it was yielded, before any tool could touch them)
    streamed: tuple[tuple[Chunk, ...], ...]
    #: every tool handler start, in order
    executions: tuple[ToolExecution, ...]
    #: virtual seconds from the start of the run to its result
    elapsed: float
    #: (virtual instant, kind) of each host signal that fired before the result
    signals_fired: tuple[tuple[float, str], ...] = field(default=())
    #: what each signal call raised (a signal fired from another thread must not raise)
    signal_errors: tuple[BaseException, ...] = field(default=())
    #: host code (tools, channel calls) still running when the turn returned, as the engine
    #: names a call it abandons
    running_at_return: tuple[str, ...] = field(default=())
    #: the library's log records during the run (captured when the provider holds a key)
    log_text: str = ""
    #: every time the reviewer was asked (drafting, the tool checkpoint), in order
    reviews_asked: tuple[ReviewAsked, ...] = field(default=())

    def check(self) -> None:
        """Run `check_invariants` with every witness; raises `InvariantViolation`."""
        check_invariants(
            self.result,
            policy=self.policy,
            channel=self.channel,
            provider=self.provider,
            executions=self.executions,
            elapsed=self.elapsed,
            streamed=self.streamed,
            tools=self.tools,
            request=self.request,
            keys=(self.script.provider_key,) if self.script.provider_key else (),
            log_text=self.log_text,
            running_at_return=self.running_at_return,
            signal_errors=self.signal_errors,
            reviews_asked=self.reviews_asked if self.reviewed else None,
        )

    @property
    def reviewed(self) -> bool:
        """The policy turned drafting or the tool checkpoint on: a reviewer was given."""
        return self.policy.drafting or self.policy.review_tool_calls


class _TapProvider:
    """Wraps the scripted provider and records every chunk it actually yields, per pass
    (what the provider *reported*, independent of what the engine did with it). The engine
    is handed a call with a deep copy of its arguments, the record keeps the script's own:
    a tool that mutates the arguments it was handed rewrites neither the witness nor the
    drawn script (and the shared menus it came from)."""

    def __init__(self, inner: HostileProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.continuation_style = inner.continuation_style
        self.streamed: list[list[Chunk]] = []

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        chunks: list[Chunk] = []
        self.streamed.append(chunks)
        return self._tap(self.inner.stream(request), chunks)

    async def _tap(self, source: AsyncIterator[Chunk], chunks: list[Chunk]) -> AsyncIterator[Chunk]:
        try:
            async for chunk in source:
                chunks.append(chunk)
                yield _snapshot(chunk)
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):
                    await aclose()


class WitnessedReviewer:
    """A `Reviewer` that records, each time it is asked, a `ReviewAsked`: the packet's kind,
    candidate and proposed call, the instant, and how many deliveries ``channel`` had
    confirmed (and, for a `HostileChannel`, begun) by then; then answers as ``inner`` does.
    The invariant checker reads these to tell that nothing held reached the user before
    the reviewer was asked. ``attempt`` says which attempt of a generation turn asks."""

    def __init__(
        self,
        inner: Reviewer,
        channel: RecordingChannel,
        clock: VirtualClock,
        *,
        attempt: Callable[[], int] | None = None,
    ) -> None:
        self.inner = inner
        self.channel = channel
        self.clock = clock
        self.attempt = attempt
        self.asked: list[ReviewAsked] = []

    async def review(self, packet: ReviewPacket) -> Verdict:
        channel = self.channel
        begun = None
        if isinstance(channel, HostileChannel):
            begun = sum(1 for call in channel.calls if call.method in _SEND_METHODS)
        proposed = packet.proposed_call
        asked = ReviewAsked(
            kind=packet.kind,
            at=self.clock.now(),
            delivered_before=len(channel.delivered),
            sends_before=begun,
            candidate=packet.candidate,
            call=proposed.name if proposed is not None else None,
            correction=proposed is not None and proposed.correction,
            reviews_done=packet.revision.reviews_done,
            revisions_done=packet.revision.revisions_done,
            attempt=self.attempt() if self.attempt is not None else 0,
        )
        self.asked.append(asked)
        try:
            verdict = await self.inner.review(packet)
        finally:
            asked.ended_at = self.clock.now()
        asked.answered = True
        return verdict


_SEND_METHODS = frozenset({"send_text", "send_expression"})


def _snapshot(chunk: Chunk) -> Chunk:
    if isinstance(chunk, FunctionCall) and isinstance(chunk.arguments, dict | list):
        return attrs.evolve(chunk, arguments=copy_arguments(chunk.arguments))
    return chunk


class _ScriptedTools:
    """The scripted tools of one run: each plays its plan from the script and records every
    execution (with whether a stop had been requested at that instant); a tool that ignores
    its cancellation waits on ``stragglers``."""

    __slots__ = ("calls", "clock", "executions", "plans", "signals", "stragglers")

    def __init__(
        self,
        script: TurnScript,
        clock: VirtualClock,
        signals: TurnSignals,
        executions: list[ToolExecution],
        stragglers: Stragglers,
    ) -> None:
        self.plans = {tool.name: script.plan_for(tool.name) for tool in script.tool_configs}
        self.calls = dict.fromkeys(self.plans, 0)
        self.clock = clock
        self.signals = signals
        self.executions = executions
        self.stragglers = stragglers

    async def run(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        plan = self.plans[name]
        calls = self.calls[name]
        self.calls[name] = calls + 1
        behaviour = plan[calls] if calls < len(plan) else DEFAULT_BEHAVIOUR
        execution = ToolExecution(
            name,
            copy_arguments(arguments),
            ctx.dispatch,
            self.clock.now(),
            self.signals.stop_requested,
            iteration=ctx.iteration,
        )
        self.executions.append(execution)
        try:
            return await _act_out(behaviour, name, arguments, ctx, execution, self.stragglers)
        finally:
            execution.ended_at = self.clock.now()


def _registry(handler: Callable[[str], Any], configs: Sequence[ToolConfig]) -> ToolRegistry:
    """The registry of `KNOWN_TOOLS`, each registered as ``configs`` say and handled by
    ``handler(name)``."""
    return ToolRegistry(
        Tool(
            config.name,
            f"scripted {config.name}",
            {"type": "object", "properties": {}},
            handler(config.name),
            requires_follow_up=config.requires_follow_up,
            timeout=config.timeout,
            replay=config.replay,
            sequential=config.sequential,
            repeatable=config.repeatable,
        )
        for config in configs
    )


def build_tools(
    script: TurnScript,
    *,
    clock: VirtualClock,
    signals: TurnSignals,
    executions: list[ToolExecution],
    stragglers: Stragglers | None = None,
) -> ToolRegistry:
    """The registry of `KNOWN_TOOLS`, registered as ``script.tool_configs`` say, each playing
    its plan from ``script`` and recording every execution (with whether a stop had been
    requested at that instant). A tool that ignores its cancellation waits on
    ``stragglers`` (a fresh set when not given)."""
    tools = _ScriptedTools(
        script, clock, signals, executions, stragglers if stragglers is not None else Stragglers()
    )

    def handler(name: str) -> Any:
        async def handle(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
            return await tools.run(name, arguments, ctx)

        return handle

    return _registry(handler, script.tool_configs)


#: The scripted tools of the run in progress: `run_script` sets it around its turn, whose
#: tasks (tools included) inherit it. One registry per tool configuration then serves every
#: run, as a host's tools serve every turn: building the tools (their schemas checked and
#: serialised) per run would cost more than most of what a run does.
_RUNNING: contextvars.ContextVar[_ScriptedTools] = contextvars.ContextVar("scripted_tools")


def _running_tool(name: str) -> Any:
    async def handle(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await _RUNNING.get().run(name, arguments, ctx)

    return handle


@functools.cache
def _shared_tools(configs: tuple[ToolConfig, ...]) -> ToolRegistry:
    """The one registry serving every run whose tools are registered as ``configs`` say
    (a script draws one of a few hundred configurations)."""
    return _registry(_running_tool, configs)


async def _act_out(
    behaviour: ToolBehaviour,
    name: str,
    arguments: dict[str, Any],
    ctx: ToolContext,
    execution: ToolExecution,
    stragglers: Stragglers,
) -> ToolResult:
    action = behaviour.action
    if action is ToolAction.HANG:
        await asyncio.Event().wait()
    if action is ToolAction.IGNORE_CANCELLATION:

        def noted() -> None:
            execution.cancel_ignored = True

        await stragglers.ignore_cancellation(execution.label, noted)
    if behaviour.delay > 0:
        await ctx.clock.sleep(behaviour.delay)
    execution.finished_at = ctx.clock.now()
    if action is ToolAction.RAISE:
        execution.outcome = "raised"
        raise RuntimeError(f"{name} blew up")
    if action is ToolAction.RAISE_BASE_EXCEPTION:
        execution.outcome = "raised"
        raise RogueBaseException(f"{name} gave up in its own way")
    if action is ToolAction.RAISE_GENERATOR_EXIT:
        execution.outcome = "raised"
        raise GeneratorExit(f"{name} closed itself")
    if action is ToolAction.MUTATE_ARGUMENTS:
        mutate_in_place(arguments)
    if action is ToolAction.RETURN_GARBAGE:
        execution.outcome = "failed"  # docs/behaviour.md §3.6 rule 2: not a ToolResult
        return {"not": "a ToolResult"}  # type: ignore[return-value]
    success = action is not ToolAction.FAIL
    execution.outcome = "succeeded" if success else "failed"
    return ToolResult(
        success=success,
        data=behaviour.data,
        message=behaviour.message,
        end_turn=behaviour.end_turn,
        delivered=behaviour.delivered,
        expression=behaviour.expression,
        context_restart=behaviour.context_restart if success else None,
    )


class LibraryLogCapture(logging.Handler):
    """The library's log records, each as its message and any exception text (both are
    places a key could be written), from `attach` to `detach`; meanwhile the
    ``toolloop_fsm`` logger logs from DEBUG up. Both harnesses capture with it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._logger = logging.getLogger("toolloop_fsm")
        self._previous_level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def attach(self) -> None:
        self._previous_level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)

    def detach(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._previous_level)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


#: The text of every steered or queued message a script sends.
HELD_TEXT = "one more thing"


async def run_script(
    script: TurnScript,
    policy: LoopPolicy,
    *,
    real_timeout: float | None = 30.0,
    on_step: Callable[[TraceStep], None] | None = None,
) -> ScriptRun:
    """Run ``script`` under ``policy`` through `run_tool_loop` on a fresh `VirtualClock`.

    Builds the provider (tapped, to record what it streams; an endless trickle stops past
    the policy's pass budget), a `HostileChannel` (with the script's delivery delay, failing
    delivery and plans), the tool registry, the `TurnSignals` and one task per timed signal;
    returns a `ScriptRun`. A script whose provider holds a key runs as a one-model
    generation turn (`run_generation_turn`, one key, one try), with the library's log records
    captured. ``real_timeout`` guards against a run that never returns (real seconds; a
    virtual-time run takes milliseconds), also when host code ignores its cancellation;
    ``on_step`` sees every step of the tool loop as it happens. Code that ignored its
    cancellation is released once the turn has returned, and the signal tasks are finished,
    so one event loop can run many scripts; the clock's idle-jumper task ends by itself
    once its timers are gone.

    A turn that raises an exception raises it here; one that raises a `BaseException` that
    is not the caller's cancellation (a tool's own subclass, `GeneratorExit`) breaks
    invariant 1, and one that has not returned after ``real_timeout`` breaks invariant 6
    (`InvariantViolation` for both).
    """
    clock = VirtualClock()
    signals = TurnSignals()
    stragglers = Stragglers()
    executions: list[ToolExecution] = []
    provider = HostileProvider(
        script.passes,
        clock=clock,
        api_key=script.provider_key,
        inactivity_timeout=policy.inactivity_timeout,
        # well past the pass budget and whatever slack the time bound allows
        trickle_past=2 * policy.max_pass_duration
        + policy.effective_first_token_timeout
        + max(policy.inactivity_timeout, policy.abandoned_stream_settle),
        continuation_style=script.continuation_style,
    )
    tap = _TapProvider(provider)
    channel = HostileChannel(
        clock=clock,
        host_call_timeout=policy.host_call_timeout,
        stragglers=stragglers,
        sends=script.sends,
        notices=script.notices,
        delivery_delay=script.delivery_delay,
        fail_when=_nth_delivery_fails(script.failing_delivery),
    )
    tools = _shared_tools(script.tool_configs)
    request = script.request()
    reviewer: WitnessedReviewer | None = None
    if policy.drafting or policy.review_tool_calls:
        scripted = ScriptedReviewer(script.reviews, clock=clock)
        reviewer = WitnessedReviewer(scripted, channel, clock)
    fired: list[tuple[float, str]] = []
    signal_errors: list[BaseException] = []

    def fire(signal: TimedSignal) -> None:
        if signal.kind == "stop":
            signals.request_stop(signal.stop_message)
        elif signal.kind == "steer":
            signals.steer(HELD_TEXT)
        elif signal.kind == "queue":
            signals.queue(HELD_TEXT)
        else:
            signals.follow_up()

    async def send(signal: TimedSignal) -> None:
        await clock.sleep(signal.at)
        fired.append((clock.now(), signal.kind))
        if signal.from_thread:
            raised = fire_from_thread(lambda: fire(signal))
            if raised is not None:
                signal_errors.append(raised)
        else:
            fire(signal)

    capture = LibraryLogCapture() if script.provider_key is not None else None
    if capture is not None:
        capture.attach()
    loop = asyncio.get_running_loop()
    # before any task is made or timer armed: the clock's jumper, and the timer callbacks it
    # runs (a review deadline dispatches a tool), inherit the context of the first task to
    # arm a timer
    running_tools = _RUNNING.set(_ScriptedTools(script, clock, signals, executions, stragglers))
    # strong references: the loop itself only keeps tasks weakly
    senders = [loop.create_task(send(signal)) for signal in script.signals]
    started = clock.now()
    try:
        turn = _turn(
            script, tap, tools, channel, request, policy, signals, clock, on_step, reviewer
        )
        try:
            if real_timeout is None:
                result = await turn
            else:
                result = await returns_within(
                    turn,
                    real_timeout,
                    stragglers=stragglers,
                    running=lambda: _still_running(channel, executions),
                )
        except TurnDidNotReturn as err:
            raise InvariantViolation(
                6,
                f"the run did not finish within {real_timeout:g} real seconds "
                f"(virtual time {clock.now():g}); a wait without a deadline, or host code "
                f"ignoring its cancellation awaited forever (still running: "
                f"{err.running or 'no host code'})",
            ) from None
        except (Exception, KeyboardInterrupt, SystemExit):
            raise  # an ordinary exception is reported as it is (Hypothesis shrinks on it)
        except BaseException as err:
            # a tool's own BaseException, a GeneratorExit or a stray cancellation escaping the
            # turn would stop Hypothesis itself: it is a broken invariant like any other
            task = asyncio.current_task()
            if isinstance(err, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # the caller's own cancellation
            raise InvariantViolation(
                1, f"the turn raised {type(err).__name__}: {err} instead of returning a result"
            ) from err
        elapsed = clock.now() - started
        running = tuple(_still_running(channel, executions))
    finally:
        _RUNNING.reset(running_tools)
        stragglers.release()
        if capture is not None:
            capture.detach()
        # not asyncio.all_tasks(): it walks every task not yet garbage-collected
        leftover = [task for task in senders if not task.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.gather(*leftover, return_exceptions=True)
    return ScriptRun(
        script=script,
        policy=policy,
        request=request,
        result=result,
        channel=channel,
        provider=provider,
        tools=tools,
        streamed=tuple(tuple(chunks) for chunks in tap.streamed),
        executions=tuple(executions),
        elapsed=elapsed,
        signals_fired=tuple(fired),
        signal_errors=tuple(signal_errors),
        running_at_return=running,
        log_text=capture.text if capture is not None else "",
        reviews_asked=tuple(reviewer.asked) if reviewer is not None else (),
    )


def _turn(
    script: TurnScript,
    provider: _TapProvider,
    tools: ToolRegistry,
    channel: HostileChannel,
    request: TurnRequest,
    policy: LoopPolicy,
    signals: TurnSignals,
    clock: VirtualClock,
    on_step: Callable[[TraceStep], None] | None,
    reviewer: Reviewer | None,
) -> Any:
    """The turn's coroutine: the tool loop itself, or, for a provider holding a key, a
    generation turn of one model with that one key (the tier that is given keys)."""
    if script.provider_key is None:
        return run_tool_loop(
            provider,
            tools,
            channel,
            request,
            policy=policy,
            signals=signals,
            clock=clock,
            continuation_style=script.continuation_style,
            on_step=on_step,
            reviewer=reviewer,
        )
    attempt = Attempt(lambda _key: provider, keys=(script.provider_key,), label="hostile")
    report = None if on_step is None else (lambda _attempt, step: on_step(step))
    return run_generation_turn(
        [attempt],
        tools,
        channel,
        request,
        policy=TurnPolicy(loop=policy, max_key_attempts_per_model=1),
        signals=signals,
        clock=clock,
        on_attempt_step=report,
        reviewer=reviewer,
    )


def _still_running(channel: HostileChannel, executions: Sequence[ToolExecution]) -> list[str]:
    """Host code not finished: channel calls and tool runs, named as the engine names them."""
    names = [call.label for call in channel.running()]
    names += [e.label for e in executions if e.ended_at is None]
    return names


def _nth_delivery_fails(index: int | None) -> Any:
    if index is None:
        return None
    seen = 0

    def fail_when(_text: str | None, _expression: str | None) -> bool:
        nonlocal seen
        seen += 1
        return seen - 1 == index

    return fail_when
