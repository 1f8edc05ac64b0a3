"""The live event stream of a turn, for UIs: every chunk as it arrives and every phase as it
happens, independent of how text is batched for the channel.

Text reaches the host's `Channel` in batches (``delivery_flush_chars``, chat messages); a UI
that shows tokens as they come iterates the turn instead::

    async with stream_tool_loop(provider, tools, channel, request) as events:
        async for event in events:
            match event:
                case TextDelta(text=text):
                    ui.append(text)
                case ToolStarted(name=name):
                    ui.spinner(name)
                case TurnEnded(result=result):
                    ui.done(result.status)

`stream_tool_loop` and `stream_generation_turn` take exactly the parameters of
`run_tool_loop` and `run_generation_turn`; the channel still gets its deliveries. They yield,
in order: `TurnStarted`; the chunks the provider streams (`TextDelta`, `ThoughtDelta`,
`FunctionCall`, before the loop takes them: a consumer that keeps up has each one before
any delivery holding its text is sent); `PassStarted`/`PassEnded`, `ToolStarted`/`ToolEnded`
and, in a generation turn, `AttemptStarted`/`AttemptEnded` around them; and last `TurnEnded`
with the `GenerationTurnResult`. The chunks are what the provider sent — an attempt that
failed and was superseded streamed text the next attempt replaces (`AttemptEnded` says so);
the result says what was delivered.

The turn runs in its own task, started when the stream is entered (or first iterated), and
never waits for the consumer: a slow consumer finds events queued, the turn's deadlines are
unaffected. Leaving the ``async with`` early — ``break``, an exception, the consumer's own
cancellation — or calling `TurnStream.aclose` cancels the turn (its provider stream, tool and
deliveries, as cancelling `run_tool_loop` does) and waits for it to wind down. A turn that
raises raises from the iteration, after the events before it.

A turn nothing streams runs exactly as before: the stream is an observer
(`toolloop_fsm.observation`), attached only to the turns started through these functions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
from collections.abc import Awaitable
from collections.abc import Callable
from types import TracebackType
from typing import ParamSpec
from typing import Self
from typing import cast

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.observation import OBSERVER_METHOD
from toolloop_fsm.observation import AttemptEnded
from toolloop_fsm.observation import AttemptStarted
from toolloop_fsm.observation import ObservedChunk
from toolloop_fsm.observation import PassEnded
from toolloop_fsm.observation import PassStarted
from toolloop_fsm.observation import ProgressEvent
from toolloop_fsm.observation import ToolEnded
from toolloop_fsm.observation import ToolStarted
from toolloop_fsm.observation import TurnAborted
from toolloop_fsm.observation import TurnEnded
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.observation import TurnStarted
from toolloop_fsm.pump import run_generation_turn
from toolloop_fsm.pump import run_tool_loop
from toolloop_fsm.result import GenerationTurnResult

#: What a live stream yields.
LiveEvent = TextDelta | ThoughtDelta | FunctionCall | ProgressEvent

_P = ParamSpec("_P")
_RunTurn = Callable[[TurnObserver], Awaitable[GenerationTurnResult]]


class TurnStream:
    """One turn's live events: an async iterator, and an async context manager that owns the
    turn (leaving it cancels a turn still running). Made by `stream_tool_loop` and
    `stream_generation_turn`; iterate it once."""

    __slots__ = (
        "_also",
        "_closed",
        "_events",
        "_raised",
        "_result",
        "_run",
        "_task",
        "_waiter",
    )

    def __init__(self, run: _RunTurn, observer: TurnObserver | None = None) -> None:
        self._run = run
        self._also = observer  # the caller's own observer, told of every event too
        self._events: collections.deque[LiveEvent] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._result: GenerationTurnResult | None = None
        self._closed = False
        self._raised = False

    # ------------------------------------------------------------------ the turn's side
    def _push(self, event: LiveEvent) -> None:
        self._events.append(event)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _drive(self) -> None:
        try:
            # the live observer is the run's to hold, not the stream's: held here it would
            # make every watched turn a reference cycle (it holds the stream)
            self._result = await self._run(_LiveObserver(self, self._also))
        finally:
            self._wake()

    def _start(self) -> asyncio.Task[None]:
        task = self._task
        if task is None:
            task = self._task = asyncio.get_running_loop().create_task(
                self._drive(), name="toolloop_fsm live turn"
            )
        return task

    # ------------------------------------------------------------------ the consumer's side
    async def __aenter__(self) -> Self:
        self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> LiveEvent:
        if self._closed:
            raise StopAsyncIteration
        task = self._start()
        events = self._events
        while not events:
            if task.done():
                self._closed = True
                if not task.cancelled() and task.exception() is not None and not self._raised:
                    self._raised = True
                    raise task.exception()  # type: ignore[misc]
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return events.popleft()

    async def aclose(self) -> None:
        """Stop consuming: a turn still running is cancelled and waited for (the wait is the
        turn's own wind-down, bounded by its policy's grace)."""
        self._closed = True
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # seen: a turn that raised after the consumer left is not news

    @property
    def result(self) -> GenerationTurnResult:
        """The turn's result, once it returned (the `TurnEnded` event carries it too)."""
        if self._result is None:
            raise RuntimeError("the turn has not returned a result")
        return self._result

    def __del__(self) -> None:
        # a stream dropped while its turn runs (iterated without ``async with``, then left)
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                task.cancel()


