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

from toolloop_fsm.testing._lazy_names import CHAIN_NAMES
from toolloop_fsm.testing.chains.harness import ChainChannel as ChainChannel
from toolloop_fsm.testing.chains.harness import ChainRun as ChainRun
from toolloop_fsm.testing.chains.harness import ChainToolExecution as ChainToolExecution
from toolloop_fsm.testing.chains.harness import FirstRequest as FirstRequest
from toolloop_fsm.testing.chains.harness import KeyUse as KeyUse
from toolloop_fsm.testing.chains.harness import TimelineEntry as TimelineEntry
from toolloop_fsm.testing.chains.harness import run_chain as run_chain
from toolloop_fsm.testing.chains.invariants import CHAIN_INVARIANTS as CHAIN_INVARIANTS
from toolloop_fsm.testing.chains.invariants import (
    REVIEW_CHAIN_INVARIANTS as REVIEW_CHAIN_INVARIANTS,
)
from toolloop_fsm.testing.chains.invariants import (
    ChainInvariantViolation as ChainInvariantViolation,
)
from toolloop_fsm.testing.chains.invariants import check_chain_invariants as check_chain_invariants
from toolloop_fsm.testing.chains.script import SHARED_TOOLS as SHARED_TOOLS
from toolloop_fsm.testing.chains.script import AttemptScript as AttemptScript
from toolloop_fsm.testing.chains.script import ChainScript as ChainScript
from toolloop_fsm.testing.chains.script import ChainSignal as ChainSignal
from toolloop_fsm.testing.chains.script import Ending as Ending
from toolloop_fsm.testing.chains.script import ErrorKind as ErrorKind
from toolloop_fsm.testing.chains.script import KeyScript as KeyScript
from toolloop_fsm.testing.chains.script import KeyState as KeyState
from toolloop_fsm.testing.chains.script import ModelScript as ModelScript
from toolloop_fsm.testing.chains.script import SharedRouteScript as SharedRouteScript
from toolloop_fsm.testing.chains.script import ToolStep as ToolStep
from toolloop_fsm.testing.chains.script import chain_budget as chain_budget
from toolloop_fsm.testing.chains.strategies import attempt_scripts as attempt_scripts
from toolloop_fsm.testing.chains.strategies import chain_signals as chain_signals
from toolloop_fsm.testing.chains.strategies import generation_chains as generation_chains
from toolloop_fsm.testing.chains.strategies import turn_policies as turn_policies

# the kit's table lists the names once (the imports' `as` form tells a type checker that
# they are re-exported)
__all__ = list(CHAIN_NAMES)
