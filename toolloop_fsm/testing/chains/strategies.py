"""Hypothesis strategies drawing fallback chains (`generation_chains`) and their parts."""

from __future__ import annotations

import hashlib

import attrs
from hypothesis import strategies as st

from toolloop_fsm.policy import Budget
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.testing.chains.script import _ARGUMENTS
from toolloop_fsm.testing.chains.script import _TOOL_TIMEOUT
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
from toolloop_fsm.testing.strategies import _reviewed_policies
from toolloop_fsm.testing.strategies import reviewer_scripts

# --------------------------------------------------------------------------- strategies
# Menus are ordered simplest first: Hypothesis shrinks `sampled_from` toward the first entry.
_TEXTS: tuple[str, ...] = (
    "Hello.",
    "It is sunny ",
    "ü 日本 ",
    "The answer is 42. ",
    "Oslo: 3 °C. ",
)
_PAUSES: tuple[float, ...] = (0.0, 0.0, 0.5, 1.0)
_STALLS: tuple[float, ...] = (30.0, 8.0)
_RETRY_AFTER: tuple[float | None, ...] = (None, 7.0, 0.5)
_INSTANTS: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.5, 6.0, 9.0, 15.0, 40.0)
#: Failures and stalls (what moves a chain along) are two thirds of the endings; an empty
#: response (final, and ending the chain at once) one in twelve.
_ENDINGS: tuple[Ending, ...] = (
    *(Ending.SUCCESS, Ending.FAIL, Ending.FAIL, Ending.STALL),
    *(Ending.SUCCESS, Ending.FAIL, Ending.FAIL, Ending.STALL),
    *(Ending.SUCCESS, Ending.FAIL, Ending.FAIL, Ending.EMPTY),
)
_ERROR_KINDS: tuple[ErrorKind, ...] = tuple(ErrorKind)
#: (state in the key book, the factory raises): mostly healthy keys that build a provider
_KEY_HOST = st.sampled_from(
    ((KeyState.HEALTHY, False),) * 20
    + ((KeyState.COOLING, False), (KeyState.RETIRED, False), (KeyState.HEALTHY, True))
)


def _ending_menus() -> dict[Ending, tuple[AttemptScript, ...]]:
    """Every last pass worth drawing, per ending, simplest first. One draw picks the ending,
    one draw its details: Hypothesis spends ~60 µs a draw, and a chain holds up to 16
    attempt scripts."""
    texts = (*_TEXTS, "", " ")  # "": fails or stalls before the first token; " ": blank
    fails = [
        AttemptScript(Ending.FAIL, text, error=kind, retry_after=after)
        for kind in _ERROR_KINDS
        for after in (_RETRY_AFTER if kind is ErrorKind.RATE_LIMIT else (None,))
        for text in texts
    ]
    return {
        # an answer is visible text (blank once: whitespace only is an empty response)
        Ending.SUCCESS: tuple(
            AttemptScript(Ending.SUCCESS, text, pause=pause)
            for pause in _PAUSES
            for text in (*_TEXTS, *_TEXTS, " ")
        ),
        Ending.FAIL: tuple(fails),
        Ending.STALL: tuple(
            AttemptScript(Ending.STALL, text, stall=stall) for stall in _STALLS for text in texts
        ),
        Ending.EMPTY: (AttemptScript(Ending.EMPTY, ""),),
    }


_ENDING_MENUS = _ending_menus()
_LAST_PASSES = {ending: st.sampled_from(menu) for ending, menu in _ENDING_MENUS.items()}
_TOOL_STEPS: tuple[ToolStep, ...] = tuple(
    ToolStep(tool, arguments, text)
    for text in ("", "Let me check. ")
    for arguments in _ARGUMENTS
    for tool in SHARED_TOOLS
)


def attempt_scripts(*, max_tool_steps: int = 2) -> st.SearchStrategy[AttemptScript]:
    """What one attempt does: up to ``max_tool_steps`` passes calling shared tools (the same
    few calls in every attempt, so completed calls come back), then a last pass that
    answers, fails with every `ErrorKind` (rate limits with and without ``retry_after``)
    after optional partial text, stalls past the budgets, or is empty."""
    steps = st.lists(st.sampled_from(_TOOL_STEPS), max_size=max_tool_steps).map(tuple)

    @st.composite
    def scripts(draw: st.DrawFn) -> AttemptScript:
        last = draw(_LAST_PASSES[draw(st.sampled_from(_ENDINGS))])
        tool_steps = draw(steps)
        return attrs.evolve(last, tool_steps=tool_steps) if tool_steps else last

    return scripts()


def chain_signals() -> st.SearchStrategy[ChainSignal]:
    """A stop (with or without a message), a follow-up, or an unreachable report at a
    virtual instant from a small menu (so that signals coincide with other events)."""
    return st.builds(
        ChainSignal,
        at=st.sampled_from(_INSTANTS),
        kind=st.sampled_from(("stop", "follow_up", "stop", "unreachable")),
        stop_message=st.sampled_from((None, "sorry, stopping")),
    )


