"""Property tests of drafting and the tool checkpoint (docs/behaviour.md §8).

Inner tier: any scripted turn under a policy with drafting, the tool checkpoint or both on
(held-prose ceilings small enough to cut a reply, the host's send limit below it, small
review budgets and timeouts), answered by a scripted reviewer that passes, revises with 1–4
findings, gives no verdict, hangs, raises or answers slower or quicker than the review
timeout, keeps every invariant — those of every turn, and drafting's own: nothing held
reaches the user before the reviewer was asked for the last time, nor after a stop or a
follow-up; the review budgets hold; a revision never runs a successful call again; a
rejected call never runs; the delivered draft fits the ceiling and is what the reviewer saw.
The same holds with hostile hosts (channel calls that raise, hang or run long, tools that
misbehave, providers that quote their key).

Outer tier: a fallback chain whose attempts fail and stall shares one review state: the
budgets are the turn's, not each attempt's, and nothing an attempt held before it failed is
ever delivered.

Then the checker itself is shown not to be vacuous (a doctored result or chain is caught by
the invariant it breaks), and the engine bugs the properties found keep their regression
tests. (The reference model's predictions for drafted turns are tested in
tests/test_reference_model.py.)

Example counts: 300 a test under the ci profile (tests/conftest.py); any other profile's
own count (5,000 under explore).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import settings

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.fuzz import fuzz
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import Pass
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.review import Revise
from toolloop_fsm.testing import AttemptScript
from toolloop_fsm.testing import ChainInvariantViolation
from toolloop_fsm.testing import ChainRun
from toolloop_fsm.testing import ChainScript
from toolloop_fsm.testing import Ending
from toolloop_fsm.testing import Hang
from toolloop_fsm.testing import InvariantViolation
from toolloop_fsm.testing import ModelScript
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import ScriptRun
from toolloop_fsm.testing import TimedSignal
from toolloop_fsm.testing import ToolStep
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import check_chain_invariants
from toolloop_fsm.testing import check_invariants
from toolloop_fsm.testing import generation_chains
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing import run_chain
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing import turn_scripts
from toolloop_fsm.testing.hostile import HANG_GUARD_SECONDS

#: Examples per test under the ci profile: a drafted turn costs a little more to run than a
#: plain one (its reviews), and five properties share the ci budget.
CI_EXAMPLES = 300
#: Real seconds a hostile virtual-time turn may take before it counts as never returning.
HOSTILE_REAL_TIMEOUT = HANG_GUARD_SECONDS


def _examples() -> int:
    """300 under the ci profile; any other profile's own count (5,000 under explore)."""
    profile = os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    return CI_EXAMPLES if profile == "ci" else (settings.default or settings()).max_examples


def run_drafted(script: TurnScript, policy: LoopPolicy, *, real_timeout: float = 30.0) -> ScriptRun:
    """Run ``script`` through the engine and check every invariant the run can show."""
    run = asyncio.run(run_script(script, policy, real_timeout=real_timeout))
    result = run.result
    assert result.status in TurnStatus
    assert result.trace[-1].next_state == result.status.value
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


@settings(max_examples=_examples())
@given(
    script=turn_scripts(drafting=True, hostile=True),
    policy=loop_policies(drafting=None, review_tool_calls=True, hostile=True),
)
def test_a_reviewed_turn_with_hostile_hosts_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    """Drafting on or off, the checkpoint on, and hosts that misbehave in every way the kit
    knows: held text still reaches the user only once reviewed, and every wait (the
    reviewer's included) is bounded."""
    run_drafted(script, policy, real_timeout=HOSTILE_REAL_TIMEOUT)


# =========================================================================== the outer tier
@settings(max_examples=_examples())
@given(script=generation_chains(drafting=True))
def test_a_drafted_chain_shares_one_review_state_and_delivers_nothing_a_failed_attempt_held(
    script: ChainScript,
) -> None:
    run = asyncio.run(run_chain(script))
    check_chain_invariants(run)


# =========================================================================== examples
WEATHER = FunctionCall("get_weather", {"city": "Oslo"})
FLAT = Finding(FindingCategory.VOICE, "The reply sounds flat.", "Answer warmly.")
NOT_NEEDED = Finding(FindingCategory.TOOL_USE, "This call is not needed.", "Answer now.")
DRAFTING = LoopPolicy(drafting=True, delivery_flush_chars=1)
_FAST_LOOP = LoopPolicy(
    delivery_flush_chars=1, inactivity_timeout=2.0, first_token_timeout=3.0, tool_timeout=5.0
)


