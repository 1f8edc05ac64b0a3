"""The public names the test kit serves from its modules that need Hypothesis, by module.

Hypothesis is a test dependency the rest of the kit does not need, so `toolloop_fsm.testing`
imports those modules on first use of one of their names, and must know the names before it
imports them. Each of those modules takes its ``__all__`` from here too, so that a name the
kit serves is listed once. This module imports nothing: the package and every lazily
imported module can read it.
"""

from __future__ import annotations

#: `toolloop_fsm.testing.harness`, the runner of inner-tier scripts.
HARNESS_NAMES: tuple[str, ...] = ("ScriptRun", "WitnessedReviewer", "build_tools", "run_script")

#: `toolloop_fsm.testing.strategies`, the inner tier's Hypothesis strategies.
STRATEGY_NAMES: tuple[str, ...] = (
    "KNOWN_TOOLS",
    "MEMORY_TOOL",
    "PROVIDER_KEYS",
    "UNKNOWN_TOOLS",
    "TimedSignal",
    "ToolAction",
    "ToolBehaviour",
    "ToolConfig",
    "TurnScript",
    "chunks",
    "function_calls",
    "loop_policies",
    "provider_passes",
    "reviewer_acts",
    "reviewer_scripts",
    "script_items",
    "text_deltas",
    "timed_signals",
    "tool_behaviours",
    "turn_scripts",
)

#: `toolloop_fsm.testing.chains`, the outer tier's strategies, harness and checker.
CHAIN_NAMES: tuple[str, ...] = (
    "CHAIN_INVARIANTS",
    "REVIEW_CHAIN_INVARIANTS",
    "SHARED_TOOLS",
    "AttemptScript",
    "ChainChannel",
    "ChainInvariantViolation",
    "ChainRun",
    "ChainScript",
    "ChainSignal",
    "ChainToolExecution",
    "Ending",
    "ErrorKind",
    "FirstRequest",
    "KeyScript",
    "KeyState",
    "KeyUse",
    "ModelScript",
    "SharedRouteScript",
    "TimelineEntry",
    "ToolStep",
    "attempt_scripts",
    "chain_budget",
    "chain_signals",
    "check_chain_invariants",
    "generation_chains",
    "run_chain",
    "turn_policies",
)

#: `toolloop_fsm.testing.reference_model`, the reference model of a turn's ending
#: (invariant 10; it reads the strategies' script types).
REFERENCE_NAMES: tuple[str, ...] = (
    "AmbiguousEnding",
    "PredictedEnding",
    "check_ending",
    "describe_script",
    "difference",
    "ending_of",
    "predict_ending",
    "predict_endings",
)

#: `toolloop_fsm.testing.world`, the world model around a sans-IO tool-loop machine.
WORLD_NAMES: tuple[str, ...] = ("Happening", "World")

#: Each lazily imported module, by its name inside `toolloop_fsm.testing`, and the names the
#: kit serves from it.
LAZY_MODULES: dict[str, tuple[str, ...]] = {
    "harness": HARNESS_NAMES,
    "strategies": STRATEGY_NAMES,
    "chains": CHAIN_NAMES,
    "reference_model": REFERENCE_NAMES,
    "world": WORLD_NAMES,
}
