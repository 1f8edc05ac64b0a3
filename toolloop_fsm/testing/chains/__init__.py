"""Hypothesis strategies for fuzzing the outer tier (the fallback chain), the harness that
runs them, and the chain invariant checker.

`generation_chains()` draws a `ChainScript`: a fallback chain of 1–4 models with 0–3 API
keys each, what each attempt does (per keyless model, per key), an optional shared route,
host signals at virtual instants, the host's behaviour (key book, channel) and a small
`TurnPolicy`. `run_chain(script)` runs it through `run_generation_turn` on a
`VirtualClock` and returns a `ChainRun` holding the result and every witness;
`check_chain_invariants(run)` raises `ChainInvariantViolation` naming what broke::

    @given(script=generation_chains())
    def test_my_chain_policy(script):
        run = asyncio.run(run_chain(script))
        check_chain_invariants(run)

The keys are fake but unique (``sk-test-<hex>``), so a key that leaks into a result, a
trace, a notice, a log record or an exception message is found by plain substring search.
With ``echo_keys`` the scripted providers and factories behave like careless real ones and
put their key into their error messages, and the model echoes its key in its reply (split
over two chunks), which the engine must keep out of everything it returns and delivers.

Strategies shrink toward short chains: one model, no keys, an attempt that simply answers,
no shared route, no signals. Like `toolloop_fsm.testing.strategies`, this module needs
Hypothesis; `toolloop_fsm.testing` imports it lazily.
"""

from toolloop_fsm.testing.chains.harness import ChainChannel
from toolloop_fsm.testing.chains.harness import ChainRun
from toolloop_fsm.testing.chains.harness import ChainToolExecution
from toolloop_fsm.testing.chains.harness import FirstRequest
from toolloop_fsm.testing.chains.harness import KeyUse
from toolloop_fsm.testing.chains.harness import TimelineEntry
from toolloop_fsm.testing.chains.harness import run_chain
from toolloop_fsm.testing.chains.invariants import CHAIN_INVARIANTS
from toolloop_fsm.testing.chains.invariants import REVIEW_CHAIN_INVARIANTS
from toolloop_fsm.testing.chains.invariants import ChainInvariantViolation
from toolloop_fsm.testing.chains.invariants import check_chain_invariants
from toolloop_fsm.testing.chains.script import SHARED_TOOLS
from toolloop_fsm.testing.chains.script import AttemptScript
from toolloop_fsm.testing.chains.script import ChainScript
from toolloop_fsm.testing.chains.script import ChainSignal
from toolloop_fsm.testing.chains.script import Ending
from toolloop_fsm.testing.chains.script import ErrorKind
from toolloop_fsm.testing.chains.script import KeyScript
from toolloop_fsm.testing.chains.script import KeyState
from toolloop_fsm.testing.chains.script import ModelScript
from toolloop_fsm.testing.chains.script import SharedRouteScript
from toolloop_fsm.testing.chains.script import ToolStep
from toolloop_fsm.testing.chains.script import chain_budget
from toolloop_fsm.testing.chains.strategies import attempt_scripts
from toolloop_fsm.testing.chains.strategies import chain_signals
from toolloop_fsm.testing.chains.strategies import generation_chains
from toolloop_fsm.testing.chains.strategies import turn_policies

__all__ = [
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
