"""Ready channels for the common hosts: one made of plain functions (`CallbackChannel`), one that
prints (`ConsoleChannel`), one that keeps everything (`CollectingChannel`).

Each is a full `toolloop_fsm.host.Channel`, so every guarantee of a turn holds as with a
channel class of the host's own: a method that raises ends the turn ``error``, an ``async``
method that does not return is bounded by ``host_call_timeout``.

The defaults of `CallbackChannel`, for what the host leaves out (only ``send_text`` is
required), show the user everything a channel is given rather than drop it:

* an expression is sent as the text ``[expression]``;
* a notice that is not ``hidden`` is sent as text on a line of its own (`notice_text`:
  ``(key: params)``); a hidden one, for logs and moderators, is logged at INFO on the
  ``toolloop_fsm.channels`` logger and not shown;
* the stop message queued at a stop (`TurnSignals.request_stop`) is sent as text.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Awaitable
from collections.abc import Callable
from typing import TextIO
from typing import TypeVar

from toolloop_fsm.result import Notice

_log = logging.getLogger(__name__)

#: A channel callback: an ``async def`` (awaited, bounded by ``host_call_timeout``) or a plain
#: function, called on the event loop — fine for printing or appending, not for a call that
#: can block (make that one ``async``)
Callback = Callable[[str], Awaitable[None] | None]
NoticeCallback = Callable[[Notice], Awaitable[None] | None]


def notice_text(notice: Notice) -> str:
    """A notice as the default channels show it: ``(key)`` or ``(key: {params})``."""
    if notice.params:
        return f"({notice.key}: {dict(notice.params)})"
    return f"({notice.key})"


_T = TypeVar("_T")


async def _call(callback: Callable[[_T], Awaitable[None] | None], value: _T) -> None:
    answer = callback(value)
    if inspect.isawaitable(answer):
        await answer


class CallbackChannel:
    """A channel made of plain callables: ``send_text`` is required, each other method
    defaults as the module docstring says. A callable may be ``async def`` or a plain
    function (called on the event loop: keep it quick)."""

    __slots__ = ("_expression", "_notice", "_queue_front", "_text")

    def __init__(
        self,
        send_text: Callback,
        *,
        send_expression: Callback | None = None,
        send_notice: NoticeCallback | None = None,
        queue_front: Callback | None = None,
    ) -> None:
        for name, value in (
            ("send_text", send_text),
            ("send_expression", send_expression),
            ("send_notice", send_notice),
            ("queue_front", queue_front),
        ):
            if value is not None and not callable(value):
                raise TypeError(
                    f"CallbackChannel: {name} must be a function, got {type(value).__name__}"
                )
        self._text = send_text
        self._expression = send_expression
        self._notice = send_notice
        self._queue_front = queue_front

    async def send_text(self, text: str) -> None:
        await _call(self._text, text)

    async def send_expression(self, expression: str) -> None:
        if self._expression is None:
            await _call(self._text, f"[{expression}]")
        else:
            await _call(self._expression, expression)

    async def send_notice(self, notice: Notice) -> None:
        if self._notice is not None:
            await _call(self._notice, notice)
        elif notice.hidden:
            _log.info("hidden notice %s %s", notice.key, dict(notice.params))
        else:
            await _call(self._text, f"\n{notice_text(notice)}\n")

    async def queue_front(self, stop_message: str) -> None:
        await _call(self._queue_front or self._text, stop_message)


class ConsoleChannel(CallbackChannel):
    """Prints each text as it arrives (no newline added, flushed), to ``out`` (standard
    output by default); expressions, notices and the stop message as `CallbackChannel`'s
    defaults show them."""

    __slots__ = ("out",)

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
        super().__init__(self._print)

    def _print(self, text: str) -> None:
        # standard output is looked up at each write: a host (or a test) that swaps it is obeyed
        print(text, end="", flush=True, file=self.out or sys.stdout)


class CollectingChannel:
    """Keeps everything a turn hands it, in order, for a host that answers with the whole
    reply (an HTTP handler, a job): ``texts`` and `text`, ``expressions``, ``notices``,
    ``stop_messages``. Pass one per turn, or read `text` before the next."""

    __slots__ = ("expressions", "notices", "stop_messages", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.expressions: list[str] = []
        self.notices: list[Notice] = []
        self.stop_messages: list[str] = []

    @property
    def text(self) -> str:
        """Every text sent, joined."""
        return "".join(self.texts)

    async def send_text(self, text: str) -> None:
        self.texts.append(text)

    async def send_expression(self, expression: str) -> None:
        self.expressions.append(expression)

    async def send_notice(self, notice: Notice) -> None:
        self.notices.append(notice)

    async def queue_front(self, stop_message: str) -> None:
        self.stop_messages.append(stop_message)


__all__ = ["CallbackChannel", "CollectingChannel", "ConsoleChannel", "notice_text"]
