"""The turn's tool calls, keyed by dispatch: the running call's task, its dispatch and name,
the grace after which a call that ignores its cancellation is abandoned, the settling of a
call cut off at its deadline, and the calls in doubt (docs/behaviour.md §3.9)."""

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
    """What the tool calls need of the turn that runs them: its machine (the pending call),
    tools, clock and policy, who watches it and what its records say, its keys (masked out
    of every outcome), and a way to report an outcome after the current batch. The pump's
    own hands (`ToolPump`) are handed to each call rather than held: a finished turn is then
    freed without the cycle collector."""

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


class ToolCalls:
    """The turn's tool calls, one dispatch at a time: a call's outcome is fed only while its
    dispatch is the current one (a cancelled call's late outcome is dropped)."""

    __slots__ = ("calls", "dispatch", "grace", "in_doubt", "name", "settling", "task", "turn")

    def __init__(self, turn: ToolTurn) -> None:
        self.turn = turn
        self.task: asyncio.Task[None] | None = None
        self.dispatch = 0
        self.name = ""  # the running call's, naming its task (an abandoned one is named)
        self.grace: Any = None  # the timer abandoning a call that ignores its cancellation
        # each tool task still running, with what it runs (an abandoned one is in doubt), the
        # calls in doubt, and the settling of a call cut off at its deadline (§3.9)
        self.calls: dict[asyncio.Task[None], InDoubtCall] | None = None
        self.in_doubt: list[InDoubtCall] | None = None
        self.settling: asyncio.Task[None] | None = None

    def run(self, effect: RunTool, iteration: int, pump: ToolPump) -> None:
        turn = self.turn
        self.dispatch = effect.dispatch
        self.name = f"tool {effect.name} (dispatch {effect.dispatch})"
        observation = turn.observation
        if observation is not None:
            call = turn.machine.turn.tool_round.pending_call
            call_id = call.call_id if call is not None else None
            observation.tool_started(effect, call_id if isinstance(call_id, str) else None)
        task = self.task = pump.spawn(self._call(effect, iteration, pump), self.name)
        # what the task runs, should it be abandoned: then the call is in doubt (§3.9)
        call = turn.machine.turn.tool_round.pending_call
        call_id = call.call_id if call is not None and isinstance(call.call_id, str) else None
        calls = self.calls
        if calls is None:
            calls = self.calls = {}
        calls[task] = InDoubtCall(effect.name, effect.dispatch, call_id, InDoubtCause.ABANDONED)
        task.add_done_callback(lambda done: calls.pop(done, None))

    def cancel(self, effect: CancelTool, iteration: int, pump: ToolPump) -> None:
        turn = self.turn
        if turn.observation is not None:
            turn.observation.tool_cancelled(self.dispatch)
        self.dispatch = -1
        settling = self.settling
        if settling is not None:  # a stop while a cut-off call is settled: it ends here
            self.settling = None
            settling.cancel()
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            if effect.cut_off is not None:
                # its outcome is owed: the grace to stop, then settled (§3.9 rule 2)
                name = f"settling {self.name}"
                self.settling = pump.spawn(
                    self._settle_cut_off(effect, task, iteration, pump), name
                )
                return
            # a tool that ignores its cancellation is abandoned after the grace
            self.grace = turn.clock.call_later(
                turn.policy.cancel_grace, self._abandon_unless_done, task, self.name, pump
            )
        elif effect.cut_off is not None:  # it had just returned: its deadline's outcome
            failed = ToolFinished(effect.dispatch, ToolOutcomeKind.RAISED, error=effect.cut_off)
            turn.report_later(failed)

    def abandoned(self, task: asyncio.Task[Any]) -> InDoubtCall | None:
        """``task`` was given up on: the call it ran, if it ran one, is in doubt (listed)."""
        calls = self.calls
        in_doubt = calls.pop(task, None) if calls is not None else None
        if in_doubt is not None:
            if self.in_doubt is None:
                self.in_doubt = []
            self.in_doubt.append(in_doubt)
        return in_doubt

    def stop(self) -> None:
        """The turn is over: the running call and a settling are cancelled."""
        for task in (self.task, self.settling):
            if task is not None and not task.done():
                task.cancel()

    def cancel_grace(self) -> None:
        if self.grace is not None:
            self.grace.cancel()
        self.grace = None

    def _abandon_unless_done(self, task: asyncio.Task[Any], name: str, pump: ToolPump) -> None:
        if not task.done():
            pump.abandon(task, name)

    async def _settle_cut_off(
        self, effect: CancelTool, task: asyncio.Task[None], iteration: int, pump: ToolPump
    ) -> None:
        """docs/behaviour.md §3.9 rule 2: a call with a reconcile hook, cancelled at its
        deadline, has the grace to stop (its outcome is then that timeout); one that does
        not is abandoned, in doubt, and its hook asks what really happened before the
        machine is told."""
        turn = self.turn
        dispatch = effect.dispatch
        cut_off = effect.cut_off
        assert cut_off is not None
        policy = turn.policy
        event: ToolFinished
        if not await wait_bounded(turn.clock, (task,), policy.cancel_grace):
            event = ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=cut_off)
        else:
            in_doubt = pump.abandon(task, task.get_name())
            call = turn.machine.turn.tool_round.pending_call
            tool = turn.registry.get(str(call.name)) if call is not None else None
            answer: ToolFinished | None = None
            if tool is not None and call is not None and isinstance(call.arguments, Mapping):
                ctx = ToolContext(
                    tool.name,
                    dispatch,
                    iteration,
                    turn.clock,
                    turn.machine.turn.disabled_enrichment_kinds,
                )
                try:
                    answer = await reconcile_call(
                        tool,
                        dispatch,
                        own_copy(call.arguments),
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
        if self.settling is asyncio.current_task():
            self.settling = None
            pump.feed(event)

    def _settled(self, call: InDoubtCall, *, reconciled: bool) -> None:
        """Record how a call in doubt was settled, in its place in the list."""
        settled = attrs.evolve(call, reconciled=reconciled)
        listed = self.in_doubt
        if listed is not None and call in listed:
            listed[listed.index(call)] = settled
        self.turn.records.settled(settled)

    async def _call(self, effect: RunTool, iteration: int, pump: ToolPump) -> None:
        turn = self.turn
        tool = turn.registry.get(effect.name)
        event: ToolFinished
        if tool is None:  # the machine only dispatches registered tools; keep it a value
            event = ToolFinished(effect.dispatch, ToolOutcomeKind.RAISED, error="unknown tool")
        else:
            arguments = own_copy(effect.arguments)
            ctx = ToolContext(
                effect.name,
                effect.dispatch,
                iteration,
                turn.clock,
                turn.machine.turn.disabled_enrichment_kinds,
            )
            deadline = tool.timeout if tool.timeout is not None else turn.policy.tool_timeout
            try:
                event = await run_tool_handler(
                    tool, effect.dispatch, arguments, ctx, deadline=deadline
                )
            except (KeyboardInterrupt, SystemExit) as err:
                # the process is going down: end the run with it, children cancelled first
                pump.fail(err)
                return
            # what the tool said may quote a key: masked before the observers and the
            # machine (and so the history, the channel and the next request) see it
            event = turn.secrets.masked_outcome(event)
        if effect.dispatch == self.dispatch:
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
