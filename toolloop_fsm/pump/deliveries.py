"""Deliveries and the other calls into host code (`ChannelCalls`, the part of the pump that owns
them): bounded, ordered, abandoned when they ignore their cancellation (`_HostCallGuard`,
`wait_bounded`); a notice posted within what is left of the turn's shared notice budget
(`post_notice`, over `toolloop_fsm.notice_budget`)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import types
import weakref
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Generator
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.host import Channel
from toolloop_fsm.host import Clock
from toolloop_fsm.notice_budget import SEND_NOTICE
from toolloop_fsm.notice_budget import NoticeBudget
from toolloop_fsm.notice_budget import NoticeOutcome
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import Notice

#: What is fed after the batch of effects that caused it: a delivery's outcome, a cut stream's
#: end, a cut-off tool's outcome when it had already returned
Outcome = DeliveryRecorded | DeliveryFailed | StreamEnded | ToolFinished

if TYPE_CHECKING:
    from toolloop_fsm.machine import ToolLoopMachine
    from toolloop_fsm.policy import LoopPolicy
    from toolloop_fsm.pump.deadlines import Deadlines
    from toolloop_fsm.result import GenerationTurnResult


class ChannelTurn(Protocol):
    """What the channel's calls need of the turn that makes them (`EventPump`): its channel,
    clock, machine and policy, and its hands: feed an event, end the run with a failure,
    settle its result, start a child task, give up on a child or a call."""

    channel: Channel
    clock: Clock
    machine: ToolLoopMachine
    policy: LoopPolicy

    def feed(self, event: Any) -> None: ...
    def fail(self, err: BaseException) -> None: ...
    def settle_result(self, result: GenerationTurnResult) -> None: ...
    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...
    def abandon(self, task: asyncio.Task[Any], name: str) -> InDoubtCall | None: ...
    def give_up(self, name: str) -> None: ...


class ChannelCalls:
    """A turn's calls into the host's channel: deliveries in order, notices and the stop
    message in order, each bounded by ``host_call_timeout`` and abandoned after
    ``cancel_grace`` if it ignores its cancellation; what they report is fed back to the
    machine — a delivery that completed at once after the batch of effects that made it
    (`outcomes`, which the turn feeds)."""

    __slots__ = (
        "deadlines",
        "host_calls",
        "host_exception",
        "host_task",
        "keys",
        "notices",
        "outcomes",
        "pending_result",
        "task",
        "waiting",
    )

    def __init__(
        self,
        deadlines: Deadlines,
        keys: str | None,
        notices: NoticeBudget | None,
    ) -> None:
        self.deadlines = deadlines  # a confirmed delivery restarts the inactivity budget
        # the prefix of every delivery's idempotency key (``turn_id:attempt``), when the
        # channel takes one
        self.keys = keys
        # the host-call budget the turn's notices share: the outer tier's, for an attempt,
        # else made for the turn's first notice
        self.notices = notices
        # deliveries waiting behind a send that suspended, and outcomes to report after the
        # batch that caused them: made on first use, as the other lists a turn may not need
        self.waiting: list[Deliver] | None = None
        self.task: asyncio.Task[None] | None = None  # the send that suspended, finishing
        self.host_calls: list[PostNotice | QueueStopResponse] | None = None
        self.outcomes: list[Outcome] | None = None
        self.host_task: asyncio.Task[None] | None = None  # the notices' worker
        self.host_exception: BaseException | None = None  # what a failed host call raised
        # the result waits for the host's notices and stop message still on their way
        self.pending_result: GenerationTurnResult | None = None

    def queue(self, effect: PostNotice | QueueStopResponse, turn: ChannelTurn) -> None:
        """A notice or the stop message, sent in order by the notices' worker."""
        if self.host_calls is None:
            self.host_calls = []
        self.host_calls.append(effect)
        self._ensure_host_worker(turn)

    def _notice_budget(self, turn: ChannelTurn) -> NoticeBudget:
        notices = self.notices
        if notices is None:
            notices = self.notices = NoticeBudget(turn.policy.host_call_timeout)
        return notices

    def drop_waiting(self) -> None:
        """The turn ended: the deliveries still waiting are never sent."""
        if self.waiting:
            self.waiting.clear()

    def _send(self, effect: Deliver, channel: Channel) -> Coroutine[Any, Any, None]:
        prefix = self.keys
        if prefix is None:  # the channel takes no idempotency key
            if effect.expression is not None:
                return channel.send_expression(effect.expression)
            return channel.send_text(effect.text or "")
        key = f"{prefix}:{effect.seq}"
        if effect.expression is not None:
            return channel.send_expression(  # type: ignore[call-arg]
                effect.expression, idempotency_key=key
            )
        return channel.send_text(effect.text or "", idempotency_key=key)  # type: ignore[call-arg]

    def deliver(self, effect: Deliver, turn: ChannelTurn) -> None:
        """Start a delivery eagerly: a channel that does not need to wait (a buffer, a
        queue) completes here, without a task; one that waits is finished by a task, and
        later deliveries queue behind it, in order."""
        task = self.task
        if (task is not None and not task.done()) or self.waiting or self._send_failed():
            self._waiting_deliveries().append(effect)
            return
        coroutine = self._send(effect, turn.channel)
        try:
            waiting_on = coroutine.send(None)
        except StopIteration:
            self.deadlines.last_activity = turn.clock.now()
            self.report_later(DeliveryRecorded(effect.seq))
            return
        except (KeyboardInterrupt, SystemExit) as err:
            turn.fail(err)
            return
        except BaseException as err:  # any failure of host code is the turn's `host_error`
            self.host_exception = err
            self.report_later(DeliveryFailed(effect.seq, f"{type(err).__name__}: {err}"))
            return
        self._waiting_deliveries()  # the worker takes the deliveries queued behind this one
        self.task = turn.spawn(
            self._deliver_in_order(turn, effect, _resume(coroutine, waiting_on)),
            "channel.send_expression" if effect.expression is not None else "channel.send_text",
        )

    def _send_failed(self) -> bool:
        """A send of this batch already failed (the turn is about to end ``error``): the
        deliveries after it wait in line, and are never sent."""
        outcomes = self.outcomes
        return outcomes is not None and any(type(outcome) is DeliveryFailed for outcome in outcomes)

    def _waiting_deliveries(self) -> list[Deliver]:
        deliveries = self.waiting
        if deliveries is None:
            deliveries = self.waiting = []
        return deliveries

    def report_later(self, outcome: Outcome) -> None:
        """Queue an outcome, fed once the batch of effects that caused it is carried out."""
        outcomes = self.outcomes
        if outcomes is None:
            self.outcomes = [outcome]
        else:
            outcomes.append(outcome)

    async def _deliver_in_order(
        self, turn: ChannelTurn, first: Deliver, started: Awaitable[None] | None = None
    ) -> None:
        """Deliver in order, each send bounded by the host-call budget: a send that does not
        return ends the turn ``error`` (``host_timeout``), keeping every confirmed delivery;
        one that also ignores its cancellation is abandoned after the grace."""
        deliveries = self._waiting_deliveries()
        effect: Deliver | None = first
        while effect is not None:
            seq = effect.seq
            name = (
                "channel.send_expression"
                if effect.expression is not None
                else ("channel.send_text")
            )
            task = asyncio.current_task()
            if task is not None:
                task.set_name(name)  # abandoned at the end, it is named by its call
            guard = _HostCallGuard(
                turn, name, on_abandon=partial(self._delivery_abandoned, turn, seq, name)
            )
            try:
                await (started if started is not None else self._send(effect, turn.channel))
            except asyncio.CancelledError:
                if not guard.expired:
                    raise  # the turn is over, or its caller was cancelled
                guard.taken_back()
                deliveries.clear()
                turn.feed(DeliveryFailed(seq, self._overdue_message(turn, name), timed_out=True))
                return
            except (KeyboardInterrupt, SystemExit) as err:
                turn.fail(err)
                return
            except BaseException as err:
                self.host_exception = err
                turn.feed(DeliveryFailed(seq, f"{type(err).__name__}: {err}"))
                return
            finally:
                guard.disarm()
            if guard.expired:
                guard.taken_back()  # it returned after all, before the grace ran out
            started = None
            self.deadlines.last_activity = turn.clock.now()
            turn.feed(DeliveryRecorded(seq))
            effect = deliveries.pop(0) if deliveries else None

    def _delivery_abandoned(self, turn: ChannelTurn, seq: int, name: str) -> None:
        turn.feed(DeliveryFailed(seq, self._overdue_message(turn, name), timed_out=True))

    def _overdue_message(self, turn: ChannelTurn, name: str) -> str:
        return f"{name} did not return within {turn.policy.host_call_timeout:g} s"

    def _ensure_host_worker(self, turn: ChannelTurn) -> None:
        if self.host_task is None or self.host_task.done():
            self.host_task = turn.spawn(self._call_host_in_order(turn), "channel notices")

    async def _call_host_in_order(self, turn: ChannelTurn) -> None:
        """Post notices and the stop message in order. Notices share the turn's notice budget
        (`post_notice`): one that overran it is given up on and named, and changes nothing.
        The stop message is bounded by the host-call budget. Either, failing (or the stop
        message not returning) while the turn runs, is a ``host_error``/``host_timeout``;
        after it, it is only named (a late call cannot change how the turn ended)."""
        channel = turn.channel
        calls = self.host_calls
        assert calls is not None  # the worker is started for a call
        me = asyncio.current_task()
        try:
            while calls and self.host_task is me:
                effect = calls.pop(0)
                if isinstance(effect, PostNotice):
                    if me is not None:
                        me.set_name(SEND_NOTICE)
                    self._notice_posted(
                        turn,
                        await post_notice(
                            channel,
                            effect.notice,
                            self._notice_budget(turn),
                            turn.clock,
                            turn.policy.cancel_grace,
                        ),
                    )
                    continue
                name = "channel.queue_front"
                call: Awaitable[None] = channel.queue_front(effect.stop_message)
                if me is not None:
                    me.set_name(name)  # a worker abandoned at the end is named by its call
                guard = _HostCallGuard(
                    turn, name, on_abandon=partial(self._host_worker_abandoned, turn, name)
                )
                failure: DeliveryFailed | None = None
                try:
                    await call
                except asyncio.CancelledError:
                    if not guard.expired:
                        raise
                    guard.taken_back()
                    failure = DeliveryFailed(
                        None, self._overdue_message(turn, name), timed_out=True
                    )
                except (KeyboardInterrupt, SystemExit) as err:
                    turn.fail(err)
                    return
                except BaseException as err:
                    self.host_exception = err
                    failure = DeliveryFailed(None, f"{type(err).__name__}: {err}")
                finally:
                    guard.disarm()
                if guard.expired and failure is None:
                    guard.taken_back()
                if failure is not None and not turn.machine.is_finished:
                    turn.feed(failure)
        finally:
            if self.host_task is me:
                self._host_calls_done(turn)

    def _notice_posted(self, turn: ChannelTurn, outcome: NoticeOutcome | BaseException) -> None:
        """What a notice's call came to: one given up on is named, and ends nothing; one that
        raised while the turn runs is its ``host_error``."""
        if outcome is NoticeOutcome.GIVEN_UP:
            turn.give_up(SEND_NOTICE)
            return
        if isinstance(outcome, NoticeOutcome):
            return
        if isinstance(outcome, KeyboardInterrupt | SystemExit):
            turn.fail(outcome)
            return
        self.host_exception = outcome
        if not turn.machine.is_finished:
            turn.feed(DeliveryFailed(None, f"{type(outcome).__name__}: {outcome}"))

    def _host_worker_abandoned(self, turn: ChannelTurn, name: str) -> None:
        """The host call in progress ignored its cancellation: it failed like one that did
        not return, and the worker carries on without it."""
        self.host_task = None
        if not turn.machine.is_finished:
            turn.feed(DeliveryFailed(None, self._overdue_message(turn, name), timed_out=True))
        if self.host_calls:
            self._ensure_host_worker(turn)
        else:
            self._host_calls_done(turn)

    def _host_calls_done(self, turn: ChannelTurn) -> None:
        pending = self.pending_result
        if pending is not None and not self.host_calls:
            self.pending_result = None
            turn.settle_result(pending)


