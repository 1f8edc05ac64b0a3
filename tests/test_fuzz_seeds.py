"""Compact seeds for `toolloop-fsm fuzz` (issue #14): the seed expander, the batches, and
that fuzzing through them loses nothing the rich strategies found.

* The expander is total and deterministic: any byte string is a turn the engine runs with
  every invariant holding, the same turn every time; the empty seed is the simplest turn,
  the very one `turn_scripts()` shrinks to (one builder serves both).
* Shrinking: a deliberately broken policy is found through batches of seeds and shrunk to
  one turn of a minimal script.
* Transition coverage (tests/test_fuzz_seed_coverage.py): over a fixed seed, the compact
  path fires every transition the rich strategies fire (plain and ``--drafting``).
"""

from __future__ import annotations

import asyncio

from hypothesis import find
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.fuzz_policies import BROKEN
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.fuzz import fuzz
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing import turn_scripts
from toolloop_fsm.testing.seeds import SeedReader
from toolloop_fsm.testing.seeds import case_from_seed
from toolloop_fsm.testing.seeds import turn_from_seed
from toolloop_fsm.testing.strategies import KNOWN_TOOLS
from toolloop_fsm.testing.strategies import TurnScript


# ----------------------------------------------------------------------------- the expander
@settings(max_examples=150)
@given(seed=st.binary(max_size=160), drafting=st.booleans(), hostile=st.booleans())
def test_any_seed_is_a_turn_that_runs_and_keeps_every_invariant(
    seed: bytes, drafting: bool, hostile: bool
) -> None:
    script, policy = case_from_seed(
        seed, hostile=hostile, drafting=None if drafting else False, review_tool_calls=None
    )
    assert (script, policy) == case_from_seed(
        seed, hostile=hostile, drafting=None if drafting else False, review_tool_calls=None
    )
    assert 1 <= len(script.passes) <= 6
    assert all(name in KNOWN_TOOLS and len(plan) <= 3 for name, plan in script.tool_plan)
    assert len(script.signals) <= 2
    run = asyncio.run(run_script(script, policy))
    run.check()


@settings(max_examples=100)
@given(seed=st.binary(max_size=200))
def test_the_expander_reads_the_same_turn_from_the_same_bytes(seed: bytes) -> None:
    first = turn_from_seed(seed, drafting=True)
    assert turn_from_seed(bytes(seed), drafting=True) == first
    # bytes past the end read as zeros: a seed padded with zeros is the same turn
    assert turn_from_seed(seed + bytes(64), drafting=True) == first


def test_the_empty_seed_is_the_simplest_turn_the_strategies_shrink_to() -> None:
    simplest = find(turn_scripts(), lambda _script: True)
    assert turn_from_seed(b"") == turn_from_seed(bytes(96)) == simplest == TurnScript(passes=((),))
    policy = find(loop_policies(), lambda _policy: True)
    assert case_from_seed(b"") == (simplest, policy)


def test_a_smaller_byte_picks_an_earlier_entry_of_the_menu() -> None:
    menu = tuple(range(7))
    picked = [SeedReader(bytes([b])).pick(menu) for b in range(256)]
    assert picked == sorted(picked)
    assert picked[0] == 0 and picked[-1] == 6 and set(picked) == set(menu)
    # a menu longer than a byte can index reads two
    long_menu = tuple(range(1000))
    reader = SeedReader(bytes([255, 255]))
    assert reader.pick(long_menu) == 999 and reader.used == 2


# ----------------------------------------------------------------------------- shrinking
def test_a_broken_policy_is_found_and_shrunk_to_one_minimal_turn() -> None:
    report = fuzz(BROKEN, examples=200, seed=1)
    failure = report.failure
    assert failure is not None
    assert failure.message == "IndexError: list index out of range"
    assert failure.batch == 1 and failure.turn == 1
    assert failure.seed is not None
    script = turn_from_seed(failure.seed)
    # one pass: one word of text before a call to a tool that succeeds; nothing else
    assert len(script.passes) == 1
    (items,) = script.passes
    assert len(items) == 2
    text, call = items
    assert isinstance(text, TextDelta) and len(text.text.split()) == 1
    assert isinstance(call, FunctionCall) and call.name in KNOWN_TOOLS
    assert script.tool_plan == () and script.signals == ()
    assert script == TurnScript(passes=script.passes, tools_allowed=script.tools_allowed)
    assert repr(script) in failure.example
