"""Policies: the ceilings, budgets and exit rules of a turn, as plain frozen data, and the
field validators every construction-checked value of the library shares.

`LoopPolicy` governs the inner tool loop; `TurnPolicy` wraps it with the outer tier's
attempt rules. Every field is checked when the value is built, and a bad value raises
`TypeError`/`ValueError` naming the field: a policy that reaches a turn is a valid one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Literal

from attrs import Attribute
from attrs import field
from attrs import frozen
from attrs import validators as check


# --------------------------------------------------------------------------- shared validators
def _kind(value: object) -> str:
    # the type, never the value: a mistaken value may be an API key
    return type(value).__name__


def _whole_number(_: object, attribute: Attribute[Any], value: object) -> None:
    # bool is an int to Python, but True is never meant as "one iteration"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be a whole number, got {_kind(value)}")


def _real_number(_: object, attribute: Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{attribute.name} must be a number, got {_kind(value)}")


def _finite(_: object, attribute: Attribute[Any], value: float) -> None:
    # NaN compares false with everything, so a NaN deadline is never reached and a NaN
    # cooldown never ends; an infinite one is the same mistake spelled differently
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


def non_blank(_: object, attribute: Attribute[Any], value: str) -> None:
    if not value.strip():
        raise ValueError(f"{attribute.name} must not be empty or blank")


Validator = Callable[[Any, "Attribute[Any]", Any], None]


def of_type(*types: type) -> Validator:
    """A validator: the value is an instance of one of ``types`` (the message names the
    field and the type it got, never the value)."""
    expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)

    def validate(_: object, attribute: Attribute[Any], value: object) -> None:
        if not isinstance(value, types):
            raise TypeError(f"{attribute.name} must be {expected}, got {_kind(value)}")

    return validate


def _single(value: object) -> bool:
    # a string is iterable, so without this check "get_weather" would become the set of its
    # letters, "sk-abc" six keys, and a message dict the tuple of its keys
    return isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable)


def as_tuple(value: Iterable[Any]) -> Any:
    """A converter: any collection as a tuple; a single value (a string, a mapping) is left
    as it is for the field's `collection_of` validator to refuse by name."""
    return value if _single(value) else tuple(value)


def as_frozenset(value: Iterable[Any]) -> Any:
    """`as_tuple`, for a set."""
    return value if _single(value) else frozenset(value)


def as_optional_frozenset(value: Iterable[Any] | None) -> Any:
    return None if value is None else as_frozenset(value)


def _converted(_: object, attribute: Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple | frozenset):
        raise TypeError(
            f"{attribute.name} must be a collection (a list, tuple or set), got {_kind(value)}"
        )


def collection_of(*types: type) -> Validator:
    """A validator for a field converted by `as_tuple` or `as_frozenset`: a collection was
    given, not a single value, and each item is one of ``types``."""
    expected = " or ".join(t.__name__ for t in types)

    def each(_: object, attribute: Attribute[Any], item: object) -> None:
        if not isinstance(item, types):
            raise TypeError(f"every item of {attribute.name} must be {expected}, got {_kind(item)}")

    validator: Validator = check.deep_iterable(each, iterable_validator=_converted)
    return validator


#: A count of at least one (a ceiling, a threshold, a size).
positive_count: Validator = check.and_(_whole_number, check.ge(1))
#: A count that may be zero (how many times something happened).
count: Validator = check.and_(_whole_number, check.ge(0))
#: Seconds that must pass before something happens (a deadline, a budget).
positive_seconds: Validator = check.and_(_real_number, _finite, check.gt(0))
#: Seconds that may be zero (a settle window, a cooldown).
seconds: Validator = check.and_(_real_number, _finite, check.ge(0))
#: An instant on a clock.
clock_time: Validator = check.and_(_real_number, _finite)
#: A yes/no switch (a truthy string is not one).
flag: Validator = of_type(bool)


def ceiling_manner(_: object, attribute: Attribute[Any], value: object) -> None:
    """``at_ceiling``: how the iteration ceiling's last pass goes (docs/behaviour.md §2.1)."""
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be 'end' or 'answer', got {_kind(value)}")
    if value not in ("end", "answer"):
        raise ValueError(f"{attribute.name} must be 'end' or 'answer', got {value!r}")


