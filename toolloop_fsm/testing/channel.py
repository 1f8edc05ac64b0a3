"""`RecordingChannel`: a `Channel` that records what it was given, for tests and the demo."""

from __future__ import annotations

from collections.abc import Callable

from toolloop_fsm.host import Clock
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import Notice


class RecordingChannel:
    """Records deliveries (in order), notices and stop messages queued at the front.

    ``delivery_delay`` makes each text/expression delivery take that long on ``clock``
    (deliveries in flight); ``fail_when`` raises from a delivery to test host failures.
    A delivery is recorded only once it completed, as a real channel would confirm it.

    It takes idempotency keys, as Discord's message ``nonce`` with ``enforce_nonce`` does: a
    delivery whose key it already accepted is dropped (counted in ``duplicates_dropped``)
    and confirmed, so a turn resumed after a crash does not show a text twice.
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        delivery_delay: float = 0.0,
        fail_when: Callable[[str | None, str | None], bool] | None = None,
        on_delivery: Callable[[Delivered], None] | None = None,
    ) -> None:
        self.clock = clock
        self.delivery_delay = delivery_delay
        self.fail_when = fail_when
        self.on_delivery = on_delivery
        self.delivered: list[Delivered] = []
        self.notices: list[Notice] = []
        self.queued_front: list[str] = []
        self.keys: set[str] = set()
        self.duplicates_dropped = 0

    @property
    def texts(self) -> list[str]:
        return [d.text for d in self.delivered if d.text is not None]

    @property
    def text(self) -> str:
        """Every text delivery, concatenated in order: what the user read."""
        return "".join(self.texts)

    @property
    def expressions(self) -> list[str]:
        return [d.expression for d in self.delivered if d.expression is not None]

    #: ``text``, under the name a turn's result gives it (`GenerationTurnResult.delivered_text`)
    delivered_text = text

    async def _wait(self) -> None:
        if self.delivery_delay > 0 and self.clock is not None:
            await self.clock.sleep(self.delivery_delay)

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        await self._wait()
        self._confirm(idempotency_key, text=text)

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        await self._wait()
        self._confirm(idempotency_key, expression=expression)

    def _confirm(
        self, key: str | None, *, text: str | None = None, expression: str | None = None
    ) -> None:
        """Confirm one delivery (a text or an expression) once it was sent: refused when
        ``fail_when`` says so, dropped when its key was accepted already, else recorded."""
        if self.fail_when is not None and self.fail_when(text, expression):
            what = "message" if text is not None else "expression"
            raise ConnectionError(f"the channel refused the {what}")
        if not self._seen(key):
            self._record(Delivered(len(self.delivered), text=text, expression=expression))

    def _seen(self, key: str | None) -> bool:
        """Whether ``key`` was accepted already (the delivery is then dropped)."""
        if key is None:
            return False
        if key in self.keys:
            self.duplicates_dropped += 1
            return True
        self.keys.add(key)
        return False

    def _record(self, delivered: Delivered) -> None:
        self.delivered.append(delivered)
        if self.on_delivery is not None:
            self.on_delivery(delivered)

    async def send_notice(self, notice: Notice) -> None:
        self.notices.append(notice)

    async def queue_front(self, stop_message: str) -> None:
        self.queued_front.append(stop_message)
