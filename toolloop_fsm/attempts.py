"""The outer tier's values: the fallback chain (`Attempt`), what the machine knows of it
(`AttemptPlan`), key health, and the shared route the host may admit."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from attrs import field, frozen

from toolloop_fsm.providers.base import Provider
from toolloop_fsm.result import AttemptFailure

ProviderFactory = Callable[[str | None], Provider]


def _as_keys(keys: Sequence[str]) -> tuple[str, ...]:
    return tuple(keys)


@frozen(repr=False)
class Attempt:
    """One model of the fallback chain: a provider (or a factory called with each API key)
    and the keys to rotate through. ``tool_calling`` says whether the model calls tools
    natively or writes them in text ("verbatim"); by default it is read from the provider.

    Keys are never shown: not in ``repr``, results, traces, notices or messages.
    """

    provider: Provider | ProviderFactory
    keys: tuple[str, ...] = field(default=(), converter=_as_keys)
    label: str | None = None
    tool_calling: str | None = None

    def __repr__(self) -> str:
        return f"Attempt(label={self.label!r}, keys=<{len(self.keys)} hidden>)"

    def make_provider(self, key: str | None) -> Provider:
        if callable(self.provider) and not hasattr(self.provider, "stream"):
            return self.provider(key)
        return self.provider  # type: ignore[return-value]

    def plan(self, index: int, route: str) -> AttemptPlan:
        tool_calling = self.tool_calling
        if tool_calling is None:
            tool_calling = str(getattr(self.provider, "tool_calling", "native"))
        label = self.label
        if label is None:
            label = f"{getattr(self.provider, 'name', 'model')}#{index}"
        return AttemptPlan(label=label, keys=len(self.keys), tool_calling=tool_calling, route=route)


@frozen
class AttemptPlan:
    """What the outer machine knows of one model: a label, how many keys, how it calls tools,
    and which credential route it belongs to (``user`` or ``shared``)."""

    label: str
    keys: int = 0
    tool_calling: str = "native"
    route: str = "user"


@frozen
class KeyHealth:
    """Health of one API key: cooling down until a clock time, or retired for the turn."""

    cooldown_until: float = 0.0
    retired: bool = False
    successes: int = 0
    failures: int = 0

    def usable_at(self, now: float) -> bool:
        return not self.retired and self.cooldown_until <= now


@frozen
class AdmissionRequest:
    """What the host's admission policy is told when asked for the shared route."""

    failures: tuple[AttemptFailure, ...]
    at: float


Admission = Callable[[AdmissionRequest], Awaitable[bool] | bool]


def _as_attempts(attempts: Iterable[Attempt]) -> tuple[Attempt, ...]:
    return tuple(attempts)


@frozen
class SharedRoute:
    """Extra attempts on a shared route (the operator's credentials), used only when every
    attempt on the user's own credentials failed retryably and ``admit`` allows it."""

    attempts: tuple[Attempt, ...] = field(converter=_as_attempts)
    admit: Admission = field(eq=False)


KeyBook = dict[tuple[str, int], KeyHealth]

__all__ = [
    "Admission",
    "AdmissionRequest",
    "Attempt",
    "AttemptPlan",
    "KeyBook",
    "KeyHealth",
    "ProviderFactory",
    "SharedRoute",
]