#: Text a reader must be able to see (a name, a label).
name_text: Validator = check.and_(of_type(str), non_blank)


#: A price per million tokens, in the host's currency (zero: free).
_per_million: Validator = check.and_(_real_number, _finite, check.ge(0))
#: A cost ceiling, in the host's currency.
_positive_cost: Validator = check.and_(_real_number, _finite, check.gt(0))


@frozen
class Price:
    """What one model's tokens cost, per million, in the host's currency (no price table is
    shipped: the host knows what it pays)."""

    input_per_million: float = field(validator=_per_million)
    output_per_million: float = field(validator=_per_million)

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """The cost of ``input_tokens`` read and ``output_tokens`` written."""
        return (
            input_tokens * self.input_per_million + output_tokens * self.output_per_million
        ) / 1_000_000


@frozen
class Budget:
    """Token and cost ceilings (``None``: no ceiling of that kind; docs/behaviour.md §2.8).
    ``cost`` is in the currency of the `Price` the turn is given."""

    input_tokens: int | None = field(default=None, validator=check.optional(positive_count))
    output_tokens: int | None = field(default=None, validator=check.optional(positive_count))
    total_tokens: int | None = field(default=None, validator=check.optional(positive_count))
    cost: float | None = field(default=None, validator=check.optional(_positive_cost))

    def __attrs_post_init__(self) -> None:
        if (self.input_tokens, self.output_tokens, self.total_tokens, self.cost) == (None,) * 4:
            raise ValueError(
                "a Budget needs at least one ceiling: input_tokens, output_tokens, "
                "total_tokens or cost"
            )


def _priced_budget(policy: Any, attribute: Attribute[Any], budget: Budget | None) -> None:
    if budget is not None and budget.cost is not None and policy.price is None:
        raise ValueError(
            f"{attribute.name}: a cost ceiling needs the model's price (LoopPolicy.price)"
        )


@frozen
class ExitView:
    """What a custom exit rule (`LoopPolicy.end_after_pre_tool_text`) may look at after a
    successful tool round: the tool, the visible text streamed before it, whether it needs a
    follow-up, the provider's style and the pass number."""

    tool_name: str
    pre_tool_text: str | None
    requires_follow_up: bool
    continuation_style: bool
    iteration: int


