"""The public test kit: scripted providers, a recording channel, a virtual clock, hostile
host behaviours, a scripted reviewer, Hypothesis strategies, the invariant checker, and the
world model that drives a sans-IO machine (`World`, `toolloop_fsm.testing.world`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import VirtualClock, real_time_limit, watchdog_timer
from toolloop_fsm.testing.hostile import (
    ChannelAct,
    EchoKey,
    HostCall,
    HostileChannel,
    HostileItem,
    HostileProvider,
    KeyEcho,
    RogueBaseException,
    Stragglers,
    Trickle,
    TurnDidNotReturn,
    fire_from_thread,
    key_runs,
    leaked_runs,
    mutate_in_place,
    returns_within,
)
from toolloop_fsm.testing.reviewer import Hang, Raise, ReviewerAct, ScriptedReviewer, Slow
from toolloop_fsm.testing.scripted import Fail, Pause, ScriptedProvider, ScriptItem

__all__ = [
    "ChannelAct",
    "EchoKey",
    "Fail",
    "Hang",
    "HostCall",
    "HostileChannel",
    "HostileItem",
    "HostileProvider",
    "KeyEcho",
    "Pause",
    "Raise",
    "RecordingChannel",
    "ReviewerAct",
    "RogueBaseException",
    "ScriptItem",
    "ScriptedProvider",
    "ScriptedReviewer",
    "Slow",
    "Stragglers",
    "Trickle",
    "TurnDidNotReturn",
    "VirtualClock",
    "fire_from_thread",
    "key_runs",
    "leaked_runs",
    "mutate_in_place",
    "real_time_limit",
    "returns_within",
    "watchdog_timer",
]

# ---- the invariant checker and the Hypothesis strategies
from toolloop_fsm.testing.invariants import (
    InvariantViolation,
    ReviewAsked,
    ToolExecution,
    call_identity,
    check_invariants,
)

if TYPE_CHECKING:
    from toolloop_fsm.testing.harness import ScriptRun, WitnessedReviewer, build_tools, run_script
    from toolloop_fsm.testing.strategies import (
        KNOWN_TOOLS,
        MEMORY_TOOL,
        PROVIDER_KEYS,
        UNKNOWN_TOOLS,
        TimedSignal,
        ToolAction,
        ToolBehaviour,
        ToolConfig,
        TurnScript,
        chunks,
        function_calls,
        loop_policies,
        provider_passes,
        reviewer_acts,
        reviewer_scripts,
        script_items,
        text_deltas,
        timed_signals,
        tool_behaviours,
        turn_scripts,
    )

#: Names served by `toolloop_fsm.testing.harness` (it needs the strategies' script values).
_HARNESS_NAMES = frozenset({"ScriptRun", "WitnessedReviewer", "build_tools", "run_script"})
#: Names served by `toolloop_fsm.testing.strategies`, imported on first use because that
#: module needs Hypothesis, a test dependency the rest of the kit does not need.
_STRATEGY_NAMES = frozenset(
    {
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
    }
)

__all__ += [
    "KNOWN_TOOLS",
    "MEMORY_TOOL",
    "PROVIDER_KEYS",
    "UNKNOWN_TOOLS",
    "InvariantViolation",
    "ReviewAsked",
    "ScriptRun",
    "TimedSignal",
    "ToolAction",
    "ToolBehaviour",
    "ToolConfig",
    "ToolExecution",
    "TurnScript",
    "WitnessedReviewer",
    "build_tools",
    "call_identity",
    "check_invariants",
    "chunks",
    "function_calls",
    "loop_policies",
    "provider_passes",
    "reviewer_acts",
    "reviewer_scripts",
    "run_script",
    "script_items",
    "text_deltas",
    "timed_signals",
    "tool_behaviours",
    "turn_scripts",
]

# ---- the outer tier: fallback-chain strategies, harness and checker
if TYPE_CHECKING:
    from toolloop_fsm.testing.chains import (
        CHAIN_INVARIANTS,
        REVIEW_CHAIN_INVARIANTS,
        SHARED_TOOLS,
        AttemptScript,
        ChainChannel,
        ChainInvariantViolation,
        ChainRun,
        ChainScript,
        ChainSignal,
        ChainToolExecution,
        Ending,
        ErrorKind,
        FirstRequest,
        KeyScript,
        KeyState,
        KeyUse,
        ModelScript,
        SharedRouteScript,
        TimelineEntry,
        ToolStep,
        attempt_scripts,
        chain_budget,
        chain_signals,
        check_chain_invariants,
        generation_chains,
        run_chain,
        turn_policies,
    )

#: Names served by `toolloop_fsm.testing.chains` (needs Hypothesis too: imported on first use).
_CHAIN_NAMES = frozenset(
    {
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
    }
)
__all__ += [
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
]


# ---- the reference model of a turn's ending (invariant 10; needs Hypothesis through the
# script types it reads: imported on first use)
if TYPE_CHECKING:
    from toolloop_fsm.testing.reference_model import (
        AmbiguousEnding,
        PredictedEnding,
        check_ending,
        describe_script,
        difference,
        ending_of,
        predict_ending,
        predict_endings,
    )

_REFERENCE_NAMES = frozenset(
    {
        "AmbiguousEnding",
        "PredictedEnding",
        "check_ending",
        "describe_script",
        "difference",
        "ending_of",
        "predict_ending",
        "predict_endings",
    }
)
__all__ += [
    "AmbiguousEnding",
    "PredictedEnding",
    "check_ending",
    "describe_script",
    "difference",
    "ending_of",
    "predict_ending",
    "predict_endings",
]


# ---- the world model around a sans-IO tool-loop machine (needs Hypothesis: imported on
# first use)
if TYPE_CHECKING:
    from toolloop_fsm.testing.world import Happening, World

_WORLD_NAMES = frozenset({"Happening", "World"})
__all__ += ["Happening", "World"]


def __getattr__(name: str) -> Any:
    if name in _WORLD_NAMES:
        from toolloop_fsm.testing import world

        return getattr(world, name)
    if name in _REFERENCE_NAMES:
        from toolloop_fsm.testing import reference_model

        return getattr(reference_model, name)
    if name in _HARNESS_NAMES:
        from toolloop_fsm.testing import harness

        return getattr(harness, name)
    if name in _STRATEGY_NAMES:
        from toolloop_fsm.testing import strategies

        return getattr(strategies, name)
    if name in _CHAIN_NAMES:
        from toolloop_fsm.testing import chains

        return getattr(chains, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
