"""The outer tier's values: the fallback chain (`Attempt`), what the machine knows of it
(`AttemptPlan`), key health, and the shared route the host may admit."""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from attrs import Attribute
from attrs import field
from attrs import frozen
from attrs import validators as check

from toolloop_fsm.policy import Price
from toolloop_fsm.policy import as_tuple
from toolloop_fsm.policy import clock_time
from toolloop_fsm.policy import collection_of
from toolloop_fsm.policy import count
from toolloop_fsm.policy import flag
from toolloop_fsm.policy import name_text
from toolloop_fsm.policy import non_blank
from toolloop_fsm.policy import of_type
from toolloop_fsm.provider import Provider
from toolloop_fsm.result import AttemptFailure

ProviderFactory = Callable[[str | None], Provider]

#: How a model calls tools: natively, or written in its text ("verbatim").
TOOL_CALLING = ("native", "verbatim")
#: Whose credentials an attempt uses: the user's own, or the operator's shared route.
ROUTES = ("user", "shared")


def _provider_or_factory(_: object, attribute: Attribute[Any], value: object) -> None:
    if not (callable(getattr(value, "stream", None)) or callable(value)):
        raise TypeError(
            f"{attribute.name} must be a Provider (with a stream method) or a factory called "
            f"with each key, got {type(value).__name__}"
        )


def _distinct(_: object, attribute: Attribute[Any], keys: tuple[str, ...]) -> None:
    # two entries for one key would give it two health records and two tries per model
    if len(set(keys)) != len(keys):
        raise ValueError(f"{attribute.name} holds the same key twice")


def _one_of(options: Sequence[str]) -> Callable[[object, Attribute[Any], object], None]:
    def validate(_: object, attribute: Attribute[Any], value: object) -> None:
        if value not in options:
            raise ValueError(f"{attribute.name} must be one of {', '.join(options)}, got {value!r}")

    return validate


@frozen(repr=False)
class Attempt:
    """One model of the fallback chain: a provider (or a factory called with each API key)
    and the keys to rotate through. ``tool_calling`` says whether the model calls tools
    natively or writes them in text ("verbatim"); by default it is read from the provider.

    Keys are never shown: not in ``repr``, results, traces, notices or messages.
    """

    provider: Provider | ProviderFactory = field(validator=_provider_or_factory)
    keys: tuple[str, ...] = field(
        default=(),
        converter=as_tuple,
        validator=[collection_of(str), check.deep_iterable(non_blank), _distinct],
    )
    label: str | None = field(default=None, validator=check.optional(name_text))
    tool_calling: str | None = field(default=None, validator=check.optional(_one_of(TOOL_CALLING)))
    #: what this model's tokens cost (``None``: the loop policy's ``price``), for cost
    #: ceilings and the result's ``cost``
    price: Price | None = field(default=None, validator=of_type(Price, type(None)))

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
        return AttemptPlan(
            label=label,
            keys=len(self.keys),
            tool_calling=tool_calling,
            route=route,
            price=self.price,
        )


@frozen
class AttemptPlan:
    """What the outer machine knows of one model: a label, how many keys, how it calls tools,
    and which credential route it belongs to (``user`` or ``shared``)."""

    label: str = field(validator=name_text)
    keys: int = field(default=0, validator=count)
    tool_calling: str = field(default="native", validator=_one_of(TOOL_CALLING))
    route: str = field(default="user", validator=_one_of(ROUTES))
    price: Price | None = field(default=None, validator=of_type(Price, type(None)))


@frozen
class KeyHealth:
    """Health of one API key: cooling down until a clock time, or retired for the turn."""

    cooldown_until: float = field(default=0.0, validator=clock_time)
    retired: bool = field(default=False, validator=flag)
    successes: int = field(default=0, validator=count)
    failures: int = field(default=0, validator=count)

    def usable_at(self, now: float) -> bool:
        return not self.retired and self.cooldown_until <= now


@frozen
class AdmissionRequest:
    """What the host's admission policy is told when asked for the shared route."""

    failures: tuple[AttemptFailure, ...]
    at: float


Admission = Callable[[AdmissionRequest], Awaitable[bool] | bool]


@frozen
class SharedRoute:
    """Extra attempts on a shared route (the operator's credentials), used only when every
    attempt on the user's own credentials failed retryably and ``admit`` allows it."""

    attempts: tuple[Attempt, ...] = field(converter=as_tuple, validator=collection_of(Attempt))
    admit: Admission = field(eq=False, validator=check.is_callable())


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