@frozen
class LoopPolicy:
    """Ceilings, budgets and tool sets of the inner tool loop.

    Times are seconds on the turn's clock. ``first_token_timeout=None`` means
    ``max(inactivity_timeout, 300)``. ``delivery_flush_chars`` is how much visible text is
    buffered before it is handed to the channel (text is also flushed before a tool runs,
    at the end of a pass, and on a stop).

    ``drafting`` holds prose for review and ``review_tool_calls`` puts new tool calls before
    the reviewer (both need a `Reviewer`); the review budgets are per turn, shared by every
    attempt of a generation turn.

    ``max_identical_calls`` is how many times a call with the same tool and the same
    canonical arguments may run (or be reused) in a turn; a further one is refused with a
    result naming the repeat, and counts as a tool error (docs/behaviour.md §3.11). A tool
    whose repeats mean something opts out (`Tool.repeatable`).

    ``max_tool_calls`` bounds the calls a turn runs (``None``: no limit; docs/behaviour.md
    §3.12): a call past it is refused with a result saying the limit was reached, and the
    pass after the batch that reached it is offered no tools — the model answers with what
    it has, and a call it makes anyway ends the turn ``timeout``/``tool_call_limit``.
    ``at_ceiling="answer"`` makes the last pass the iteration ceiling allows such a pass too
    (the default ``"end"`` keeps that pass an ordinary one, §2.1).

    ``end_after_pre_tool_text`` replaces the built-in `should_end_after_pre_tool_text` rule
    when set: a pure function of an `ExitView` returning whether the turn ends ``completed``.
    """

    max_function_call_iterations: int = field(default=100, validator=positive_count)
    soft_warn_iteration: int = field(default=20, validator=positive_count)
    max_consecutive_tool_errors: int = field(default=5, validator=positive_count)
    max_identical_calls: int = field(default=3, validator=positive_count)
    max_tool_calls: int | None = field(default=None, validator=check.optional(positive_count))
    at_ceiling: Literal["end", "answer"] = field(default="end", validator=ceiling_manner)
    continuation_tool_failure_threshold: int = field(default=3, validator=positive_count)
    inactivity_timeout: float = field(default=120.0, validator=positive_seconds)
    first_token_timeout: float | None = field(
        default=None, validator=check.optional(positive_seconds)
    )
    abandoned_stream_settle: float = field(default=5.0, validator=seconds)
    tool_timeout: float = field(default=300.0, validator=positive_seconds)
    #: how many calls of one tool batch run at once (``1``: one by one, in emitted order)
    max_parallel_tools: int = field(default=10, validator=positive_count)
    #: ``False`` asks providers whose API has the option for one call per response
    parallel_tool_calls: bool = field(default=True, validator=flag)
    tool_failure_notice_limit: int = field(default=1800, validator=positive_count)
    suppress_followup_after_pre_tool_text: frozenset[str] = field(
        default=frozenset({"update_short_term_memory"}),
        converter=as_frozenset,
        validator=collection_of(str),
    )
    memory_tool_name: str = field(default="update_short_term_memory", validator=name_text)
    delivery_flush_chars: int = field(default=200, validator=positive_count)
    #: bound on every call into host code other than a tool: channel sends, notices, the
    #: stop message, the outer tier's hooks and the shared-route admission
    host_call_timeout: float = field(default=30.0, validator=positive_seconds)
    #: how long code that was cancelled may take to stop before it is abandoned (named in
    #: the result's ``abandoned_calls`` and never awaited again)
    cancel_grace: float = field(default=2.0, validator=positive_seconds)
    #: total budget of one provider pass, however steadily it trickles
    max_pass_duration: float = field(default=900.0, validator=positive_seconds)
    end_after_pre_tool_text: Callable[[ExitView], bool] | None = field(
        default=None, eq=False, repr=False, validator=check.optional(check.is_callable())
    )
    #: hold the turn's prose until a reviewer passed it (one revision allowed); off: every
    #: text is delivered as it streams and no reviewer is asked
    drafting: bool = field(default=False, validator=flag)
    #: show each new tool call to the reviewer before it runs (the tool checkpoint)
    review_tool_calls: bool = field(default=False, validator=flag)
    #: the held-prose ceiling of one turn, shared by all its passes (UTF-8 bytes, segments)
    held_prose_max_bytes: int = field(default=65_536, validator=positive_count)
    held_prose_max_segments: int = field(default=4_096, validator=positive_count)
    #: the host's own limit on the prose one turn may send (UTF-8 bytes); a drafted reply
    #: cut by it is delivered without the ``flush_limit`` notice
    send_message_limit: int | None = field(default=None, validator=check.optional(positive_count))
    max_reviews: int = field(default=2, validator=positive_count)
    max_revisions: int = field(default=1, validator=count)
    max_tool_reviews: int = field(default=8, validator=count)
    max_tool_corrections: int = field(default=2, validator=count)
    review_timeout: float = field(default=120.0, validator=positive_seconds)
    #: the model's price, for a cost ceiling and the result's ``cost`` (the outer tier's
    #: `Attempt.price` overrides it per model)
    price: Price | None = field(default=None, validator=of_type(Price, type(None)))
    #: the token and cost ceilings of one attempt (docs/behaviour.md §2.8)
    budget: Budget | None = field(
        default=None, validator=[of_type(Budget, type(None)), _priced_budget]
    )

    @property
    def effective_first_token_timeout(self) -> float:
        if self.first_token_timeout is not None:
            return self.first_token_timeout
        return max(self.inactivity_timeout, 300.0)


@frozen
class TurnPolicy:
    """The outer tier's rules: key attempts per model, key cooldowns, and the loop policy."""

    loop: LoopPolicy = field(default=LoopPolicy(), validator=of_type(LoopPolicy))
    max_key_attempts_per_model: int = field(default=3, validator=positive_count)
    rate_limit_cooldown: float = field(default=60.0, validator=seconds)
    failure_cooldown: float = field(default=300.0, validator=seconds)
    allow_shared_route: bool = field(default=True, validator=flag)
    #: the token and cost ceilings of the whole chain of attempts (docs/behaviour.md §2.8):
    #: a cost ceiling prices each attempt at its `Attempt.price`, else at ``loop.price``
    budget: Budget | None = field(default=None, validator=of_type(Budget, type(None)))
