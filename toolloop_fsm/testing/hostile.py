"""Hostile host behaviours for the test kit: the unkind world a turn must survive.

A turn promises to end whatever the host's code does, to keep every delivery the channel
confirmed, to run no tool twice and to leak no key. The kind world of `RecordingChannel`
and `ScriptedProvider` never tries those promises, so this module holds the host behaviours
that do, as plain values the strategies draw and the regression tests name:

* `ChannelAct`: what one channel call does — confirm, raise, hang, take a while (within or
  over the policy's ``host_call_timeout``), or ignore its cancellation (catch
  `asyncio.CancelledError` and go on waiting). `HostileChannel` plays a plan of them per
  kind of call and records every call (`HostCall`) with when it started and how it ended.
* Tools: `RogueBaseException` (a host's own `BaseException` subclass), `mutate_in_place`
  (a tool that edits the arguments it was handed), and `Stragglers.ignore_cancellation`
  (code that swallows every cancellation until the kit releases it after the turn).
* Providers: `HostileProvider` plays the script items of `ScriptedProvider` plus `EchoKey`
  (an error message that quotes the provider's API key: whole, its first characters, in a
  URL query, or inside a non-provider exception) and `Trickle` (one chunk a little inside
  every inactivity window, forever).
* Signals: `fire_from_thread` calls a `TurnSignals` method from a real `threading.Thread`,
  joined at once, so a test can fire it at an exact virtual instant and stay deterministic.
* `returns_within`: a real-time guard that survives code ignoring cancellation (a plain
  `asyncio.timeout` cannot: its one cancellation is swallowed and the wait goes on).
* `key_runs` / `leaked_runs`: a key and every 8-character run of it, for secrecy checks.

Code that ignores cancellation is released by the kit once the turn has returned (it then
ends by raising `asyncio.CancelledError`, recording nothing), so that no event loop is left
with a task that can never finish.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from enum import StrEnum
from typing import Any
from typing import TypeVar

from attrs import define
from attrs import frozen

from toolloop_fsm.events import Chunk
from toolloop_fsm.events import TextDelta
from toolloop_fsm.host import Clock
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import Notice
from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import watchdog_timer
from toolloop_fsm.testing.scripted import Fail
from toolloop_fsm.testing.scripted import Pause
from toolloop_fsm.testing.scripted import ScriptedProvider
from toolloop_fsm.testing.scripted import ScriptItem

__all__ = [
    "HANG_GUARD_SECONDS",
    "KEY_RUN",
    "ChannelAct",
    "EchoKey",
    "HostCall",
    "HostileChannel",
    "HostileItem",
    "HostileProvider",
    "KeyEcho",
    "RogueBaseException",
    "Stragglers",
    "Trickle",
    "TurnDidNotReturn",
    "fire_from_thread",
    "key_runs",
    "leaked_runs",
    "mutate_in_place",
    "returns_within",
]

_T = TypeVar("_T")

#: The length of a key run that counts as a leak: a server that echoes a key's first
#: characters, or a log line that cuts one, gives away most of it.
KEY_RUN = 8

#: Real seconds a virtual-time turn may take before `returns_within` calls it hung. A turn
#: takes milliseconds; the guard only tells a hang from a turn, and is generous because a
#: machine with every core busy can starve one process for seconds (3 s once tripped a
#: property run that way: the same example then passed twenty times out of twenty).
HANG_GUARD_SECONDS = 10.0


# --------------------------------------------------------------------------- stragglers
class Stragglers:
    """Code that ignores cancellation, held until the kit releases it.

    `ignore_cancellation(label)` waits until `release()`, catching every
    `asyncio.CancelledError` on the way (and noting that it did); once released it gives up
    by raising `asyncio.CancelledError`, so a straggler never completes its work.
    ``cancel_ignored`` names each straggler that swallowed at least one cancellation, in the
    order they first did.
    """

    def __init__(self) -> None:
        self._released = asyncio.Event()
        self.cancel_ignored: list[str] = []
        self.waiting: list[str] = []

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def release(self) -> None:
        self._released.set()

    async def ignore_cancellation(
        self, label: str, on_cancel: Callable[[], None] | None = None
    ) -> None:
        self.waiting.append(label)
        cancelled = False
        try:
            while not self._released.is_set():
                try:
                    await self._released.wait()
                except asyncio.CancelledError:
                    if not cancelled:
                        cancelled = True
                        self.cancel_ignored.append(label)
                        if on_cancel is not None:
                            on_cancel()
                    # hostile on purpose: the cancellation is swallowed and the wait goes on
        finally:
            self.waiting.remove(label)
        raise asyncio.CancelledError


class TurnDidNotReturn(AssertionError):
    """A turn did not return within its real-time guard; ``running`` names the host code
    still running when the guard expired."""

    def __init__(self, message: str, running: str = "") -> None:
        super().__init__(message)
        self.running = running


async def returns_within(
    turn: Awaitable[_T],
    real_seconds: float,
    *,
    stragglers: Stragglers | None = None,
    running: Callable[[], Iterable[str]] | None = None,
) -> _T:
    """Await ``turn`` for at most ``real_seconds`` of real time; raise `TurnDidNotReturn` if
    it has not returned by then.

    The turn runs as its own task, so the guard does not depend on the turn honouring a
    cancellation: on expiry the ``stragglers`` are released first (so a turn stuck awaiting
    them can unwind), then the turn is cancelled and given one more bounded wait.
    ``running`` names the host code still running at that moment, for the message.
    """
    task = asyncio.ensure_future(turn)
    try:
        await _wait_real(task, real_seconds)
    except BaseException:
        task.cancel()
        raise
    if task.done():
        return task.result()
    names = ", ".join(running()) if running is not None else ""
    if stragglers is not None:
        stragglers.release()
    task.cancel()
    await _wait_real(task, real_seconds)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: what it raised while unwinding is not the finding
    raise TurnDidNotReturn(
        f"the turn did not return within {real_seconds:g} real seconds: a wait without a "
        "deadline, or host code that ignored its cancellation and was awaited forever "
        f"(host code still running: {names or 'none'})",
        names,
    )


async def _wait_real(task: asyncio.Future[Any], real_seconds: float) -> None:
    """Wait for ``task`` at most ``real_seconds``, with a watchdog a `VirtualClock` ignores.
    (A future woken by either, not `asyncio.wait`: this runs once per simulated turn, and
    `asyncio.wait` costs several times as much.)"""
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(_done: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    handle = watchdog_timer(real_seconds, wake)
    task.add_done_callback(wake)
    try:
        await woken
    finally:
        handle.cancel()
        task.remove_done_callback(wake)


# --------------------------------------------------------------------------- the channel
class ChannelAct(StrEnum):
    """What one call into the host's channel does."""

    CONFIRM = "confirm"
    RAISE = "raise"
    HANG = "hang"
    SLOW_WITHIN = "slow_within"
    SLOW_OVER = "slow_over"
    IGNORE_CANCELLATION = "ignore_cancellation"


