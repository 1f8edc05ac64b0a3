"""Policies whose bugs a fuzz report must name (tests/test_fuzz_reports.py): a custom exit
rule that answers ``"no"`` instead of ``False``, and a policy factory that raises before any
turn runs."""

from __future__ import annotations

from toolloop_fsm.policy import ExitView
from toolloop_fsm.policy import LoopPolicy


def says_no(view: ExitView) -> bool:
    """Broken on purpose: answers with a word, which read as truthy would end every turn."""
    return "no"  # type: ignore[return-value]  # the bug under test


ANSWERS_NO = LoopPolicy(end_after_pre_tool_text=says_no)


def make_policy_from_settings() -> LoopPolicy:
    """Broken on purpose: a factory that fails on a setting before it builds the policy."""
    ceiling = int("twenty")
    return LoopPolicy(max_function_call_iterations=ceiling)