def test_a_rejection_and_the_review_budget_carry_to_the_next_attempt() -> None:
    """The checkpoint rejects a call in the first attempt, which then fails after writing
    "Part "; the second attempt asks for the same call: it is rejected again without a
    review, and the reply it writes is the turn's first review of a reply. Only that
    reply reaches the user."""
    lookup = ToolStep("lookup", {"q": "Oslo"})
    script = ChainScript(
        models=(
            ModelScript("m0", keyless=AttemptScript(Ending.FAIL, "Part ", tool_steps=(lookup,))),
            ModelScript("m1", keyless=AttemptScript(text="Done.", tool_steps=(lookup,))),
        ),
        policy=TurnPolicy(loop=attrs.evolve(_FAST_LOOP, drafting=True, review_tool_calls=True)),
        reviews=(Revise((NOT_NEEDED,)), Pass()),
    )
    chain = asyncio.run(run_chain(script))
    check_chain_invariants(chain)
    result = chain.result
    assert result is not None
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "draft_passed")
    assert chain.channel.delivered_text == "Done."
    assert [(a.kind, a.attempt, a.reviews_done) for a in chain.reviews_asked] == [
        (ReviewKind.TOOL_CALL, 1, 0),
        (ReviewKind.RESPONSE, 2, 0),
    ]
    assert chain.executions == ()
    # a fallback keeps the function history: the first attempt's rejection, then the second's
    assert [e.response.status for e in result.history] == ["review_rejected"] * 2


def test_a_held_draft_whose_first_delivery_fails_sends_none_of_the_rest() -> None:
    """Found by the drafting properties. The channel refuses the first piece of a delivered
    draft: the turn ends ``error`` (``host_error``) and the pieces after it are never sent
    — the user does not read the middle of a reply whose beginning was lost."""
    script = TurnScript(passes=((TextDelta("Hi"), TextDelta(" there")),), failing_delivery=0)
    run = run_drafted(script, DRAFTING)
    assert (run.result.status, run.result.reason) == (TurnStatus.ERROR, "host_error")
    assert run.channel.delivered == []
    assert run.result.delivered == ()


def test_a_cancelled_review_leaves_no_timer_behind_so_the_next_turn_on_the_loop_runs() -> None:
    """Found by fuzzing drafted turns on one event loop. A stop cancels a review; the turn
    returns; the next turn run on the same event loop (the kit runs many scripts on one)
    must not hang behind a timer the first left on its clock."""

    async def two_turns() -> tuple[ScriptRun, ScriptRun]:
        stopped = TurnScript(
            passes=((TextDelta("Almost."),),),
            reviews=(Hang(),),
            signals=(TimedSignal(1.0, "stop"),),
        )
        first = await run_script(stopped, DRAFTING)
        second = await run_script(
            TurnScript(passes=((Pause(5.0), TextDelta("Hi.")),)),
            DRAFTING,
            real_timeout=HOSTILE_REAL_TIMEOUT,
        )
        return first, second

    first, second = asyncio.run(two_turns())
    assert first.result.reason == "stopped_during_review"
    assert (second.result.status, second.result.reason) == (TurnStatus.COMPLETED, "draft_passed")
    assert second.elapsed == 5.0


# =========================================================================== the checker
def _expect(number: int, run: ScriptRun, **changes: Any) -> None:
    witnesses: dict[str, Any] = {
        "policy": run.policy,
        "channel": run.channel,
        "provider": run.provider,
        "executions": run.executions,
        "elapsed": run.elapsed,
        "streamed": run.streamed,
        "tools": run.tools,
        "request": run.request,
        "reviews_asked": run.reviews_asked,
    }
    result = changes.pop("result", run.result)
    witnesses.update(changes)
    with pytest.raises(InvariantViolation) as raised:
        check_invariants(result, **witnesses)
    assert raised.value.invariant == number, str(raised.value)