#: How long a slow call takes, as a share of the policy's ``host_call_timeout``.
SLOW_WITHIN_SHARE = 0.5
SLOW_OVER_SHARE = 2.0


@define
class HostCall:
    """One call into the host's channel: which method, when it started and ended (virtual
    seconds), and how (``confirmed``, ``raised``, ``cancelled``; ``None`` while running).
    ``cancel_ignored`` says it swallowed a cancellation."""

    method: str
    act: ChannelAct
    started_at: float
    finished_at: float | None = None
    outcome: str | None = None
    cancel_ignored: bool = False

    @property
    def label(self) -> str:
        """How the engine names this call when it abandons it."""
        return f"channel.{self.method}"


_SENDS = ("send_text", "send_expression")


class HostileChannel(RecordingChannel):
    """A `RecordingChannel` whose calls follow a plan of `ChannelAct` values.

    ``sends`` is the act of the 1st, 2nd, … delivery (text or expression), ``notices`` of
    the 1st, 2nd, … notice or stop message, ``hooks`` of the outer tier's
    ``attempt_superseded`` marks; past its plan every call confirms. A confirming send takes
    the channel's ``delivery_delay``; a delivery is recorded only once its send returns, as a
    real channel confirms it, so ``delivered`` is exactly what the channel confirmed. Every
    call is kept in ``calls``.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        host_call_timeout: float,
        stragglers: Stragglers,
        sends: Sequence[ChannelAct] = (),
        notices: Sequence[ChannelAct] = (),
        hooks: Sequence[ChannelAct] = (),
        delivery_delay: float = 0.0,
        fail_when: Callable[[str | None, str | None], bool] | None = None,
        on_delivery: Callable[[Delivered], None] | None = None,
    ) -> None:
        super().__init__(
            clock=clock,
            delivery_delay=delivery_delay,
            fail_when=fail_when,
            on_delivery=on_delivery,
        )
        self.turn_clock = clock
        self.host_call_timeout = host_call_timeout
        self.stragglers = stragglers
        self.plans: dict[str, tuple[ChannelAct, ...]] = {
            "send": tuple(sends),
            "notice": tuple(notices),
            "hook": tuple(hooks),
        }
        self._counts = {"send": 0, "notice": 0, "hook": 0}
        self.calls: list[HostCall] = []
        self.superseded: list[tuple[int, str, str]] = []

    def running(self) -> list[HostCall]:
        return [call for call in self.calls if call.outcome is None]

    def _next_act(self, kind: str) -> ChannelAct:
        plan = self.plans[kind]
        index = self._counts[kind]
        self._counts[kind] = index + 1
        return plan[index] if index < len(plan) else ChannelAct.CONFIRM

    async def _perform(self, method: str, kind: str, confirm: Callable[[], None]) -> None:
        act = self._next_act(kind)
        call = HostCall(method, act, self.turn_clock.now())
        self.calls.append(call)
        try:
            await self._act(call, kind)
            confirm()
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            call.finished_at = self.turn_clock.now()
            raise
        except BaseException:
            call.outcome = "raised"
            call.finished_at = self.turn_clock.now()
            raise
        call.outcome = "confirmed"
        call.finished_at = self.turn_clock.now()

    async def _act(self, call: HostCall, kind: str) -> None:
        act = call.act
        if act is ChannelAct.CONFIRM:
            if kind == "send":
                await self._wait()
        elif act is ChannelAct.RAISE:
            raise ConnectionError(f"the channel refused {call.method}")
        elif act is ChannelAct.HANG:
            await asyncio.Event().wait()
        elif act is ChannelAct.SLOW_WITHIN:
            await self.turn_clock.sleep(SLOW_WITHIN_SHARE * self.host_call_timeout)
        elif act is ChannelAct.SLOW_OVER:
            await self.turn_clock.sleep(SLOW_OVER_SHARE * self.host_call_timeout)
        else:

            def noted() -> None:
                call.cancel_ignored = True

            await self.stragglers.ignore_cancellation(call.label, noted)

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        await self._perform("send_text", "send", lambda: self._confirm(idempotency_key, text=text))

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        await self._perform(
            "send_expression", "send", lambda: self._confirm(idempotency_key, expression=expression)
        )

    async def send_notice(self, notice: Notice) -> None:
        await self._perform("send_notice", "notice", lambda: self.notices.append(notice))

    async def queue_front(self, stop_message: str) -> None:
        await self._perform("queue_front", "notice", lambda: self.queued_front.append(stop_message))

    async def attempt_superseded(self, attempt: int, label: str, delivered_text: str) -> None:
        await self._perform(
            "attempt_superseded",
            "hook",
            lambda: self.superseded.append((attempt, label, delivered_text)),
        )


# --------------------------------------------------------------------------- tools
class RogueBaseException(BaseException):
    """A host's own `BaseException` subclass, raised by a tool (not a cancellation, not an
    interrupt: the turn must take it as a failed tool result)."""


def mutate_in_place(arguments: dict[str, Any]) -> None:
    """What a careless tool does to the arguments it was handed: edits nested lists and
    objects, overwrites every value and adds a key."""
    for name, value in list(arguments.items()):
        if isinstance(value, list):
            value.append("mutated")
        elif isinstance(value, dict):
            value["mutated"] = True
        arguments[name] = "overwritten"
    arguments["mutated_by_tool"] = True


# --------------------------------------------------------------------------- signals
def fire_from_thread(signal: Callable[[], None]) -> BaseException | None:
    """Call ``signal`` (e.g. ``signals.request_stop``) from a new `threading.Thread` and
    join it at once; return what the call raised in that thread, or ``None``.

    Joining at once keeps a test deterministic: the call has completed when this returns,
    at the virtual instant the test chose, and the turn's loop sees it at its next step.
    """
    raised: list[BaseException] = []

    def call() -> None:
        try:
            signal()
        except BaseException as err:  # reported to the caller: a signal must not raise
            raised.append(err)

    thread = threading.Thread(target=call, name="host-signal", daemon=True)
    thread.start()
    thread.join()
    return raised[0] if raised else None


# --------------------------------------------------------------------------- providers
class KeyEcho(StrEnum):
    """How a careless server or client quotes an API key back in an error."""

    WHOLE = "whole"  # "invalid api key <key>"
    PREFIX = "prefix"  # "Incorrect API key provided: <first 12 characters>****"
    QUERY = "query"  # a URL with "?key=<key>" in a connection error
    EXCEPTION = "exception"  # a client library's own exception, not a ProviderError


@frozen
class EchoKey:
    """Raise an error that quotes the provider's API key (see `KeyEcho`)."""

    style: KeyEcho = KeyEcho.WHOLE

    def error(self, key: str) -> Exception:
        if self.style is KeyEcho.WHOLE:
            return ProviderError(
                f"401 invalid api key {key}", kind="auth", retryable=True, status_code=401
            )
        if self.style is KeyEcho.PREFIX:
            return ProviderError(
                f"Incorrect API key provided: {key[:12]}{'*' * 8}",
                kind="auth",
                retryable=True,
                status_code=401,
            )
        if self.style is KeyEcho.QUERY:
            return ProviderError(
                f"connection reset by https://provider.invalid/v1/stream?key={key}",
                kind="connection",
                retryable=True,
            )
        return RuntimeError(f"client closed while sending with credentials {key!r}")


