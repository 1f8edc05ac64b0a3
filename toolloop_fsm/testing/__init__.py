"""The public test kit: scripted providers, a recording channel, a virtual clock, hostile
host behaviours, a scripted reviewer, Hypothesis strategies, the invariant checker, and the
world model that drives a sans-IO machine (`World`, `toolloop_fsm.testing.world`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING
from typing import Any

from toolloop_fsm.testing._lazy_names import LAZY_MODULES
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
from toolloop_fsm.testing.invariants import InvariantViolation
from toolloop_fsm.testing.invariants import ReviewAsked
from toolloop_fsm.testing.invariants import ToolExecution
from toolloop_fsm.testing.invariants import call_identity
from toolloop_fsm.testing.invariants import check_invariants
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
    "InvariantViolation",
    "KeyEcho",
    "Pause",
    "Raise",
    "RecordingChannel",
    "ReviewAsked",
    "ReviewerAct",
    "RogueBaseException",
    "ScriptItem",
    "ScriptedProvider",
    "ScriptedReviewer",
    "Slow",
    "Stragglers",
    "ToolExecution",
    "Trickle",
    "TurnDidNotReturn",
    "VirtualClock",
    "call_identity",
    "check_invariants",
    "fire_from_thread",
    "key_runs",
    "leaked_runs",
    "mutate_in_place",
    "real_time_limit",
    "returns_within",
    "watchdog_timer",
]

# ---- the modules that need Hypothesis (a test dependency the rest of the kit does not need):
# imported on first use of one of their names; the `as` form tells a type checker that the
# package re-exports the name
if TYPE_CHECKING:
    from toolloop_fsm.testing.chains import CHAIN_INVARIANTS as CHAIN_INVARIANTS
    from toolloop_fsm.testing.chains import REVIEW_CHAIN_INVARIANTS as REVIEW_CHAIN_INVARIANTS
    from toolloop_fsm.testing.chains import SHARED_TOOLS as SHARED_TOOLS
    from toolloop_fsm.testing.chains import AttemptScript as AttemptScript
    from toolloop_fsm.testing.chains import ChainChannel as ChainChannel
    from toolloop_fsm.testing.chains import ChainInvariantViolation as ChainInvariantViolation
    from toolloop_fsm.testing.chains import ChainRun as ChainRun
    from toolloop_fsm.testing.chains import ChainScript as ChainScript
    from toolloop_fsm.testing.chains import ChainSignal as ChainSignal
    from toolloop_fsm.testing.chains import ChainToolExecution as ChainToolExecution
    from toolloop_fsm.testing.chains import Ending as Ending
    from toolloop_fsm.testing.chains import ErrorKind as ErrorKind
    from toolloop_fsm.testing.chains import FirstRequest as FirstRequest
    from toolloop_fsm.testing.chains import KeyScript as KeyScript
    from toolloop_fsm.testing.chains import KeyState as KeyState
    from toolloop_fsm.testing.chains import KeyUse as KeyUse
    from toolloop_fsm.testing.chains import ModelScript as ModelScript
    from toolloop_fsm.testing.chains import SharedRouteScript as SharedRouteScript
    from toolloop_fsm.testing.chains import TimelineEntry as TimelineEntry
    from toolloop_fsm.testing.chains import ToolStep as ToolStep
    from toolloop_fsm.testing.chains import attempt_scripts as attempt_scripts
    from toolloop_fsm.testing.chains import chain_budget as chain_budget
    from toolloop_fsm.testing.chains import chain_signals as chain_signals
    from toolloop_fsm.testing.chains import check_chain_invariants as check_chain_invariants
    from toolloop_fsm.testing.chains import generation_chains as generation_chains
    from toolloop_fsm.testing.chains import run_chain as run_chain
    from toolloop_fsm.testing.chains import turn_policies as turn_policies
    from toolloop_fsm.testing.harness import ScriptRun as ScriptRun
    from toolloop_fsm.testing.harness import WitnessedReviewer as WitnessedReviewer
    from toolloop_fsm.testing.harness import build_tools as build_tools
    from toolloop_fsm.testing.harness import run_script as run_script
    from toolloop_fsm.testing.reference_model import AmbiguousEnding as AmbiguousEnding
    from toolloop_fsm.testing.reference_model import PredictedEnding as PredictedEnding
    from toolloop_fsm.testing.reference_model import check_ending as check_ending
    from toolloop_fsm.testing.reference_model import describe_script as describe_script
    from toolloop_fsm.testing.reference_model import difference as difference
    from toolloop_fsm.testing.reference_model import ending_of as ending_of
    from toolloop_fsm.testing.reference_model import predict_ending as predict_ending
    from toolloop_fsm.testing.reference_model import predict_endings as predict_endings
    from toolloop_fsm.testing.strategies import KNOWN_TOOLS as KNOWN_TOOLS
    from toolloop_fsm.testing.strategies import MEMORY_TOOL as MEMORY_TOOL
    from toolloop_fsm.testing.strategies import PROVIDER_KEYS as PROVIDER_KEYS
    from toolloop_fsm.testing.strategies import UNKNOWN_TOOLS as UNKNOWN_TOOLS
    from toolloop_fsm.testing.strategies import TimedSignal as TimedSignal
    from toolloop_fsm.testing.strategies import ToolAction as ToolAction
    from toolloop_fsm.testing.strategies import ToolBehaviour as ToolBehaviour
    from toolloop_fsm.testing.strategies import ToolConfig as ToolConfig
    from toolloop_fsm.testing.strategies import TurnScript as TurnScript
    from toolloop_fsm.testing.strategies import chunks as chunks
    from toolloop_fsm.testing.strategies import function_calls as function_calls
    from toolloop_fsm.testing.strategies import loop_policies as loop_policies
    from toolloop_fsm.testing.strategies import provider_passes as provider_passes
    from toolloop_fsm.testing.strategies import reviewer_acts as reviewer_acts
    from toolloop_fsm.testing.strategies import reviewer_scripts as reviewer_scripts
    from toolloop_fsm.testing.strategies import script_items as script_items
    from toolloop_fsm.testing.strategies import text_deltas as text_deltas
    from toolloop_fsm.testing.strategies import timed_signals as timed_signals
    from toolloop_fsm.testing.strategies import tool_behaviours as tool_behaviours
    from toolloop_fsm.testing.strategies import turn_scripts as turn_scripts
    from toolloop_fsm.testing.world import Happening as Happening
    from toolloop_fsm.testing.world import World as World

__all__ += [name for names in LAZY_MODULES.values() for name in names]
#: The lazily imported module that serves each name.
_HOMES = {name: module for module, names in LAZY_MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