def turn_policies(*, drafting: bool = False) -> st.SearchStrategy[TurnPolicy]:
    """`TurnPolicy` values with short budgets (stalls of the scripts always exceed them,
    their pauses never do), 1–3 key attempts per model, the shared route allowed or not,
    deliveries flushed every 1–16 characters (so partial text is really delivered), and
    now and then a token ceiling per attempt or for the chain.
    ``drafting``: drafting, the tool checkpoint or both are on, with small review budgets
    and held-prose ceilings (as `toolloop_fsm.testing.loop_policies` draws them)."""
    loops: st.SearchStrategy[LoopPolicy] = st.builds(
        LoopPolicy,
        max_function_call_iterations=st.sampled_from((6, 3, 2)),
        inactivity_timeout=st.sampled_from((2.0, 3.0)),
        first_token_timeout=st.sampled_from((3.0, 2.0, 4.0)),
        abandoned_stream_settle=st.sampled_from((1.0, 0.0)),
        tool_timeout=st.just(_TOOL_TIMEOUT),
        delivery_flush_chars=st.sampled_from((1, 4, 16)),
        budget=_BUDGETS,
    )
    if drafting:
        loops = st.one_of(
            _reviewed_policies(loops, True, None), _reviewed_policies(loops, False, True)
        )
    return st.builds(
        TurnPolicy,
        loop=loops,
        max_key_attempts_per_model=st.integers(1, 3),
        allow_shared_route=st.booleans(),
        budget=_BUDGETS,
    )


#: No budget most often, else a token ceiling an attempt's reply or two reach: per attempt
#: (`LoopPolicy.budget`) and for the chain (`TurnPolicy.budget`), docs/behaviour.md §2.8.
_BUDGETS = st.sampled_from(
    (None, None, None, None, None, Budget(output_tokens=4), Budget(total_tokens=40))
)


def _fake_key(salt: int, route: str, model: int, key: int) -> str:
    digest = hashlib.sha256(f"{salt}:{route}:{model}:{key}".encode()).hexdigest()
    return f"sk-test-{digest[:24]}"


def _models(
    draw: st.DrawFn,
    route: str,
    count: int,
    salt: int,
    attempts: st.SearchStrategy[AttemptScript],
    keys: st.SearchStrategy[int],
) -> tuple[ModelScript, ...]:
    models = []
    for index in range(count):
        n_keys = draw(keys)
        scripts = tuple(
            KeyScript(_fake_key(salt, route, index, k), draw(attempts), *draw(_KEY_HOST))
            for k in range(n_keys)
        )
        keyless = draw(attempts) if n_keys == 0 else AttemptScript()
        label = f"{'s' if route == 'shared' else 'm'}{index}"
        models.append(ModelScript(label, scripts, keyless, draw(_TOOL_CALLING)))
    return tuple(models)


# Strategies are built once: building one per draw costs more than the draw itself.
_SALTS = st.integers(0, 2**32 - 1)
_SHARED_MODELS = st.integers(1, 2)
_ONE_IN_THREE = st.integers(0, 2)
_ONE_IN_TEN = st.integers(0, 9)
_BROKEN_INDEX = st.integers(0, 3)
_BROKEN_KIND = st.sampled_from(("unreachable", "refused"))
_ADMISSION_DELAYS = st.sampled_from((0.0, 0.0, 1.0))
_SUPERSEDE_DELAYS = st.sampled_from((0.0, 0.0, 0.0, 1.0))
_BOOLEANS = st.booleans()
#: One model in four writes its tool calls in text (gets the verbatim scaffolding).
_TOOL_CALLING = st.sampled_from(("native", "native", "native", "verbatim"))


def generation_chains(
    *,
    max_models: int = 4,
    max_keys: int = 3,
    max_signals: int = 2,
    shared_route: bool = True,
    echo_keys: bool | None = None,
    drafting: bool = False,
) -> st.SearchStrategy[ChainScript]:
    """A whole simulated generation turn (see `ChainScript`): 1–``max_models`` models with
    0–``max_keys`` keys each, a scripted attempt per keyless model and per key, an optional
    shared route (one chain in three, when ``shared_route``) admitted or refused, up to
    ``max_signals`` host signals, a small `TurnPolicy`, cooling / retired keys in the key
    book, factories that raise, a channel whose delivery fails (one chain in ten), and
    the host's supersede-marking delay. ``echo_keys`` fixes whether providers and factories
    quote their key in their errors (``None``: drawn). ``drafting``: the policy turns
    drafting, the tool checkpoint or both on, and the reviewer's script is drawn
    (`toolloop_fsm.testing.reviewer_scripts`): one review state for the whole turn."""
    attempts = attempt_scripts()
    model_counts = st.integers(1, max_models)
    key_counts = st.integers(0, max_keys)
    signals = st.lists(chain_signals(), max_size=max_signals).map(tuple)
    policies = turn_policies(drafting=drafting)
    reviews = reviewer_scripts()
    echo = _BOOLEANS if echo_keys is None else st.just(echo_keys)

    @st.composite
    def chains(draw: st.DrawFn) -> ChainScript:
        salt = draw(_SALTS)
        models = _models(draw, "user", draw(model_counts), salt, attempts, key_counts)
        shared = None
        if shared_route and draw(_ONE_IN_THREE) == 2:
            shared = SharedRouteScript(
                models=_models(draw, "shared", draw(_SHARED_MODELS), salt, attempts, key_counts),
                admit=draw(_BOOLEANS),
                delay=draw(_ADMISSION_DELAYS),
            )
        broken: tuple[int, str] | None = None
        if draw(_ONE_IN_TEN) == 9:
            broken = (draw(_BROKEN_INDEX), draw(_BROKEN_KIND))
        return ChainScript(
            models=models,
            policy=draw(policies),
            shared=shared,
            signals=draw(signals),
            broken_delivery=broken,
            supersede_delay=draw(_SUPERSEDE_DELAYS),
            echo_keys=draw(echo),
            reviews=draw(reviews) if drafting else (),
        )

    return chains()
