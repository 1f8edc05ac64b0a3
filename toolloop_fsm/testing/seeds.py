"""Compact seeds: a whole simulated turn from a short byte string, without Hypothesis.

Hypothesis spends hundreds of microseconds on each example and tens on each draw, so a
fuzzing host that drew every turn with `turn_scripts()` would spend most of its time
generating. Here Hypothesis draws one byte string per turn (`seed_batches`: a batch of them
per example) and `SeedReader` — the builders' `Choices` read from those bytes — expands each
into the very `TurnScript` (and `LoopPolicy`) the strategies build, from the same menus in
plain Python — tool batches of 2 to 6 calls among the passes' endings, barriers among the
tools and a parallel limit in the policy included. `tool_batch_case_from_seed` reads a turn of
tool batches (`tool_batches()`) the same way.

Each choice reads one byte (a menu longer than 256 entries, two), scaled onto the menu so
that a smaller byte picks an earlier entry; a list's length is one byte scaled onto its
allowed sizes. Byte 0 — and every byte past the end of the seed — is the simplest choice.
So Hypothesis, shrinking a failing seed toward zeros and fewer bytes, shrinks the turn
toward the simplest one that still fails, as it does with the strategies; and any byte
string is a valid turn.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

from hypothesis import strategies as st

from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.testing.strategies import TurnScript
from toolloop_fsm.testing.strategies import build_policy
from toolloop_fsm.testing.strategies import build_script
from toolloop_fsm.testing.strategies import build_tool_batches

__all__ = [
    "SEED_SIZE",
    "SeedReader",
    "case_from_seed",
    "seed_batches",
    "tool_batch_case_from_seed",
    "turn_from_seed",
]

_T = TypeVar("_T")

#: Bytes a seed holds: about what the richest turns read (a turn reading past its seed's end
#: takes the simplest entries for the rest). Hypothesis spends about 0.5 µs a byte.
SEED_SIZE = 96


class SeedReader:
    """The builders' `Choices`, read from ``seed`` front to back."""

    __slots__ = ("_at", "_end", "_seed")

    def __init__(self, seed: bytes) -> None:
        self._seed = seed
        self._end = len(seed)
        self._at = 0

    @property
    def used(self) -> int:
        """How many bytes the choices so far read (past the end included)."""
        return self._at

    # The byte reads are written out in each method: a turn makes about 50 choices, and a
    # call per byte would be a third of the expansion's time.
    def pick(self, menu: Sequence[_T]) -> _T:
        n = len(menu)
        if n == 1:
            return menu[0]  # no choice to make: no byte read (as Hypothesis draws nothing)
        at = self._at
        if n <= 256:
            self._at = at + 1
            return menu[(self._seed[at] if at < self._end else 0) * n >> 8]
        self._at = at + 2
        high = self._seed[at] if at < self._end else 0
        low = self._seed[at + 1] if at + 1 < self._end else 0
        return menu[((high << 8) | low) * n >> 16]

    def flag(self) -> bool:
        at = self._at
        self._at = at + 1
        return at < self._end and self._seed[at] >= 128

    def _size(self, min_size: int, max_size: int) -> int:
        at = self._at
        self._at = at + 1
        byte = self._seed[at] if at < self._end else 0
        return min_size + (byte * (max_size - min_size + 1) >> 8)

    def picks(self, menu: Sequence[_T], min_size: int, max_size: int) -> list[_T]:
        pick = self.pick
        return [pick(menu) for _ in range(self._size(min_size, max_size))]

    def several(
        self, min_size: int, max_size: int, build: Callable[..., _T], *args: Any
    ) -> list[_T]:
        return [build(self, *args) for _ in range(self._size(min_size, max_size))]


def turn_from_seed(seed: bytes, *, hostile: bool = False, drafting: bool = False) -> TurnScript:
    """The `TurnScript` ``seed`` stands for, as `turn_scripts(hostile=…, drafting=…)` builds
    it (defaults for the other sizes)."""
    return build_script(SeedReader(seed), hostile=hostile, drafting=drafting)


def case_from_seed(
    seed: bytes,
    *,
    hostile: bool = False,
    drafting: bool | None = False,
    review_tool_calls: bool | None = False,
) -> tuple[TurnScript, LoopPolicy]:
    """A script and a policy from one seed: the script as `turn_from_seed` reads it (the
    reviewer's script too when the policy can review), then the policy from the bytes after
    it, as `loop_policies(hostile=…, drafting=…, review_tool_calls=…)` builds it."""
    reader = SeedReader(seed)
    reviewed = drafting is not False or review_tool_calls is not False
    script = build_script(reader, hostile=hostile, drafting=reviewed)
    policy = build_policy(
        reader, hostile=hostile, drafting=drafting, review_tool_calls=review_tool_calls
    )
    return script, policy


def tool_batch_case_from_seed(
    seed: bytes, *, hostile: bool = False
) -> tuple[TurnScript, LoopPolicy]:
    """A turn of tool batches and a policy from one seed: the script as
    `tool_batches(hostile=…)` builds it (mixed outcomes and durations, signals landing
    mid-batch), then the policy from the bytes after it, as `loop_policies(hostile=…)`
    builds it (a parallel limit of 1 to 3 now and then)."""
    reader = SeedReader(seed)
    script = build_tool_batches(reader, hostile)
    return script, build_policy(reader, hostile=hostile)


def seed_batches(
    max_turns: int, *, seed_size: int = SEED_SIZE
) -> st.SearchStrategy[tuple[bytes, ...]]:
    """One Hypothesis example for a fuzzing host: 1 to ``max_turns`` seeds of ``seed_size``
    bytes. The count is drawn first, then the seeds: Hypothesis shrinks such a count by
    lowering it and deleting the seeds before the one that fails, so a failing batch shrinks
    to that one seed, which then shrinks byte by byte."""
    counts = st.integers(1, max_turns)
    seeds = st.binary(min_size=seed_size, max_size=seed_size)

    @st.composite
    def batches(draw: st.DrawFn) -> tuple[bytes, ...]:
        return tuple(draw(seeds) for _ in range(draw(counts)))

    return batches()