class _LiveObserver(TurnObserver):
    """Puts every phase event and observed chunk on a `TurnStream`; forwards to the caller's
    own observer too, when one was given."""

    wants_chunks = True

    def __init__(self, stream: TurnStream, also: TurnObserver | None) -> None:
        self._stream = stream
        self._also = also
        self._also_chunks = also is not None and getattr(also, "wants_chunks", False)

    def _relay(self, event: LiveEvent) -> None:
        self._stream._push(event)
        if self._also is not None:
            getattr(self._also, OBSERVER_METHOD[type(event)])(event)

    # each phase is yielded as it happens and handed on, by the method it came to
    turn_started = turn_ended = attempt_started = attempt_ended = _relay
    pass_started = pass_ended = tool_started = tool_ended = _relay

    def turn_aborted(self, event: TurnAborted) -> None:
        # the stream raises the turn's exception, or was closed: nothing to yield
        if self._also is not None:
            self._also.turn_aborted(event)

    def chunk(self, event: ObservedChunk) -> None:
        self._stream._push(event)
        if self._also_chunks:
            assert self._also is not None
            self._also.chunk(event)


def _streaming(
    run: Callable[_P, Awaitable[GenerationTurnResult]], name: str, doc: str
) -> Callable[_P, TurnStream]:
    """The stream function of the run function ``run``: it takes exactly ``run``'s parameters
    (declared once, there: a parameter a run function gains, its stream takes) and runs it
    with the stream's observer in place of the caller's, which the stream forwards to."""
    signature = inspect.signature(run)
    call: Callable[..., Awaitable[GenerationTurnResult]] = run

    def stream(*args: _P.args, **kwargs: _P.kwargs) -> TurnStream:
        signature.bind(*args, **kwargs)  # a call ``run`` refuses is refused here, not later
        observer = cast("TurnObserver | None", kwargs.pop("observer", None))

        def run_observed(live: TurnObserver) -> Awaitable[GenerationTurnResult]:
            return call(*args, **kwargs, observer=live)

        return TurnStream(run_observed, observer)

    stream.__name__ = stream.__qualname__ = name
    stream.__doc__ = doc
    stream.__signature__ = signature.replace(  # type: ignore[attr-defined]
        return_annotation="TurnStream"
    )
    return stream


stream_tool_loop = _streaming(
    run_tool_loop,
    "stream_tool_loop",
    """`run_tool_loop`, as a stream of live events ending with `TurnEnded` (see the module
    docstring).""",
)
stream_generation_turn = _streaming(
    run_generation_turn,
    "stream_generation_turn",
    """`run_generation_turn`, as a stream of live events ending with `TurnEnded` (see the
    module docstring); attempts are framed by `AttemptStarted` and `AttemptEnded`.""",
)


__all__ = [
    "AttemptEnded",
    "AttemptStarted",
    "FunctionCall",
    "LiveEvent",
    "PassEnded",
    "PassStarted",
    "TextDelta",
    "ThoughtDelta",
    "ToolEnded",
    "ToolStarted",
    "TurnEnded",
    "TurnStarted",
    "TurnStream",
    "stream_generation_turn",
    "stream_tool_loop",
]
