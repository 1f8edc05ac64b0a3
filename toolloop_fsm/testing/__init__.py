"""The public test kit: scripted providers, a recording channel, a virtual clock, hostile
host behaviours, a scripted reviewer, Hypothesis strategies, the invariant checker, and the
world model that drives a sans-IO machine (`World`, `toolloop_fsm.testing.world`)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import VirtualClock
from toolloop_fsm.testing.clock import real_time_limit
from toolloop_fsm.testing.clock import watchdog_timer
from toolloop_fsm.testing.hostile import ChannelAct
from toolloop_fsm.testing.hostile import EchoKey
from toolloop_fsm.testing.hostile import HostCall
from toolloop_fsm.testing.hostile import HostileChannel
from toolloop_fsm.testing.hostile import HostileItem
from toolloop_fsm.testing.hostile import HostileProvider
from toolloop_fsm.testing.hostile import KeyEcho
from toolloop_fsm.testing.hostile import RogueBaseException
from toolloop_fsm.testing.hostile import Stragglers
from toolloop_fsm.testing.hostile import Trickle
from toolloop_fsm.testing.hostile import TurnDidNotReturn
from toolloop_fsm.testing.hostile import fire_from_thread
from toolloop_fsm.testing.hostile import key_runs
from toolloop_fsm.testing.hostile import leaked_runs
from toolloop_fsm.testing.hostile import mutate_in_place
from toolloop_fsm.testing.hostile import returns_within
from toolloop_fsm.testing.reviewer import Hang
from toolloop_fsm.testing.reviewer import Raise
from toolloop_fsm.testing.reviewer import ReviewerAct
from toolloop_fsm.testing.reviewer import ScriptedReviewer
from toolloop_fsm.testing.reviewer import Slow
from toolloop_fsm.testing.scripted import Fail
from toolloop_fsm.testing.scripted import Pause
from toolloop_fsm.testing.scripted import ScriptedProvider
from toolloop_fsm.testing.scripted import ScriptItem

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
from toolloop_fsm.testing.invariants import InvariantViolation
from toolloop_fsm.testing.invariants import ReviewAsked
from toolloop_fsm.testing.invariants import ToolExecution
from toolloop_fsm.testing.invariants import call_identity
from toolloop_fsm.testing.invariants import check_invariants

if TYPE_CHECKING:
    from toolloop_fsm.testing.harness import ScriptRun
    from toolloop_fsm.testing.harness import WitnessedReviewer
    from toolloop_fsm.testing.harness import build_tools
    from toolloop_fsm.testing.harness import run_script
    from toolloop_fsm.testing.strategies import KNOWN_TOOLS
    from toolloop_fsm.testing.strategies import MEMORY_TOOL
    from toolloop_fsm.testing.strategies import PROVIDER_KEYS
    from toolloop_fsm.testing.strategies import UNKNOWN_TOOLS
    from toolloop_fsm.testing.strategies import TimedSignal
    from toolloop_fsm.testing.strategies import ToolAction
    from toolloop_fsm.testing.strategies import ToolBehaviour
    from toolloop_fsm.testing.strategies import ToolConfig
    from toolloop_fsm.testing.strategies import TurnScript
    from toolloop_fsm.testing.strategies import chunks
    from toolloop_fsm.testing.strategies import function_calls
    from toolloop_fsm.testing.strategies import loop_policies
    from toolloop_fsm.testing.strategies import provider_passes
    from toolloop_fsm.testing.strategies import reviewer_acts
    from toolloop_fsm.testing.strategies import reviewer_scripts
    from toolloop_fsm.testing.strategies import script_items
    from toolloop_fsm.testing.strategies import text_deltas
    from toolloop_fsm.testing.strategies import timed_signals
    from toolloop_fsm.testing.strategies import tool_behaviours
    from toolloop_fsm.testing.strategies import turn_scripts

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
    from toolloop_fsm.testing.chains import CHAIN_INVARIANTS
    from toolloop_fsm.testing.chains import REVIEW_CHAIN_INVARIANTS
    from toolloop_fsm.testing.chains import SHARED_TOOLS
    from toolloop_fsm.testing.chains import AttemptScript
    from toolloop_fsm.testing.chains import ChainChannel
    from toolloop_fsm.testing.chains import ChainInvariantViolation
    from toolloop_fsm.testing.chains import ChainRun
    from toolloop_fsm.testing.chains import ChainScript
    from toolloop_fsm.testing.chains import ChainSignal
    from toolloop_fsm.testing.chains import ChainToolExecution
    from toolloop_fsm.testing.chains import Ending
    from toolloop_fsm.testing.chains import ErrorKind
    from toolloop_fsm.testing.chains import FirstRequest
    from toolloop_fsm.testing.chains import KeyScript
    from toolloop_fsm.testing.chains import KeyState
    from toolloop_fsm.testing.chains import KeyUse
    from toolloop_fsm.testing.chains import ModelScript
    from toolloop_fsm.testing.chains import SharedRouteScript
    from toolloop_fsm.testing.chains import TimelineEntry
    from toolloop_fsm.testing.chains import ToolStep
    from toolloop_fsm.testing.chains import attempt_scripts
    from toolloop_fsm.testing.chains import chain_budget
    from toolloop_fsm.testing.chains import chain_signals
    from toolloop_fsm.testing.chains import check_chain_invariants
    from toolloop_fsm.testing.chains import generation_chains
    from toolloop_fsm.testing.chains import run_chain
    from toolloop_fsm.testing.chains import turn_policies

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
    from toolloop_fsm.testing.reference_model import AmbiguousEnding
    from toolloop_fsm.testing.reference_model import PredictedEnding
    from toolloop_fsm.testing.reference_model import check_ending
    from toolloop_fsm.testing.reference_model import describe_script
    from toolloop_fsm.testing.reference_model import difference
    from toolloop_fsm.testing.reference_model import ending_of
    from toolloop_fsm.testing.reference_model import predict_ending
    from toolloop_fsm.testing.reference_model import predict_endings

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
    from toolloop_fsm.testing.world import Happening
    from toolloop_fsm.testing.world import World

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
