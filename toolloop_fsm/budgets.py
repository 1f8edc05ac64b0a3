"""Token and cost budgets (docs/behaviour.md §2.8): what a turn has spent by its usage
ledger, whether the next pass may start, what it may still write, and which ceiling a turn
reached.

Pure arithmetic over the ledger's entries: the machine's guards ask it before each pass,
the pass's text handler as it streams, and the outer tier what an attempt spent of the
chain's budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator

import attrs
from attrs import frozen

from toolloop_fsm.policy import Budget
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import Price
from toolloop_fsm.result import BudgetExceeded
from toolloop_fsm.result import BudgetScope
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import UsageEntry

#: The sub-reasons of a turn that ended at a ceiling of its budget.
BUDGET_REASONS = frozenset({"token_budget", "cost_budget"})


@frozen
class Spent:
    """Tokens read and written, and their cost (``None``: no price was given)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def plus(self, other: Spent) -> Spent:
        """Both spends together (a cost is known when either side's is)."""
        costs = [c for c in (self.cost, other.cost) if c is not None]
        return Spent(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            sum(costs) if costs else None,
        )


def spent_by_attempts(results: Iterable[GenerationTurnResult]) -> Spent:
    """What a chain's attempts spent together, each at its own model's price (its
    ``cost``)."""
    spent = Spent()
    for result in results:
        usage = result.usage
        spent = spent.plus(Spent(usage.input_tokens, usage.output_tokens, result.cost))
    return spent


def spent_by(entries: Iterable[UsageEntry], price: Price | None) -> Spent:
    """What the ledger's ``entries`` spent — every entry, the passes' (reported, or
    estimated where the server reported none) and the reviewer's — priced at ``price``."""
    read = written = 0
    for entry in entries:
        read += entry.input_tokens
        written += entry.output_tokens
    return Spent(read, written, price.cost(read, written) if price is not None else None)


@frozen
class AttemptBudget:
    """What bounds one attempt besides its own `LoopPolicy.budget`: the model's ``price``,
    and the chain's budget with what the chain's earlier attempts spent of it."""

    price: Price | None = None
    chain: Budget | None = None
    chain_spent: Spent = Spent()


@frozen
class Room:
    """What the next pass may write: ``tokens`` of output, and the ceiling that allows no
    more (a pass that writes past ``tokens`` is cut there, reaching ``limit``)."""

    tokens: int
    limit: BudgetExceeded


def _budgets(
    policy: LoopPolicy, attempt: AttemptBudget | None, spent: Spent
) -> Iterator[tuple[Budget, BudgetScope, Spent]]:
    if policy.budget is not None:
        yield policy.budget, "turn", spent
    if attempt is not None and attempt.chain is not None:
        yield attempt.chain, "chain", attempt.chain_spent.plus(spent)


def price_of(policy: LoopPolicy, attempt: AttemptBudget | None) -> Price | None:
    """The price an attempt's tokens cost: its model's, else the policy's."""
    if attempt is not None and attempt.price is not None:
        return attempt.price
    return policy.price


def pass_allowance(
    policy: LoopPolicy,
    attempt: AttemptBudget | None,
    entries: Iterable[UsageEntry],
    reads: int,
) -> BudgetExceeded | Room | None:
    """docs/behaviour.md §2.8 rules 2–3, before a pass that is expected to read ``reads``
    tokens: the ceiling it would break (`BudgetExceeded`: the pass does not start), else the
    room the tightest ceiling leaves it to write (`Room`), or ``None`` when no budget is
    set."""
    if policy.budget is None and (attempt is None or attempt.chain is None):
        return None
    price = price_of(policy, attempt)
    spent = spent_by(entries, price)
    tightest: Room | None = None
    for budget, scope, so_far in _budgets(policy, attempt, spent):
        found = _allowance(budget, scope, so_far, reads, price)
        if isinstance(found, BudgetExceeded):
            return found
        if found is not None and (tightest is None or found.tokens < tightest.tokens):
            tightest = found
    return tightest


def _allowance(
    budget: Budget, scope: BudgetScope, spent: Spent, reads: int, price: Price | None
) -> BudgetExceeded | Room | None:
    if budget.input_tokens is not None and spent.input_tokens + reads > budget.input_tokens:
        return BudgetExceeded(scope, "input_tokens", budget.input_tokens, spent.input_tokens, reads)
    rooms: list[Room] = []
    if budget.output_tokens is not None:
        limit = BudgetExceeded(scope, "output_tokens", budget.output_tokens, spent.output_tokens)
        rooms.append(Room(budget.output_tokens - spent.output_tokens, limit))
    if budget.total_tokens is not None:
        limit = BudgetExceeded(
            scope, "total_tokens", budget.total_tokens, spent.total_tokens, reads
        )
        rooms.append(Room(budget.total_tokens - spent.total_tokens - reads, limit))
    if budget.cost is not None and price is not None:
        spent_cost = spent.cost or 0.0
        limit = BudgetExceeded(scope, "cost", budget.cost, spent_cost, price.cost(reads, 0))
        money = budget.cost - spent_cost - price.cost(reads, 0)
        per_token = price.output_per_million / 1_000_000
        if money < 0:
            rooms.append(Room(0, limit))
        elif per_token > 0:
            rooms.append(Room(int(money / per_token), limit))
        # free output: the cost ceiling bounds only what the pass reads
    if not rooms:
        return None
    room = min(rooms, key=lambda r: r.tokens)
    if room.tokens < 1:
        one = 1.0 if room.limit.limit != "cost" else _per_output_token(price)
        return attrs.evolve(room.limit, reserved=room.limit.reserved + one)
    return room


def _per_output_token(price: Price | None) -> float:
    return price.output_per_million / 1_000_000 if price is not None else 0.0


def cut_report(room: Room, written: int, price: Price | None) -> BudgetExceeded:
    """The ceiling a pass reached as it wrote ``written`` tokens against its ``room``: what
    the ledger held before the pass, what the pass reads, and what it wrote."""
    limit = room.limit
    if limit.limit == "cost":
        wrote = price.cost(0, written) if price is not None else 0.0
    else:
        wrote = written
    return attrs.evolve(limit, spent=limit.spent + limit.reserved + wrote, reserved=0)


def expected_reads(entries: Iterable[UsageEntry]) -> int:
    """What the next pass is expected to read: what the last pass read (a turn's context
    only grows), none before the first."""
    reads = 0
    for entry in entries:
        if entry.source == "author":
            reads = entry.input_tokens
    return reads
