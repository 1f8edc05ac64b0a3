"""A policy module that cannot be imported: building its policy at import raises
(tests/test_fuzz_reports.py)."""

from __future__ import annotations

from toolloop_fsm.policy import LoopPolicy

NO_PASSES = LoopPolicy(max_function_call_iterations=0)
