"""Property tests of drafting and the tool checkpoint (docs/behaviour.md §8).

Inner tier: any scripted turn under a policy with drafting, the tool checkpoint or both on
(held-prose ceilings small enough to cut a reply, the host's send limit below it, small
review budgets and timeouts), answered by a scripted reviewer that passes, revises with 1–4
findings, gives no verdict, hangs, raises or answers slower or quicker than the review
timeout, keeps every invariant — the ten of every turn and drafting's own: nothing held
reaches the user before the reviewer was asked for the last time, nor after a stop; the
review budgets hold; a revision never runs a successful call again; the delivered draft fits
the ceiling and is what the reviewer saw.

Outer tier: a fallback chain whose attempts fail and stall shares one review state: the
budgets are the turn's, not each attempt's, and nothing an attempt held before it failed is
ever delivered.

Example counts: 200 a test under the ci profile (tests/conftest.py); any other profile's
own count (5,000 under explore).
"""

from __future__ import annotations

import asyncio
import os

from hypothesis import given, settings

from toolloop_fsm.events import TextDelta
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.testing import (
    ScriptRun,
    TurnScript,
    loop_policies,
    run_script,
    turn_scripts,
)

#: Examples per test under the ci profile: each drafted turn costs a little more to run
#: than a plain one (its reviews), and the three inner tests share the ci budget.
CI_EXAMPLES = 200


def _examples() -> int:
    profile = os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    return CI_EXAMPLES if profile == "ci" else (settings.default or settings()).max_examples


def run_drafted(script: TurnScript, policy: LoopPolicy) -> ScriptRun:
    run = asyncio.run(run_script(script, policy))
    result = run.result
    assert result.status in TurnStatus
    assert result.iterations <= policy.max_function_call_iterations
    run.check()
    return run


# =========================================================================== the inner tier
@settings(max_examples=_examples())
@given(
    script=turn_scripts(drafting=True),
    policy=loop_policies(drafting=True, review_tool_calls=False),
)
def test_a_drafted_turn_shows_nothing_before_its_review_and_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    run_drafted(script, policy)


@settings(max_examples=_examples())
@given(
    script=turn_scripts(drafting=True),
    policy=loop_policies(drafting=False, review_tool_calls=True),
)
def test_a_checkpointed_turn_runs_no_rejected_call_and_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    run_drafted(script, policy)


@settings(max_examples=_examples())
@given(
    script=turn_scripts(drafting=True),
    policy=loop_policies(drafting=True, review_tool_calls=True),
)
def test_a_drafted_and_checkpointed_turn_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    run_drafted(script, policy)


# =========================================================================== found by the properties
def test_a_held_draft_whose_first_delivery_fails_sends_none_of_the_rest() -> None:
    """The channel refuses the first piece of a delivered draft: the turn ends ``error``
    (``host_error``) and the pieces after it are never sent — the user does not read the
    middle of a reply whose beginning was lost."""
    script = TurnScript(passes=((TextDelta("Hi"), TextDelta(" there")),), failing_delivery=0)
    policy = LoopPolicy(drafting=True, delivery_flush_chars=1)
    run = run_drafted(script, policy)
    assert (run.result.status, run.result.reason) == (TurnStatus.ERROR, "host_error")
    assert run.channel.delivered == []
    assert run.result.delivered == ()
