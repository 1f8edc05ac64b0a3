"""The public test kit: scripted providers, a recording channel, a virtual clock,
Hypothesis strategies and the invariant checker."""

from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.clock import VirtualClock
from toolloop_fsm.testing.scripted import Fail, Pause, ScriptedProvider, ScriptItem

__all__ = [
    "Fail",
    "Pause",
    "RecordingChannel",
    "ScriptItem",
    "ScriptedProvider",
    "VirtualClock",
]
