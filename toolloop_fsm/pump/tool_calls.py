"""The turn's tool calls, keyed by dispatch: each running call's task, name and call id, the
token of its deadline, the grace after which a call that ignores its cancellation is
abandoned, the settling of a call cut off at its deadline, and the calls in doubt
(docs/behaviour.md §3.9, §3.10). The calls of one tool batch run at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Mapping
from typing import Any
from typing import Protocol

import attrs

from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import RunTool
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.host import Clock
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import call_idempotency_key
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.pump.deliveries import Outcome
from toolloop_fsm.pump.deliveries import wait_bounded
from toolloop_fsm.pump.observing import Observation
from toolloop_fsm.pump.records import TurnRecords
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.tools import copy_arguments
from toolloop_fsm.tools import reconcile_call
from toolloop_fsm.tools import run_tool_handler
from toolloop_fsm.tools import unknown_outcome


@attrs.frozen
class ToolTurn:
    """What the tool calls need of the turn that runs them: its machine (the enrichment kinds
    a call's context carries), tools, clock and policy, who watches it and what its records
    say, its keys (masked out of every outcome), and a way to report an outcome after the
    current batch. Each call's name, arguments, call id and deadline come with its `RunTool`,
    never from the machine: several calls run at once. The pump's own hands (`ToolPump`) are
    handed to each call rather than held: a finished turn is then freed without the cycle
    collector."""

    machine: ToolLoopMachine
    registry: ToolRegistry
    clock: Clock
    policy: LoopPolicy
    observation: Observation | None
    records: TurnRecords
    secrets: Secrets
    report_later: Callable[[Outcome], None]


class ToolPump(Protocol):
    """The pump's hands the tool calls use: start a child task, feed an event, end the run
    with a failure, give up on a child."""

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...
    def feed(self, event: Any) -> None: ...
    def fail(self, err: BaseException) -> None: ...
    def abandon(self, task: asyncio.Task[Any], name: str) -> InDoubtCall | None: ...


class RunningCall:
    """One dispatch the shell still holds: the `RunTool` it carries out, its task's name
    (an abandoned call is named by it), the task, whether its own outcome is still fed to
    the machine (a cancelled call's is dropped), the token of its ``TOOL`` deadline, the
    timer abandoning it if it ignores its cancellation, the settling of its outcome after a
    cut-off (§3.9 rule 2), and whether it was abandoned."""

    __slots__ = ("abandoned", "deadline", "effect", "grace", "name", "owed", "settling", "task")

    def __init__(self, effect: RunTool, name: str) -> None:
        self.effect = effect
        self.name = name
        self.task: asyncio.Task[None] | None = None
        self.owed = True
        self.deadline: int | None = None
        self.grace: Any = None
        self.settling: asyncio.Task[None] | None = None
        self.abandoned = False

    def as_in_doubt(self) -> InDoubtCall:
        """The call as listed in doubt once it is abandoned (§3.9)."""
        effect = self.effect
        return InDoubtCall(effect.name, effect.dispatch, effect.call_id, InDoubtCause.ABANDONED)


class ToolCalls:
    """The turn's tool calls, keyed by dispatch: the calls of one tool batch run at once,
    each with its own task, deadline, grace and settling. A call's outcome is fed while the
    machine still waits for it; a cancelled call's late outcome is dropped, and cancelling
    one call leaves its siblings running (docs/behaviour.md §3.10 rules 2 and 5)."""

    __slots__ = ("in_doubt", "running", "turn", "unpaired")

    def __init__(self, turn: ToolTurn) -> None:
        self.turn = turn
        # each dispatch the shell still holds, in dispatch order: running, cancelled and not
        # yet stopped, or being settled after a cut-off
        self.running: dict[int, RunningCall] = {}
        # the calls in doubt (§3.9), in the order they were given up on
        self.in_doubt: list[InDoubtCall] | None = None
        # ``TOOL`` deadline tokens armed before the dispatch they bound was started
        self.unpaired: list[int] | None = None

    def run(self, effect: RunTool, iteration: int, pump: ToolPump) -> None:
        turn = self.turn
        dispatch = effect.dispatch
        call = RunningCall(effect, f"tool {effect.name} (dispatch {dispatch})")
        if turn.observation is not None:
            turn.observation.tool_started(effect)
        self.running[dispatch] = call
        if self.unpaired:
            call.deadline = self.unpaired.pop(0)
        call.task = pump.spawn(self._call(call, iteration, pump), call.name)

    def deadline_armed(self, token: int) -> None:
        """The machine armed a ``TOOL`` deadline: it bounds the earliest dispatch without
        one, or, armed before its call was started, the next one started. (The machine arms
        each call's deadline as it starts the call, its calls and deadlines in the same
        order, whichever of the two it emits first.)"""
        for call in self.running.values():
            if call.deadline is None and call.owed:
                call.deadline = token
                return
        if self.unpaired is None:
            self.unpaired = []
        self.unpaired.append(token)

    def with_deadline(self, token: int) -> RunningCall | None:
        """The call whose ``TOOL`` deadline has ``token`` (the one that expired names it)."""
        for call in self.running.values():
            if call.deadline == token:
                return call
        return None

    def cancel(self, effect: CancelTool, iteration: int, pump: ToolPump) -> None:
        """Cancel dispatch ``effect.dispatch`` alone: its siblings keep running."""
        turn = self.turn
        dispatch = effect.dispatch
        if turn.observation is not None:
            turn.observation.tool_cancelled(dispatch)
        call = self.running.get(dispatch)
        task = call.task if call is not None else None
        if call is None or task is None or task.done() or call.abandoned:
            if call is not None:
                self._stopped_settling(call)
                call.owed = False
                self._release(call)
            if effect.cut_off is not None:  # it had just returned: its deadline's outcome
                failed = ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=effect.cut_off)
                turn.report_later(failed)
            return
        call.owed = False
        self._stopped_settling(call)
        if call.grace is not None:
            return  # cancelled before, and given its grace then
        task.cancel()
        if effect.cut_off is not None:
            # its outcome is owed: the grace to stop, then settled (§3.9 rule 2)
            call.settling = pump.spawn(
                self._settle_cut_off(call, effect.cut_off, iteration, pump),
                f"settling {call.name}",
            )
            return
        # a tool that ignores its cancellation is abandoned after the grace; one that stops
        # is let go then (and its timer with it)
        call.grace = turn.clock.call_later(
            turn.policy.cancel_grace, self._abandon_unless_done, call, pump
        )
        task.add_done_callback(lambda _done: self._release(call))

    def abandoned(self, task: asyncio.Task[Any]) -> InDoubtCall | None:
        """``task`` was given up on: the call it ran, if it ran one, is in doubt (listed)."""
        for call in self.running.values():
            if call.task is task:
                break
        else:
            return None
        in_doubt = call.as_in_doubt()
        call.abandoned = True
        call.owed = False
        self._release(call)
        if self.in_doubt is None:
            self.in_doubt = []
        self.in_doubt.append(in_doubt)
        return in_doubt

    def stop(self) -> None:
        """The turn is over: every running call and every settling is cancelled."""
        for call in self.running.values():
            call.owed = False
            for task in (call.task, call.settling):
                if task is not None and not task.done():
                    task.cancel()

    def cancel_graces(self) -> None:
        """Disarm every call's grace timer (the turn's timers go when it returns)."""
        for call in self.running.values():
            if call.grace is not None:
                call.grace.cancel()
                call.grace = None

    def _stopped_settling(self, call: RunningCall) -> None:
        settling = call.settling
        if settling is not None:  # a stop while a cut-off call is settled: it ends here
            call.settling = None
            settling.cancel()

    def _release(self, call: RunningCall) -> None:
        """Let go of a call the shell no longer owes anything: its outcome fed or dropped,
        its task done or abandoned, no settling under way."""
        task = call.task
        if call.owed or call.settling is not None:
            return
        if not call.abandoned and task is not None and not task.done():
            return
        running = self.running
        dispatch = call.effect.dispatch
        if running.get(dispatch) is call:
            del running[dispatch]
        if call.grace is not None:
            call.grace.cancel()
            call.grace = None

    def _abandon_unless_done(self, call: RunningCall, pump: ToolPump) -> None:
        call.grace = None
        task = call.task
        if task is not None and not task.done():
            pump.abandon(task, call.name)

    async def _settle_cut_off(
        self, call: RunningCall, cut_off: str, iteration: int, pump: ToolPump
    ) -> None:
        """docs/behaviour.md §3.9 rule 2: a call with a reconcile hook, cancelled at its
        deadline, has the grace to stop (its outcome is then that timeout); one that does
        not is abandoned, in doubt, and its hook asks what really happened before the
        machine is told."""
        turn = self.turn
        effect = call.effect
        dispatch = effect.dispatch
        task = call.task
        assert task is not None
        policy = turn.policy
        event: ToolFinished
        if not await wait_bounded(turn.clock, (task,), policy.cancel_grace):
            event = ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=cut_off)
        else:
            in_doubt = pump.abandon(task, call.name)
            tool = turn.registry.get(effect.name)
            answer: ToolFinished | None = None
            if tool is not None:
                ctx = self._context(effect, iteration)
                try:
                    answer = await reconcile_call(
                        tool,
                        dispatch,
                        own_copy(effect.arguments),
                        ctx,
                        budget=policy.host_call_timeout,
                        clock=turn.clock,
                    )
                except (KeyboardInterrupt, SystemExit) as err:
                    pump.fail(err)
                    return
            name = tool.name if tool is not None else "the tool"
            if answer is None:
                cause = (
                    f"it {cut_off} and was cancelled, and it had not stopped "
                    f"{policy.cancel_grace:g} s later"
                )
                event = attrs.evolve(unknown_outcome(name, cause), dispatch=dispatch)
            else:
                event = turn.secrets.masked_outcome(answer)
            if in_doubt is not None:
                self._settled(in_doubt, reconciled=answer is not None)
        if call.settling is asyncio.current_task():
            call.settling = None
            self._release(call)
            pump.feed(event)

    def _context(self, effect: RunTool, iteration: int) -> ToolContext:
        """What the tool is told of its call ``effect`` (and a reconciler of its own)."""
        turn = self.turn
        state = turn.machine.turn
        return ToolContext(
            effect.name,
            effect.dispatch,
            iteration,
            turn.clock,
            state.disabled_enrichment_kinds,
            call_idempotency_key(state.request.turn_id, effect.call_key),
        )

    def _settled(self, call: InDoubtCall, *, reconciled: bool) -> None:
        """Record how a call in doubt was settled, in its place in the list."""
        settled = attrs.evolve(call, reconciled=reconciled)
        listed = self.in_doubt
        if listed is not None and call in listed:
            listed[listed.index(call)] = settled
        self.turn.records.settled(settled)

    async def _call(self, call: RunningCall, iteration: int, pump: ToolPump) -> None:
        turn = self.turn
        effect = call.effect
        dispatch = effect.dispatch
        tool = turn.registry.get(effect.name)
        event: ToolFinished
        if tool is None:  # the machine only dispatches registered tools; keep it a value
            event = ToolFinished(dispatch, ToolOutcomeKind.RAISED, error="unknown tool")
        else:
            arguments = own_copy(effect.arguments)
            ctx = self._context(effect, iteration)
            deadline = effect.timeout
            if deadline is None:
                deadline = tool.timeout if tool.timeout is not None else turn.policy.tool_timeout
            try:
                event = await run_tool_handler(tool, dispatch, arguments, ctx, deadline=deadline)
            except (KeyboardInterrupt, SystemExit) as err:
                # the process is going down: end the run with it, children cancelled first
                pump.fail(err)
                return
            # what the tool said may quote a key: masked before the observers and the
            # machine (and so the history, the channel and the next request) see it
            event = turn.secrets.masked_outcome(event)
        if call.owed:
            call.owed = False
            running = self.running
            if running.get(dispatch) is call:
                del running[dispatch]
            if turn.observation is not None:
                turn.observation.tool_finished(event)
            pump.feed(event)


def own_copy(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's own copy of a call's arguments (`copy_arguments`); a host-built oddity
    that cannot be deep-copied is copied shallowly."""
    try:
        return {key: copy_arguments(value) for key, value in arguments.items()}
    except Exception:
        return dict(arguments)