async def post_notice(
    channel: Channel, notice: Notice, budget: NoticeBudget, clock: Clock, grace: float
) -> NoticeOutcome | BaseException:
    """Post ``notice`` within what is left of the turn's notice ``budget``, cancelled when it
    overruns and left behind after ``grace`` if it ignores that; what became of it, or what
    it raised. (A durable turn's channel activity calls this too, with what its workflow's
    budget has left.)"""
    if budget.spent:
        return NoticeOutcome.NOT_SENT
    call = channel.send_notice(notice)
    # its first step runs here, as a delivery's does: a channel that does not wait has shown
    # the notice before the turn's next step (the 21st pass's tool sees its still_working)
    if inspect.iscoroutine(call):
        try:
            waiting_on = call.send(None)
        except StopIteration:
            return NoticeOutcome.SHOWN
        except BaseException as err:
            return err
        task = asyncio.ensure_future(_awaited(_resume(call, waiting_on)))
    else:
        task = asyncio.ensure_future(call)
    started = clock.now()
    try:
        overran = bool(await wait_bounded(clock, [task], budget.remaining))
        if overran:
            budget.overrun()
            task.cancel()
            # it has the grace to stop; one that ignores its cancellation is left behind,
            # never awaited again (what it ends with is read, so that nothing is reported)
            if await wait_bounded(clock, [task], grace):
                task.add_done_callback(_left_behind)
    except asyncio.CancelledError:
        task.cancel()  # the turn is over, or its caller was cancelled
        raise
    finally:
        budget.spend(clock.now() - started)
    if overran:
        return NoticeOutcome.GIVEN_UP
    if task.cancelled():  # the host cancelled its own call: a failure like any other
        return asyncio.CancelledError("channel.send_notice was cancelled")
    failure = task.exception()
    return failure if failure is not None else NoticeOutcome.SHOWN


