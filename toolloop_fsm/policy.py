"""Policies: the ceilings, budgets and exit rules of a turn, as plain frozen data.

`LoopPolicy` governs the inner tool loop (SPEC §2–§3, defaults from SPEC §7);
`TurnPolicy` wraps it with the outer tier's attempt rules (SPEC §1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attrs import Attribute, field, frozen

if TYPE_CHECKING:
    from toolloop_fsm.guards.exit_policy import ExitView


def _positive(_: object, attribute: Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _at_least_one(_: object, attribute: Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


def _non_negative(_: object, attribute: Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@frozen
class LoopPolicy:
    """Ceilings, budgets and tool sets of the inner tool loop.

    Times are seconds on the turn's clock. ``first_token_timeout=None`` means
    ``max(inactivity_timeout, 300)``. ``delivery_flush_chars`` is how much visible text is
    buffered before it is handed to the channel (text is also flushed before a tool runs,
    at the end of a pass, and on a stop).

    ``end_after_pre_tool_text`` replaces the built-in `should_end_after_pre_tool_text` rule
    when set: a pure function of an `ExitView` returning whether the turn ends ``completed``.
    """

    max_function_call_iterations: int = field(default=100, validator=_at_least_one)
    soft_warn_iteration: int = field(default=20, validator=_at_least_one)
    max_consecutive_tool_errors: int = field(default=5, validator=_at_least_one)
    continuation_tool_failure_threshold: int = field(default=3, validator=_at_least_one)
    inactivity_timeout: float = field(default=120.0, validator=_positive)
    first_token_timeout: float | None = None
    abandoned_stream_settle: float = field(default=5.0, validator=_non_negative)
    tool_timeout: float = field(default=300.0, validator=_positive)
    tool_failure_notice_limit: int = field(default=1800, validator=_at_least_one)
    suppress_followup_after_pre_tool_text: frozenset[str] = field(
        default=frozenset({"update_short_term_memory"}), converter=frozenset
    )
    memory_tool_name: str = "update_short_term_memory"
    delivery_flush_chars: int = field(default=200, validator=_at_least_one)
    end_after_pre_tool_text: Callable[[ExitView], bool] | None = field(
        default=None, eq=False, repr=False
    )

    @property
    def effective_first_token_timeout(self) -> float:
        if self.first_token_timeout is not None:
            return self.first_token_timeout
        return max(self.inactivity_timeout, 300.0)

    def __attrs_post_init__(self) -> None:
        if self.first_token_timeout is not None and self.first_token_timeout <= 0:
            raise ValueError(f"first_token_timeout must be > 0, got {self.first_token_timeout!r}")


@frozen
class TurnPolicy:
    """The outer tier's rules: key attempts per model, key cooldowns, and the loop policy."""

    loop: LoopPolicy = LoopPolicy()
    max_key_attempts_per_model: int = field(default=3, validator=_at_least_one)
    rate_limit_cooldown: float = field(default=60.0, validator=_non_negative)
    failure_cooldown: float = field(default=300.0, validator=_non_negative)
    allow_shared_route: bool = True