def test_the_checker_catches_held_text_shown_early_a_broken_budget_and_a_swapped_draft() -> None:
    script = TurnScript(
        passes=(
            (TextDelta("Let me look. "), WEATHER),
            (TextDelta("It is 3 °C."),),
            (WEATHER,),
            (TextDelta("Oslo: 3 °C, cold."),),
        ),
        reviews=(Revise((FLAT,)), Pass()),
    )
    run = run_drafted(script, DRAFTING)
    assert (run.result.status, run.result.reason) == (TurnStatus.COMPLETED, "draft_passed")
    assert run.channel.delivered_text == "Oslo: 3 °C, cold."
    assert len(run.executions) == 1  # the call repeated after the revision was reused
    first, last = run.reviews_asked
    # something reached the channel before the reviewer was asked
    early = (attrs.evolve(first, delivered_before=1), last)
    _expect(11, run, reviews_asked=early)
    # what was delivered is not what the reviewer passed
    swapped = (first, attrs.evolve(last, candidate="Oslo: sunny."))
    _expect(11, run, reviews_asked=swapped)
    # a third review of the reply, and a revision the budget had no room for
    _expect(2, run, policy=attrs.evolve(DRAFTING, max_reviews=1))
    _expect(2, run, policy=attrs.evolve(DRAFTING, max_revisions=0))
    # the held prose did not fit a ceiling of 20 bytes
    _expect(2, run, policy=attrs.evolve(DRAFTING, held_prose_max_bytes=20))
    # the successful call ran again after the revision
    again = attrs.evolve(run.executions[0], dispatch=2, iteration=3)
    doubled = attrs.evolve(run.result, tool_dispatches=2)
    _expect(4, run, executions=(*run.executions, again), result=doubled)


def test_the_checker_catches_a_draft_delivered_after_a_stop() -> None:
    script = TurnScript(
        passes=((TextDelta("Almost there."),),),
        reviews=(Hang(),),
        signals=(TimedSignal(1.0, "stop"),),
    )
    run = run_drafted(script, DRAFTING)
    assert (run.result.status, run.result.reason) == (
        TurnStatus.STOPPED_BY_USER,
        "stopped_during_review",
    )
    assert run.channel.delivered == [] and run.result.undelivered_text == "Almost there."
    # the same draft, had it been delivered
    passed = run_drafted(TurnScript(passes=((TextDelta("Almost there."),),)), DRAFTING)
    leaked = attrs.evolve(run.result, delivered=passed.result.delivered)
    _expect(11, run, result=leaked, channel=passed.channel)


def _drafted_chain() -> ChainRun:
    script = ChainScript(
        models=(
            ModelScript("m0", keyless=AttemptScript(Ending.FAIL, "Part ")),
            ModelScript("m1", keyless=AttemptScript(text="Done.")),
        ),
        policy=TurnPolicy(loop=attrs.evolve(_FAST_LOOP, drafting=True)),
    )
    chain = asyncio.run(run_chain(script))
    check_chain_invariants(chain)
    return chain


def test_the_chain_checker_catches_a_budget_per_attempt_and_a_failed_attempts_draft() -> None:
    chain = _drafted_chain()
    result = chain.result
    assert result is not None and result.status is TurnStatus.COMPLETED
    assert chain.channel.delivered_text == "Done."  # "Part " was held, never delivered
    (asked,) = chain.reviews_asked
    # a second attempt told that no review was done: the budget restarted per attempt
    again = attrs.evolve(asked, attempt=1, reviews_done=0)
    with pytest.raises(ChainInvariantViolation) as raised:
        check_chain_invariants(attrs.evolve(chain, reviews_asked=(again, asked)))
    assert raised.value.invariant == "review_budgets"
    # the failed attempt's held "Part " reached the channel
    failed, answered = result.attempts
    leaked = attrs.evolve(result, attempts=(attrs.evolve(failed, delivered_text="Part "), answered))
    with pytest.raises(ChainInvariantViolation) as raised:
        check_chain_invariants(attrs.evolve(chain, result=leaked))
    assert raised.value.invariant == "held_until_reviewed"


# =========================================================================== the fuzzer
def test_fuzzing_with_drafting_reviews_replies_and_calls_and_finds_nothing_broken() -> None:
    report = fuzz(LoopPolicy(), drafting=True, examples=60, seed=3)
    assert report.failure is None, report.failure
    assert {
        "completing_response --advance--> reviewing_draft",
        "gating_call --advance[call_needs_checkpoint]--> reviewing_call",
    } <= report.fired