async def _awaited(started: Awaitable[None]) -> None:
    await started


def _left_behind(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _HostCallGuard:
    """Bounds one call into host code running in the current task: after the policy's
    ``host_call_timeout`` the task is cancelled (`expired`); if the host code ignores that
    for ``cancel_grace``, the task is abandoned — named, never awaited again — and
    ``on_abandon`` runs in its place."""

    __slots__ = ("_handle", "_name", "_on_abandon", "_pump", "_task", "expired")

    def __init__(
        self,
        pump: ChannelTurn,
        name: str,
        *,
        on_abandon: Callable[[], None] | None = None,
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
            self._pump.abandon(task, self._name)
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


# weakly keyed: a method patched onto one channel instance is not kept alive by this
_KEYED_METHODS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def takes_idempotency_keys(channel: object) -> bool:
    """Whether ``channel``'s ``send_text`` and ``send_expression`` take an ``idempotency_key``
    keyword (read once per method): such a channel is given a stable key with every
    delivery, so that it can drop a delivery it already made (a turn resumed after a crash
    repeats the deliveries of the pass it restarts)."""
    return all(
        _has_keyword(getattr(channel, name, None), "idempotency_key")
        for name in ("send_text", "send_expression")
    )


def _has_keyword(method: object, name: str) -> bool:
    if not callable(method):
        return False
    function = getattr(method, "__func__", method)  # the same for every instance of a class
    try:
        known = _KEYED_METHODS.get(function)
    except TypeError:  # a callable object that is not hashable
        known = None
    if known is None:
        known = _signature_has_keyword(method, name)
        with contextlib.suppress(TypeError):  # not hashable, or not weakly referable
            _KEYED_METHODS[function] = known
    return known


def _signature_has_keyword(method: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
