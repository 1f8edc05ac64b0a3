"""`ScriptedProvider`: a provider that streams a script, for tests and the demo."""

from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from toolloop_fsm.events import Chunk
from toolloop_fsm.host import Clock
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest


@frozen
class Pause:
    """Wait ``seconds`` on the clock before the next item (a stall, when long)."""

    seconds: float


@frozen
class Fail:
    """Raise ``error`` at this point of the pass."""

    error: ProviderError


ScriptItem = Chunk | Pause | Fail


class ScriptedProvider:
    """Streams one scripted pass per request; records every `ProviderRequest` it gets.

    Requests beyond the script get an empty pass. ``tool_calling`` and
    ``continuation_style`` let a script stand in for any kind of provider.
    """

    def __init__(
        self,
        passes: Iterable[Sequence[ScriptItem]],
        *,
        clock: Clock | None = None,
        name: str = "scripted",
        tool_calling: str = "native",
        continuation_style: bool = False,
    ) -> None:
        self.passes: list[Sequence[ScriptItem]] = [tuple(p) for p in passes]
        self.clock = clock
        self.name = name
        self.tool_calling = tool_calling
        self.continuation_style = continuation_style
        self.requests: list[ProviderRequest] = []
        self.streams_closed = 0

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        index = len(self.requests)
        self.requests.append(request)
        script = self.passes[index] if index < len(self.passes) else ()
        return self._play(script)

    async def _play(self, script: Sequence[ScriptItem]) -> AsyncIterator[Any]:
        try:
            for item in script:
                kind = type(item)
                if kind is Pause:
                    await self._pause(item.seconds)  # type: ignore[union-attr]
                elif kind is Fail:
                    raise item.error  # type: ignore[union-attr]
                else:
                    yield item
        finally:
            self.streams_closed += 1

    async def _pause(self, seconds: float) -> None:
        if self.clock is None:
            import asyncio

            await asyncio.sleep(seconds)
        else:
            await self.clock.sleep(seconds)
