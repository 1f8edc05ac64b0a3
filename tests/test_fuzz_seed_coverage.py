"""Fuzzing through compact seeds loses nothing the rich strategies found: every transition
the rich `turn_scripts()` path fires, the compact path of `toolloop-fsm fuzz` fires too, for
the plain machine and with drafting. (A file of its own beside tests/test_fuzz_seeds.py: its
two runs are the suite's longest, and the suite's workers share them better apart.)"""

from __future__ import annotations

import asyncio

import attrs
import pytest
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import given
from hypothesis import seed as seeded
from hypothesis import settings

from toolloop_fsm.fuzz import fuzz
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.stepping import Coverage
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing import turn_scripts
from toolloop_fsm.testing.strategies import TurnScript


# ----------------------------------------------------------------------------- coverage
def _rich_fired(policy: LoopPolicy, turns: int, seed: int) -> set[str]:
    """The transitions the rich strategies fire: one `turn_scripts()` turn per Hypothesis
    example, as `toolloop-fsm fuzz` ran before compact seeds."""
    fired: set[str] = set()
    loop = asyncio.new_event_loop()
    reviewed = policy.drafting or policy.review_tool_calls

    @settings(
        max_examples=turns,
        database=None,
        deadline=None,
        derandomize=False,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @seeded(seed)
    @given(turn_scripts(drafting=reviewed))
    def run(script: TurnScript) -> None:
        loop.run_until_complete(run_script(script, policy)).check()

    previous = Coverage.fired
    Coverage.fired = fired
    try:
        run()
    finally:
        Coverage.fired = previous
        loop.close()
    return fired


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drafting", "examples", "seed"),
    [(False, 3000, 5), (True, 8000, 6)],
    ids=["plain", "drafting"],
)
def test_the_compact_path_fires_every_transition_the_rich_path_fires(
    drafting: bool, examples: int, seed: int
) -> None:
    # (the plain machine's transitions are all reached by 3,000 compact turns; the drafting
    # ones need 8,000: at 4,000 two are still missing. Under the checkpoint a fourth
    # identical call — the repeated-call guard — is rare: seed 5 first reaches it past
    # 16,000 turns, seed 6 within 8,000)
    policy = LoopPolicy()
    rich = _rich_fired(
        attrs.evolve(policy, drafting=True, review_tool_calls=True) if drafting else policy,
        turns=1500,
        seed=0,
    )
    compact = fuzz(policy, examples=examples, seed=seed, drafting=drafting)
    assert compact.failure is None
    assert rich - compact.fired == (_COMPACT_GAPS if drafting else set())


#: What the rich path fires and the compact path, at the budget above, does not: a channel
#: that does not return while a call is reviewed. Since messages held during a turn came in
#: (docs/behaviour.md §8.5) the rich strategies reach it through a turn answering two held
#: messages with a 40 s delivery; no compact seed of 6 to 13 at 8,000 turns (nor 6 and 9 at
#: 12,000) does. The transition itself is fired by tests/test_transition_coverage.py; making
#: the compact fuzzer reach it is the fuzzing work of issue 30. Pinned, so that a second gap
#: (or this one closing) fails the test.
_COMPACT_GAPS = {"reviewing_call --delivery_failed[delivery_timed_out]--> building_result"}