@frozen
class Trickle:
    """From here on, one `TextDelta` of ``text`` every ``share`` × the policy's inactivity
    budget: never silent long enough to time out, never finished. ``count`` caps it (``None``:
    forever)."""

    share: float = 0.9
    text: str = "."
    count: int | None = None


HostileItem = ScriptItem | EchoKey | Trickle


class HostileProvider(ScriptedProvider):
    """A `ScriptedProvider` that also plays `EchoKey` and `Trickle` items.

    ``api_key`` is the key an `EchoKey` quotes; ``inactivity_timeout`` sets a `Trickle`'s
    pace; ``trickle_past`` bounds a trickle without its own ``count``: it stops once it has
    streamed for longer than that many seconds (the kit passes a figure well past the
    policy's pass budget, so to the engine the trickle never ends).
    """

    def __init__(
        self,
        passes: Iterable[Sequence[HostileItem]],
        *,
        clock: Clock | None = None,
        api_key: str | None = None,
        inactivity_timeout: float = 120.0,
        trickle_past: float | None = None,
        name: str = "hostile",
        continuation_style: bool = False,
    ) -> None:
        super().__init__((), clock=clock, name=name, continuation_style=continuation_style)
        self.passes: list[Sequence[Any]] = [tuple(p) for p in passes]
        self.api_key = api_key
        self.inactivity_timeout = inactivity_timeout
        self.trickle_past = trickle_past

    def __repr__(self) -> str:  # the key is never shown
        return f"HostileProvider({len(self.passes)} passes)"

    def trickle_chunks(self, trickle: Trickle) -> int | None:
        """How many chunks ``trickle`` streams (``None``: forever)."""
        if trickle.count is not None:
            return trickle.count
        if self.trickle_past is None:
            return None
        return math.floor(self.trickle_past / (trickle.share * self.inactivity_timeout)) + 2

    def pause_total(self, index: int) -> float:
        """The longest pass ``index`` can take by its own script: its pauses and trickles up
        to its first failure (infinite for an endless trickle)."""
        script: Sequence[object] = self.passes[index] if index < len(self.passes) else ()
        total = 0.0
        for item in script:
            if isinstance(item, Fail | EchoKey):
                break
            if isinstance(item, Pause):
                total += item.seconds
            elif isinstance(item, Trickle):
                count = self.trickle_chunks(item)
                if count is None:
                    return math.inf
                total += count * item.share * self.inactivity_timeout
        return total

    async def _play(self, script: Sequence[Any]) -> AsyncIterator[Any]:
        try:
            for item in script:
                if isinstance(item, Pause):
                    await self._pause(item.seconds)
                elif isinstance(item, Fail):
                    raise item.error
                elif isinstance(item, EchoKey):
                    raise item.error(self.api_key or "")
                elif isinstance(item, Trickle):
                    async for chunk in self._trickle(item):
                        yield chunk
                else:
                    yield item
        finally:
            self.streams_closed += 1

    async def _trickle(self, trickle: Trickle) -> AsyncIterator[Chunk]:
        count = self.trickle_chunks(trickle)
        interval = trickle.share * self.inactivity_timeout
        sent = 0
        while count is None or sent < count:
            await self._pause(interval)
            sent += 1
            yield TextDelta(trickle.text)


# --------------------------------------------------------------------------- secrecy
def key_runs(key: str, length: int = KEY_RUN) -> frozenset[str]:
    """``key`` itself and every ``length``-character run of it."""
    if len(key) <= length:
        return frozenset({key}) if key else frozenset()
    return frozenset(key[i : i + length] for i in range(len(key) - length + 1)) | {key}


def leaked_runs(keys: Iterable[str], places: Mapping[str, str]) -> list[str]:
    """Where (the names of ``places``) any key, or an 8-character run of one, appears."""
    runs = frozenset().union(*(key_runs(key) for key in keys if key))
    if not runs:
        return []
    return [where for where, text in places.items() if any(run in text for run in runs)]
