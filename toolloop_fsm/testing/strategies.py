"""Hypothesis strategies for fuzzing the inner tool loop, and the harness that runs them.

`turn_scripts()` draws a `TurnScript` — everything one simulated turn needs: the provider's
passes (chunks, pauses, failures), what each tool does on each dispatch, host signals at
virtual instants, and the channel's behaviour. `loop_policies()` draws `LoopPolicy` values
with small ceilings and short budgets so that every limit is actually reached.
`run_script(script, policy)` runs one script through `run_tool_loop` on a `VirtualClock`
and returns a `ScriptRun` holding every witness `check_invariants` needs::

    @given(script=turn_scripts(), policy=loop_policies())
    def test_my_policy(script, policy):
        run = asyncio.run(run_script(script, policy))
        run.check()  # raises InvariantViolation naming the broken invariant

Every value is drawn from a menu ordered simplest first (one draw each: generation stays
cheap), so Hypothesis shrinks a failure toward a simple turn: a single pass with nothing in
it, plain text, known tools with empty arguments, tools that succeed at once, no signals,
no delivery delay, a one-iteration policy. Weights (entries repeated in a menu) make the
drawn turns varied: most passes end with a tool call, so turns go on for several passes,
and every terminal status and reason comes up.

The tool universe is fixed (`KNOWN_TOOLS`) so that scripts can name tools that exist, tools
that do not (`UNKNOWN_TOOLS`, one a near miss of a known name) and tools outside the turn's
allowlist. This module needs Hypothesis (a test dependency); `toolloop_fsm.testing` imports
it lazily.

``turn_scripts(hostile=True)`` and ``loop_policies(hostile=True)`` add the unkind world of
`toolloop_fsm.testing.hostile` to the menus, after the kind entries (so a failure still
shrinks toward a kind turn): tools that raise their own `BaseException` subclass or
`GeneratorExit`, ignore their cancellation or mutate their arguments; channel calls that
raise, hang, take a while within or over the host-call budget, or ignore their cancellation;
stops and follow-ups fired from another thread; providers that quote their API key in an
error, report non-finite usage or ``retry_after``, or trickle forever; and short host-call,
grace and pass budgets. A script whose provider quotes a key runs as a one-model generation
turn, the tier that is given keys and must keep them secret.

``loop_policies(drafting=…, review_tool_calls=…)`` switches on drafting and the tool checkpoint
(``None``: drawn), with the held-prose ceiling sometimes small enough to cut a reply, the
host's send limit sometimes below it, and small review budgets and timeouts;
``turn_scripts(drafting=True)`` adds the reviewer's script (`TurnScript.reviews`: passes,
revisions with 1–4 findings, no verdict, a hang, a raise, answers slower or quicker than the
review timeout). Without them both draw exactly what they always drew.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from enum import StrEnum
from typing import Any
from typing import Literal
from typing import Protocol
from typing import TypeVar

import attrs
from attrs import frozen
from hypothesis import strategies as st

from toolloop_fsm.events import Chunk
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import Budget
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import Price
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import Pass
from toolloop_fsm.review import ReviewUsage
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.testing._lazy_names import STRATEGY_NAMES
from toolloop_fsm.testing.hostile import ChannelAct
from toolloop_fsm.testing.hostile import EchoKey
from toolloop_fsm.testing.hostile import HostileItem
from toolloop_fsm.testing.hostile import KeyEcho
from toolloop_fsm.testing.hostile import Trickle
from toolloop_fsm.testing.reviewer import Hang
from toolloop_fsm.testing.reviewer import Raise
from toolloop_fsm.testing.reviewer import ReviewerAct
from toolloop_fsm.testing.reviewer import Slow
from toolloop_fsm.testing.scripted import Fail
from toolloop_fsm.testing.scripted import Pause
from toolloop_fsm.testing.scripted import ScriptItem

__all__ = ["DEFAULT_TOOLS", *STRATEGY_NAMES, "tool_batches", "tool_chains"]

_T = TypeVar("_T")

# --------------------------------------------------------------------------- the tool universe
MEMORY_TOOL = "update_short_term_memory"


@frozen
class ToolConfig:
    """How one known tool is registered: what the host chose when it built the `Tool`.

    ``requires_follow_up``, ``replay`` (``"reuse"`` or ``"rerun"``) and ``sequential`` (a
    barrier in its tool batch) as `Tool` takes them; ``timeout`` its own deadline
    (``None``: the policy's ``tool_timeout``); ``repeatable`` exempts it from the
    repeated-call guard (set by hand-written scripts; the menus keep the default).
    """

    name: str
    requires_follow_up: bool = True
    replay: str = "reuse"
    timeout: float | None = None
    sequential: bool = False
    repeatable: bool = False


#: The tools every scripted turn registers, as they are registered unless a script draws
#: otherwise (`TurnScript.tool_configs`): two that need a follow-up (one with its own, short
#: deadline), and two silent ones.
DEFAULT_TOOLS: tuple[ToolConfig, ...] = (
    ToolConfig("get_weather", requires_follow_up=True),
    ToolConfig("send_sticker", requires_follow_up=False),
    ToolConfig(MEMORY_TOOL, requires_follow_up=False),
    ToolConfig("search", requires_follow_up=True, timeout=4.0),
)
KNOWN_TOOLS: tuple[str, ...] = tuple(tool.name for tool in DEFAULT_TOOLS)
#: A deadline of its own for a tool registered without one (and none for the one with one).
_OTHER_TIMEOUT = 4.0


def _config_menu(default: ToolConfig) -> tuple[ToolConfig, ...]:
    """Every way the API lets the host register ``default``'s tool, the default first (and
    twice): both follow-up settings, both replay modes, its own deadline or the policy's."""
    other_timeout = None if default.timeout is not None else _OTHER_TIMEOUT
    every = tuple(
        ToolConfig(default.name, follow_up, replay, timeout)
        for follow_up in (default.requires_follow_up, not default.requires_follow_up)
        for replay in ("reuse", "rerun")
        for timeout in (default.timeout, other_timeout)
    )
    return (default, *every)


_CONFIG_MENUS: tuple[tuple[ToolConfig, ...], ...] = tuple(map(_config_menu, DEFAULT_TOOLS))

#: Names no script registers; the first is a near miss of a known tool.
UNKNOWN_TOOLS: tuple[str, ...] = ("get_wether", "launch_rockets")

# --------------------------------------------------------------------------- script values


class ToolAction(StrEnum):
    """What a tool handler does on one dispatch (after its ``delay``).

    The last five are hostile: raise a `RogueBaseException` (a host's own `BaseException`
    subclass) or `GeneratorExit`, hang while swallowing every cancellation until the kit
    releases it after the turn, edit its arguments in place and then succeed, or return
    something that is not a `ToolResult`.
    """

    SUCCEED = "succeed"
    FAIL = "fail"
    RAISE = "raise"
    HANG = "hang"
    RAISE_BASE_EXCEPTION = "raise_base_exception"
    RAISE_GENERATOR_EXIT = "raise_generator_exit"
    IGNORE_CANCELLATION = "ignore_cancellation"
    MUTATE_ARGUMENTS = "mutate_arguments"
    RETURN_GARBAGE = "return_garbage"


@frozen
class ToolBehaviour:
    """One dispatch of a tool: wait ``delay`` virtual seconds, then do ``action``.

    A ``HANG`` never returns (only the tool deadline or a stop ends it); an
    ``IGNORE_CANCELLATION`` does not end even then. The remaining fields shape the returned
    `ToolResult` (``message`` and ``data`` also on failure).
    """

    action: ToolAction = ToolAction.SUCCEED
    delay: float = 0.0
    message: str | None = None
    data: Any = None
    end_turn: bool = False
    delivered: bool = False
    expression: str | None = None
    context_restart: ContextRestart | None = None


#: What a tool does once its planned behaviours are used up.
DEFAULT_BEHAVIOUR = ToolBehaviour()


@frozen
class TimedSignal:
    """A host signal at virtual instant ``at``: ``stop`` (/kill, with an optional message),
    or a new user message that interrupts (``follow_up``), steers (``steer``) or is queued
    (``queue``, docs/behaviour.md §8.5); ``from_thread`` fires it from another thread (see
    `toolloop_fsm.testing.hostile.fire_from_thread`)."""

    at: float
    kind: str = "stop"
    stop_message: str | None = None
    from_thread: bool = False


@frozen
class TurnScript:
    """Everything one simulated turn does, drawn by `turn_scripts()`.

    ``passes``: the provider's passes, in order (requests beyond them get an empty pass).
    ``tool_plan``: per tool name, the behaviour of its 1st, 2nd, … dispatch.
    ``signals``: host signals at virtual instants (from the start of the run).
    ``delivery_delay``: virtual seconds each channel delivery takes (deliveries in flight).
    ``failing_delivery``: index of the channel delivery that raises (a host failure).
    ``tools_allowed``, ``prefill``: the `TurnRequest`'s allowlist and prefill.
    ``continuation_style``: run as a NovelAI-style provider whose text cannot be retracted.
    ``sends`` / ``notices``: what the channel's 1st, 2nd, … delivery and notice (or stop
    message) do (`ChannelAct`; past the plan, and by default, they confirm).
    ``provider_key``: the API key the provider holds and an `EchoKey` quotes; a script with
    one runs as a one-model generation turn.
    ``reviews``: what the reviewer answers to its 1st, 2nd, … review (drafting's reviews of
    a reply and the tool checkpoint's reviews of a call share the one sequence; past it, and
    by default, it passes). Read only when the policy turns drafting or the checkpoint on.
    ``tool_configs``: how each known tool is registered (`ToolConfig`, in `KNOWN_TOOLS`
    order).
    """

    passes: tuple[tuple[HostileItem, ...], ...] = ()
    tool_plan: tuple[tuple[str, tuple[ToolBehaviour, ...]], ...] = ()
    signals: tuple[TimedSignal, ...] = ()
    delivery_delay: float = 0.0
    failing_delivery: int | None = None
    tools_allowed: frozenset[str] | None = None
    prefill: str | None = None
    continuation_style: bool = False
    sends: tuple[ChannelAct, ...] = ()
    notices: tuple[ChannelAct, ...] = ()
    provider_key: str | None = None
    reviews: tuple[ReviewerAct, ...] = ()
    tool_configs: tuple[ToolConfig, ...] = DEFAULT_TOOLS

    def plan_for(self, name: str) -> tuple[ToolBehaviour, ...]:
        for tool, behaviours in self.tool_plan:
            if tool == name:
                return behaviours
        return ()

    def request(self) -> TurnRequest:
        return TurnRequest(
            [{"role": "user", "content": "hello"}],
            tools_allowed=self.tools_allowed,
            prefill=self.prefill,
        )


# --------------------------------------------------------------------------- strategies
# Each menu is ordered simplest first, because Hypothesis shrinks `sampled_from` toward its
# first entry, and an entry repeated k times is drawn k times as often. One draw per value
# keeps generation cheap (Hypothesis spends ~60 µs a draw): a whole turn is ~30–80 draws.
_TEXTS: tuple[str, ...] = (
    "Hi",
    "Hello ",
    "It is 3 °C.",
    "ü",
    " ",
    "\n",
    "  \t",
    "",
    "日本語",
    "🙂 ok",
    "e\u0301",
    "\u200b",
    "مرحبا",
    "a\r\nb",
    "\u00a0",
)
_PAUSES: tuple[float, ...] = (0.5, 1.0, 0.25, 2.0, 5.0, 12.0, 40.0, 400.0)
_TOOL_DELAYS: tuple[float, ...] = (0.0, 0.0, 0.0, 0.5, 2.0, 6.0, 40.0)
_INSTANTS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 2.5, 3.0, 5.0, 8.0, 13.0, 30.0, 60.0)
_DELIVERY_DELAYS: tuple[float, ...] = (0.0, 0.0, 0.5, 1.0, 3.0, 10.0, 40.0)
_ARGUMENTS: tuple[Mapping[str, Any], ...] = (
    {},
    {"city": "Oslo"},
    {"city": "Lima"},
    {"q": "ümlaut", "n": 2},
)
_NOT_OBJECTS: tuple[Any, ...] = ([1, 2], "Oslo", 3, None)
_RESTARTS = (
    ContextRestart({"role": "system", "content": "enriched: memory"}, ("memory",)),
    ContextRestart({"role": "system", "content": "enriched: search"}),
)


def _call_menu() -> tuple[FunctionCall, ...]:
    """Known tools with a few argument objects first (repeats make re-calls of an identical
    call likely), then unknown tools, blank names, non-object, truncated and unparseable
    arguments."""
    known = [FunctionCall(name, args) for args in _ARGUMENTS for name in KNOWN_TOOLS]
    bad: list[FunctionCall] = [FunctionCall(name, {}) for name in UNKNOWN_TOOLS]
    bad += [FunctionCall("get_wether", {"city": "Oslo"})]
    bad += [FunctionCall("", {}), FunctionCall("  ", {"city": "Oslo"})]
    bad += [FunctionCall(KNOWN_TOOLS[i % 4], value) for i, value in enumerate(_NOT_OBJECTS)]
    bad += [FunctionCall(name, {"city": "Os"}, truncated=True) for name in KNOWN_TOOLS]
    bad += [
        FunctionCall(name, '{"city": Oslo', parse_error="Expecting value: char 9")
        for name in KNOWN_TOOLS[:2]
    ]
    return (*known, *known, *bad)


_CALLS = _call_menu()
_USAGE = (
    UsageReport(10, 5),
    UsageReport(12, 9),
    UsageReport(3, 4, cumulative=False),
    UsageReport(0, 7, cumulative=False),
    UsageReport(20, 30, estimated=True),
)
_ERRORS = (
    ProviderError("scripted server failure", kind="server", retryable=True, status_code=500),
    ProviderError(
        "scripted rate limit", kind="rate_limit", retryable=True, status_code=429, retry_after=7.0
    ),
    ProviderError("scripted connection reset", kind="connection", retryable=True),
    ProviderError("scripted bad request", kind="bad_request", retryable=False, status_code=400),
)
_OTHERS: tuple[ScriptItem, ...] = (
    ThoughtDelta("hmm"),
    ThoughtDelta(" "),
    ThoughtDelta("plan: call a tool"),
    *(FinishReason(kind) for kind in FinishKind),
    SceneMetadata("a rainy street"),
)


def _item_menu() -> tuple[ScriptItem, ...]:
    """About 30% text, 38% tool calls (two thirds to known tools), 10% pauses, 4% usage,
    13% thoughts / finish reasons / scene metadata and 5% provider failures."""
    texts = [TextDelta(t) for t in _TEXTS]
    return (
        *texts,
        *texts,
        *texts[:8],
        *_CALLS,
        *(Pause(s) for s in _PAUSES),
        *(Pause(s) for s in _PAUSES[:4]),
        *_USAGE,
        *_OTHERS,
        *_OTHERS[-1:],
        *_OTHERS[-1:],
        *_OTHERS[:3],
        *(Fail(e) for e in _ERRORS[:3]),
        *(Fail(e) for e in _ERRORS[:3]),
    )


_ITEMS = _item_menu()
_CHUNK_ITEMS: tuple[Chunk, ...] = tuple(i for i in _ITEMS if not isinstance(i, Pause | Fail))


def text_deltas() -> st.SearchStrategy[TextDelta]:
    """Short visible text: plain, whitespace-only, empty and non-ASCII (combining marks,
    zero-width, right-to-left, CRLF)."""
    return st.sampled_from(tuple(TextDelta(t) for t in _TEXTS))


def function_calls() -> st.SearchStrategy[FunctionCall]:
    """Tool calls: known tools (simplest first), unknown tools (one a near miss), blank
    names, non-object arguments, truncated and unparseable arguments. ``call_id`` is added by
    `turn_scripts` (unique across the turn)."""
    return st.sampled_from(_CALLS)


def chunks() -> st.SearchStrategy[Chunk]:
    """One provider chunk (no `Pause` or `Fail`), as `script_items` weights them: for feeding
    a machine directly."""
    return st.sampled_from(_CHUNK_ITEMS)


def script_items() -> st.SearchStrategy[ScriptItem]:
    """One item of a provider pass: a chunk, a `Pause` or a `Fail` (one draw each)."""
    return st.sampled_from(_ITEMS)


def _ending_menu() -> tuple[tuple[ScriptItem, ...], ...]:
    """How a pass ends, after its random body: nothing first (the simplest), then mostly a
    call to a known tool (so turns go on to further passes), sometimes a call the gate
    refuses or that is malformed, a provider failure, a stall, or closing text. (The
    module's ending menus add `_A_BATCH`: a tool batch of 2 to 6 calls.)"""
    valid: list[tuple[ScriptItem, ...]] = [
        (FunctionCall(name, args),) for args in _ARGUMENTS[:3] for name in KNOWN_TOOLS
    ]
    valid += [
        (FunctionCall("get_weather", {"city": "Oslo"}), UsageReport(9, 3)),
        (FunctionCall("send_sticker", {}), FinishReason(FinishKind.TOOL_CALLS)),
    ]
    # every refused or malformed call once; malformed ones end the turn, so not more
    refused: list[tuple[ScriptItem, ...]] = [
        (call,) for call in _CALLS[2 * len(_ARGUMENTS) * len(KNOWN_TOOLS) :]
    ]
    return (
        (),
        *valid,
        *valid,
        *valid,
        *refused,
        (TextDelta("Done."), FinishReason(FinishKind.STOP)),
        (TextDelta("Let me check."), FunctionCall(MEMORY_TOOL, {"city": "Oslo"})),
        (Fail(_ERRORS[0]),),
        (Pause(400.0),),
        (),
        (UsageReport(4, 2),),
    )


def _body_menu() -> tuple[ScriptItem, ...]:
    """What a pass streams before its ending: mostly text (a third of it blank), pauses,
    usage and thoughts; now and then a call of any kind (it joins the pass's tool batch
    with the ending's calls) and, rarely, a provider failure."""
    texts = [TextDelta(t) for t in _TEXTS]
    return (
        *texts,
        *texts,
        *texts[:8],
        *(Pause(s) for s in _PAUSES),
        *(Pause(s) for s in _PAUSES[:4]),
        *_USAGE,
        *_OTHERS,
        *_OTHERS[-1:],
        *_OTHERS[-1:],
        *_OTHERS[:3],
        *_CALLS[: 2 * len(_ARGUMENTS) * len(KNOWN_TOOLS) : 3],
        *_CALLS[2 * len(_ARGUMENTS) * len(KNOWN_TOOLS) :: 5],
        Fail(_ERRORS[1]),
    )


#: The calls of a drawn tool batch: every known tool with two argument objects (twice, so a
#: batch holds identical calls and calls of one tool that play different behaviours), then
#: each kind of call the gate refuses once (unknown, not an object, truncated, unparseable),
#: and a call without a name (it ends the turn before any call runs) once.
_BATCH_CALLS: tuple[FunctionCall, ...] = (
    *(FunctionCall(name, args) for args in _ARGUMENTS[:2] for name in KNOWN_TOOLS),
    *(FunctionCall(name, args) for args in _ARGUMENTS[:2] for name in KNOWN_TOOLS),
    FunctionCall("launch_rockets", {}),
    FunctionCall("get_weather", [1, 2]),
    FunctionCall("search", {"city": "Os"}, truncated=True),
    FunctionCall("send_sticker", '{"city": Oslo', parse_error="Expecting value: char 9"),
    FunctionCall("", {}),
)
_BATCH_SIZES: tuple[int, ...] = (2, 3, 2, 3, 4, 5, 6)
#: The ending that stands for a tool batch drawn on the spot (`build_batch`).
_A_BATCH: tuple[ScriptItem, ...] = (FunctionCall("a batch", {}),)

_ENDINGS = (*_ending_menu(), *(_A_BATCH,) * 4)
_BODY_ITEMS = _body_menu()

#: Items only a hostile provider sends: non-finite usage and retry hints, an error quoting
#: the provider's key (each way it happens), and a stream that trickles forever.
_NON_FINITE: tuple[ScriptItem, ...] = (
    UsageReport(math.nan, 3),  # type: ignore[arg-type]
    UsageReport(4, math.inf),  # type: ignore[arg-type]
    Fail(
        ProviderError(
            "scripted rate limit",
            kind="rate_limit",
            retryable=True,
            status_code=429,
            retry_after=math.inf,
        )
    ),
    Fail(
        ProviderError(
            "scripted overload",
            kind="server",
            retryable=True,
            status_code=503,
            retry_after=math.nan,
        )
    ),
)
_KEY_ECHOES: tuple[EchoKey, ...] = tuple(EchoKey(style) for style in KeyEcho)
_HOSTILE_ONLY: tuple[HostileItem, ...] = (*_NON_FINITE, *_KEY_ECHOES, Trickle())
#: Arguments with nested values, so that a tool mutating them in place reaches inside.
_NESTED = {"cities": ["Oslo", "Lima"], "units": {"temp": "C"}}
_HOSTILE_BODY_ITEMS: tuple[HostileItem, ...] = (*_BODY_ITEMS, *_HOSTILE_ONLY)
_HOSTILE_ENDINGS: tuple[tuple[HostileItem, ...], ...] = (
    *_ENDINGS,
    *((FunctionCall(name, _NESTED),) for name in KNOWN_TOOLS),
    *((FunctionCall(name, _NESTED),) for name in KNOWN_TOOLS[:2]),
    *((item,) for item in _HOSTILE_ONLY),
    (TextDelta("Let me see. "), Trickle()),
)
#: A drafted reply is reviewed when a pass ends without a call: for drafting, a third of
#: the passes close with text (some of it long enough to meet a small held-prose ceiling).
_REPLIES: tuple[tuple[ScriptItem, ...], ...] = (
    (TextDelta("Done."),),
    (TextDelta("It is 3 °C in Oslo."), FinishReason(FinishKind.STOP)),
    (TextDelta("Here you go: "), TextDelta("日本語 🙂")),
    (TextDelta("Sunny, "), TextDelta("then rain.")),
)
_DRAFTING_ENDINGS = (*_ENDINGS, *(_REPLIES * 8))
_HOSTILE_DRAFTING_ENDINGS = (*_HOSTILE_ENDINGS, *(_REPLIES * 8))


# --------------------------------------------------------------------------- choices
class Choices(Protocol):
    """Where a builder gets its choices: Hypothesis's ``draw`` (`turn_scripts()` and the
    other strategies) or the bytes of a compact seed (`toolloop_fsm.testing.seeds`). Every
    choice is made from a menu ordered simplest first, so both shrink toward a simple turn:
    Hypothesis shrinks a pick toward the first entry and a list toward ``min_size``, a seed
    reads byte 0 (and bytes past its end) as exactly those."""

    def pick(self, menu: Sequence[_T]) -> _T:
        """One entry of ``menu`` (an entry repeated k times comes up k times as often)."""
        ...

    def flag(self) -> bool:
        """A yes or no (no is the simpler)."""
        ...

    def picks(self, menu: Sequence[_T], min_size: int, max_size: int) -> list[_T]:
        """``min_size`` to ``max_size`` picks from ``menu``."""
        ...

    def several(
        self, min_size: int, max_size: int, build: Callable[..., _T], *args: Any
    ) -> list[_T]:
        """``min_size`` to ``max_size`` values, each ``build(self, *args)``."""
        ...


class _Drawn:
    """`Choices` drawn by Hypothesis: a pick is a `st.sampled_from`, a list a `st.lists`
    (whose elements Hypothesis deletes one by one when it shrinks). The strategies are
    built once per menu and builder (building one per draw would cost more than the draw)."""

    __slots__ = ("draw",)

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def pick(self, menu: Sequence[_T]) -> _T:
        return self.draw(_sampled(menu))

    def flag(self) -> bool:
        return self.draw(_BOOLEANS)

    def picks(self, menu: Sequence[_T], min_size: int, max_size: int) -> list[_T]:
        return self.draw(_sampled_lists(menu, min_size, max_size))

    def several(
        self, min_size: int, max_size: int, build: Callable[..., _T], *args: Any
    ) -> list[_T]:
        key = (build, args, min_size, max_size)
        lists = _LISTS.get(key)
        if lists is None:
            lists = _LISTS[key] = st.lists(
                built(build, *args), min_size=min_size, max_size=max_size
            )
        return self.draw(lists)


_BOOLEANS = st.booleans()
#: menu id → (the menu, kept alive so that its id is not reused; its strategy)
_SAMPLED: dict[int, tuple[Sequence[Any], st.SearchStrategy[Any]]] = {}
_SAMPLED_LISTS: dict[tuple[int, int, int], st.SearchStrategy[list[Any]]] = {}
_LISTS: dict[tuple[Any, ...], st.SearchStrategy[list[Any]]] = {}


def _sampled(menu: Sequence[_T]) -> st.SearchStrategy[_T]:
    cached = _SAMPLED.get(id(menu))
    if cached is None or cached[0] is not menu:
        cached = _SAMPLED[id(menu)] = (menu, st.sampled_from(menu))
    return cached[1]


def _sampled_lists(menu: Sequence[_T], min_size: int, max_size: int) -> st.SearchStrategy[list[_T]]:
    key = (id(menu), min_size, max_size)
    lists = _SAMPLED_LISTS.get(key)
    if lists is None or _SAMPLED[id(menu)][0] is not menu:
        lists = st.lists(_sampled(menu), min_size=min_size, max_size=max_size)
        _SAMPLED_LISTS[key] = lists
    return lists


def built(build: Callable[..., _T], *args: Any) -> st.SearchStrategy[_T]:
    """The Hypothesis strategy drawing ``build(choices, *args)``."""

    # Hypothesis labels a composite strategy by its function's code and defaults, and its
    # generator splices spans of one label into others: the builder's name and arguments,
    # as a default, give each builder (and size) a label of its own.
    def values(
        draw: st.DrawFn, _label: tuple[str, tuple[Any, ...]] = (build.__qualname__, args)
    ) -> _T:
        return build(_Drawn(draw), *args)

    return st.composite(values)()


# --------------------------------------------------------------------------- builders
def build_pass(
    c: Choices, max_items: int = 5, hostile: bool = False, drafting: bool = False
) -> tuple[HostileItem, ...]:
    """One provider pass (see `provider_passes`)."""
    body = c.picks(_HOSTILE_BODY_ITEMS if hostile else _BODY_ITEMS, 0, max_items)
    if drafting:
        endings = _HOSTILE_DRAFTING_ENDINGS if hostile else _DRAFTING_ENDINGS
    else:
        endings = _HOSTILE_ENDINGS if hostile else _ENDINGS
    ending = c.pick(endings)
    if ending is _A_BATCH:
        return (*body, *build_batch(c))
    return (*body, *ending)


def build_batch(c: Choices) -> tuple[FunctionCall, ...]:
    """A tool batch of 2 to 6 calls (see `tool_batches`)."""
    return tuple(c.pick(_BATCH_CALLS) for _ in range(c.pick(_BATCH_SIZES)))


def provider_passes(
    *, max_items: int = 5, hostile: bool = False, drafting: bool = False
) -> st.SearchStrategy[tuple[HostileItem, ...]]:
    """One provider pass: up to ``max_items`` random items, then an ending drawn from a
    menu weighted toward a tool call. Shrinks toward the empty pass. With ``hostile``, the
    menus also hold the items of a hostile provider (after the kind ones). With
    ``drafting``, a third of the endings are a closing reply instead (drafting reviews a
    reply when a pass ends without a call)."""
    return built(build_pass, max_items, hostile, drafting)


def _result_menu() -> tuple[dict[str, Any], ...]:
    plain: dict[str, Any] = {}
    return (
        plain,
        {"message": "done"},
        {"data": {"t": 3}, "message": "sunny"},
        {"data": [1, 2]},
        {"end_turn": True},
        {"delivered": True},
        {"expression": "sticker:wave"},
        {"context_restart": _RESTARTS[0]},
        {"context_restart": _RESTARTS[1], "message": "look again"},
        {"expression": "👍", "end_turn": True},
        {"expression": "👍", "context_restart": _RESTARTS[0]},
        {"delivered": True, "end_turn": True, "message": "sent it myself"},
        {"message": "nothing found ü", "data": "raw"},
        {"context_restart": _RESTARTS[1]},
        {"context_restart": _RESTARTS[0], "data": {"t": 3}},
    )


_RESULTS = _result_menu()
#: A tool chain's results: every result, and each restarting one three times more.
_ROUND_RESULTS = (*_RESULTS, *tuple(r for r in _RESULTS if "context_restart" in r) * 3)
_ACTIONS = (
    ToolAction.SUCCEED,
    ToolAction.SUCCEED,
    ToolAction.SUCCEED,
    ToolAction.FAIL,
    ToolAction.RAISE,
    ToolAction.HANG,
)


_HOSTILE_ACTIONS = (
    *_ACTIONS,
    ToolAction.RAISE_BASE_EXCEPTION,
    ToolAction.RAISE_GENERATOR_EXIT,
    ToolAction.IGNORE_CANCELLATION,
    ToolAction.MUTATE_ARGUMENTS,
    ToolAction.MUTATE_ARGUMENTS,
    ToolAction.RETURN_GARBAGE,
)


def build_behaviour(c: Choices, hostile: bool = False) -> ToolBehaviour:
    """One dispatch's behaviour (see `tool_behaviours`)."""
    action = c.pick(_HOSTILE_ACTIONS if hostile else _ACTIONS)
    return ToolBehaviour(action, c.pick(_TOOL_DELAYS), **c.pick(_RESULTS))


def tool_behaviours(*, hostile: bool = False) -> st.SearchStrategy[ToolBehaviour]:
    """One dispatch's behaviour: succeed (with optional message, data, end_turn, delivered,
    expression, context restart), fail (message, data and expression kept), raise or hang,
    after a virtual delay; with ``hostile``, also raise a `BaseException` subclass or
    `GeneratorExit`, ignore cancellation, or mutate the arguments."""
    return built(build_behaviour, hostile)


_STOP_MESSAGES = (None, "sorry, stopping")
_SIGNAL_KINDS = ("stop", "follow_up")
#: a new user message that steers the turn or is queued (docs/behaviour.md §8.5): how many a
#: script sends (none in most), and which
_HELD_COUNTS = (0, 0, 1, 2)
_HELD_KINDS = ("steer", "queue")


def build_signal(c: Choices, hostile: bool = False) -> TimedSignal:
    """A host signal (see `timed_signals`)."""
    return TimedSignal(
        at=c.pick(_INSTANTS),
        kind=c.pick(_SIGNAL_KINDS),
        stop_message=c.pick(_STOP_MESSAGES),
        from_thread=c.flag() if hostile else False,
    )


def timed_signals(*, hostile: bool = False) -> st.SearchStrategy[TimedSignal]:
    """A stop (with or without a stop message) or a follow-up at a virtual instant. The
    instants come from a small menu so that signals coincide with other events. With
    ``hostile``, a signal may come from another thread."""
    return built(build_signal, hostile)


_ALLOWLISTS: tuple[frozenset[str] | None, ...] = (
    None,
    None,
    None,
    None,
    frozenset(KNOWN_TOOLS[:2]),
    frozenset(KNOWN_TOOLS[1:]),
    frozenset({"get_weather", "search"}),
    frozenset(),
)


@functools.cache
def _signal_counts(most: int) -> tuple[int, ...]:
    """How many host signals a turn gets: none in half the turns (a signal cuts a turn
    short)."""
    return (0, 0, *range(1, most + 1))


_FAILING = (None, None, None, None, None, None, None, 0, 1, 2, 4)
_PREFILLS = (None, "Sure, ")
#: What a channel call does, confirming most often (a hostile call cuts a turn short).
_CHANNEL_ACTS = (
    ChannelAct.CONFIRM,
    ChannelAct.CONFIRM,
    ChannelAct.CONFIRM,
    ChannelAct.CONFIRM,
    ChannelAct.RAISE,
    ChannelAct.HANG,
    ChannelAct.SLOW_WITHIN,
    ChannelAct.SLOW_OVER,
    ChannelAct.IGNORE_CANCELLATION,
)
#: Fake API keys: no 8-character run of one occurs in any scripted text, so finding one
#: anywhere is a leak.
PROVIDER_KEYS: tuple[str, ...] = ("hk-7Qm2xZ9pLk4vR8tW3nB6", "hk-Jd5sYc1uHf8gTe2wKa9")


# --------------------------------------------------------------------------- the reviewer
_FINDINGS: tuple[Finding, ...] = (
    Finding(FindingCategory.VOICE, "The reply sounds flat.", "Answer warmly."),
    Finding(FindingCategory.REPETITION, "It says the same thing twice.", "Say it once."),
    Finding(FindingCategory.TOOL_USE, "This call is not needed.", "Answer from the results."),
    Finding(FindingCategory.CONTINUITY, "It contradicts the forecast.", "Keep to the data."),
    Finding(FindingCategory.CHARACTER, "Out of character ü.", "Stay in the role."),
)
#: How long a slow reviewer takes: within every drawn review timeout (1 s), past the
#: shortest only (3 s), past all of them (300 s). No value equals a drawn timeout, so a slow
#: answer and the review deadline never coincide.
_REVIEW_DELAYS: tuple[float, ...] = (1.0, 3.0, 300.0)
_REVIEW_TIMEOUTS: tuple[float, ...] = (120.0, 5.0, 2.0)
_USAGE_OF_A_REVIEW = ReviewUsage(40, 6)
#: The kinds of act, passes and revisions most often (simplest first).
_ACT_KINDS = ("pass", "revise", "pass", "revise", "unavailable", "raise", "hang", "slow", "slow")
_PASSES = (Pass(), Pass(usage=_USAGE_OF_A_REVIEW))
_UNAVAILABLE = (Unavailable("refusal"), Unavailable("malformed"))
_RAISES = (Raise(RuntimeError("the reviewer is down")), Raise(TimeoutError()))
_SLOW_VERDICT_KINDS = ("pass", "revise", "unavailable")


def _build_verdict(c: Choices, kind: str) -> Pass | Revise | Unavailable:
    if kind == "pass":
        return c.pick(_PASSES)
    if kind == "revise":
        return Revise(tuple(c.picks(_FINDINGS, 1, 4)))
    return c.pick(_UNAVAILABLE)


def build_reviewer_act(c: Choices) -> ReviewerAct:
    """One answer of the reviewer (see `reviewer_acts`)."""
    kind = c.pick(_ACT_KINDS)
    if kind == "hang":
        return Hang()
    if kind == "raise":
        return c.pick(_RAISES)
    if kind == "slow":
        return Slow(c.pick(_REVIEW_DELAYS), _build_verdict(c, c.pick(_SLOW_VERDICT_KINDS)))
    return _build_verdict(c, kind)


def reviewer_acts() -> st.SearchStrategy[ReviewerAct]:
    """One answer of the reviewer: `Pass` (with or without usage), `Revise` with 1–4
    findings, `Unavailable`, a raise, a `Hang` (only the review timeout ends it), or a
    `Slow` verdict within or past the review timeouts `loop_policies` draws."""
    return built(build_reviewer_act)


def build_reviewer_script(c: Choices) -> tuple[ReviewerAct, ...]:
    """The reviewer's first answers (see `reviewer_scripts`)."""
    return tuple(c.several(0, 5, build_reviewer_act))


_REVIEWER_SCRIPTS = built(build_reviewer_script)


def reviewer_scripts() -> st.SearchStrategy[tuple[ReviewerAct, ...]]:
    """What the reviewer answers to its first reviews, in order (up to five acts; it passes
    once they run out). Shrinks toward a reviewer that passes everything."""
    return _REVIEWER_SCRIPTS


def build_script(
    c: Choices,
    max_passes: int = 6,
    max_items: int = 5,
    max_signals: int = 2,
    hostile: bool = False,
    drafting: bool = False,
) -> TurnScript:
    """A whole simulated turn (see `turn_scripts`)."""
    drawn = c.several(1, max_passes, build_pass, max_items, hostile, drafting)
    if c.flag():
        drawn = _with_call_ids(drawn)
    plan = tuple((name, tuple(c.several(0, 3, build_behaviour, hostile))) for name in KNOWN_TOOLS)
    script = TurnScript(
        passes=tuple(drawn),
        tool_plan=tuple((name, b) for name, b in plan if b),
        signals=tuple(build_signal(c, hostile) for _ in range(c.pick(_signal_counts(max_signals)))),
        delivery_delay=c.pick(_DELIVERY_DELAYS),
        failing_delivery=c.pick(_FAILING),
        tools_allowed=c.pick(_ALLOWLISTS),
        prefill=c.pick(_PREFILLS),
        continuation_style=c.flag(),
    )
    if drafting:
        script = attrs.evolve(script, reviews=build_reviewer_script(c))
    if hostile:
        quotes_key = any(isinstance(i, EchoKey) for items in drawn for i in items)
        script = attrs.evolve(
            script,
            sends=tuple(c.picks(_CHANNEL_ACTS, 0, 3)),
            notices=tuple(c.picks(_CHANNEL_ACTS, 0, 2)),
            provider_key=c.pick(PROVIDER_KEYS) if quotes_key else None,
        )
    # drawn last, so that the bytes of a compact seed before them keep their meaning
    script = attrs.evolve(script, tool_configs=_with_barriers(c, tuple(map(c.pick, _CONFIG_MENUS))))
    held = tuple(build_held_message(c) for _ in range(c.pick(_HELD_COUNTS)))
    return attrs.evolve(script, signals=script.signals + held) if held else script


def build_held_message(c: Choices) -> TimedSignal:
    """A steered or queued user message at a virtual instant (drawn after everything else
    of a script: the seeds from before the modes decode to the turns they always did)."""
    return TimedSignal(at=c.pick(_INSTANTS), kind=c.pick(_HELD_KINDS))


#: Which tools are registered ``sequential`` (a barrier in a tool batch): none in most
#: turns, one of the two that need a follow-up now and then.
_SEQUENTIAL_SETS: tuple[frozenset[str], ...] = (
    frozenset(),
    frozenset(),
    frozenset(),
    frozenset({"search"}),
    frozenset({"get_weather"}),
)


def _with_barriers(c: Choices, configs: tuple[ToolConfig, ...]) -> tuple[ToolConfig, ...]:
    """``configs`` with the tools of a drawn `_SEQUENTIAL_SETS` entry made barriers."""
    barriers = c.pick(_SEQUENTIAL_SETS)
    if not barriers:
        return configs
    return tuple(attrs.evolve(config, sequential=config.name in barriers) for config in configs)


def turn_scripts(
    *,
    max_passes: int = 6,
    max_items: int = 5,
    max_signals: int = 2,
    hostile: bool = False,
    drafting: bool = False,
) -> st.SearchStrategy[TurnScript]:
    """A whole simulated turn (see `TurnScript`): 1 to ``max_passes`` provider passes of
    up to ``max_items`` random items and an ending each, a plan of up to 3 behaviours per
    known tool, up to ``max_signals`` host signals, the channel's delay and failing
    delivery, the allowlist, the prefill and the provider style.

    ``hostile`` adds the hostile world (see the module docstring): hostile provider items,
    tool behaviours and thread-fired signals in the menus, the channel's plans for its
    deliveries and notices, and the provider's key when a pass quotes it. The kind
    behaviours stay on every menu, first, so a failure shrinks toward a kind turn.

    ``drafting`` also draws the reviewer's script (`reviewer_scripts`), for a policy with
    drafting or the tool checkpoint on (`loop_policies(drafting=…)`), and ends a third of
    the passes with a closing reply (so that drafted replies are completed and reviewed)."""
    return built(build_script, max_passes, max_items, max_signals, hostile, drafting)


#: What the model says before a tool round's call: nothing, blank text, or visible text.
_ROUND_TEXTS: tuple[tuple[ScriptItem, ...], ...] = (
    (),
    (TextDelta("Let me check. "),),
    (TextDelta(" "),),
    (TextDelta("Noted. "),),
)
#: A tool round's call: a known tool (two argument objects, so identical calls recur; the
#: memory tool, whose rules are its own, three times as often), and now and then one the
#: gate refuses (a refusal counts as a failure).
_ROUND_CALLS: tuple[FunctionCall, ...] = (
    *(FunctionCall(name, args) for args in _ARGUMENTS[:2] for name in KNOWN_TOOLS),
    *(FunctionCall(MEMORY_TOOL, args) for args in _ARGUMENTS[:2] for _ in range(2)),
    FunctionCall("launch_rockets", {}),
    FunctionCall("search", {"city": "Os"}, truncated=True),
)
#: How a tool chain ends once its rounds are over: closing text, or an empty pass.
_CHAIN_ENDINGS: tuple[tuple[ScriptItem, ...], ...] = ((TextDelta("Done."),), ())
#: A tool round's action: success and failure as often (a raise and a hang now and then).
_ROUND_ACTIONS = (
    ToolAction.SUCCEED,
    ToolAction.FAIL,
    ToolAction.SUCCEED,
    ToolAction.FAIL,
    ToolAction.RAISE,
    ToolAction.HANG,
)


def build_round(c: Choices) -> tuple[HostileItem, ...]:
    """One tool round's pass (see `tool_chains`)."""
    return (*c.pick(_ROUND_TEXTS), c.pick(_ROUND_CALLS))


def build_round_behaviour(c: Choices) -> ToolBehaviour:
    """One dispatch in a tool chain: a success or a failure as often, with any result; a
    success restarts the context in two of five (so restarts meet failures)."""
    action = c.pick(_ROUND_ACTIONS)
    result = c.pick(_ROUND_RESULTS)
    return ToolBehaviour(action, c.pick(_TOOL_DELAYS), **result)


def build_tool_chain(c: Choices) -> TurnScript:
    """A turn of tool rounds (see `tool_chains`)."""
    rounds = c.several(2, 6, build_round)
    plan = tuple((name, tuple(c.several(1, 3, build_round_behaviour))) for name in KNOWN_TOOLS)
    return TurnScript(
        passes=(*rounds, c.pick(_CHAIN_ENDINGS)),
        tool_plan=plan,
        continuation_style=c.flag(),
        tool_configs=_with_barriers(c, tuple(map(c.pick, _CONFIG_MENUS))),
    )


def tool_chains() -> st.SearchStrategy[TurnScript]:
    """A turn that is a chain of tool rounds: 2 to 6 passes that each end in a call (after
    no text, blank text or visible text), then closing text or an empty pass; every known
    tool plays 1 to 3 drawn behaviours (successes and failures as often, context restarts
    most often among the results, ``end_turn``, delivered responses, expressions),
    registered in any of the ways `ToolConfig` allows, on either kind of provider. The
    rules after a tool call (docs/behaviour.md §4, §5) decide how such a turn goes on, and
    here they meet one another: a failure, then a restart, then failures again; a memory
    update, then another."""
    return built(build_tool_chain)


#: A batch call's behaviour: a success, a failure, a raise and a hang (so a deadline lands
#: mid-batch) each often enough to meet in one batch.
_BATCH_ACTIONS = (
    ToolAction.SUCCEED,
    ToolAction.FAIL,
    ToolAction.SUCCEED,
    ToolAction.RAISE,
    ToolAction.HANG,
)
#: How long a batch call takes: at once, or one of a few virtual durations that interleave
#: (and coincide now and then) with one another, with the drawn deadlines and with signals.
_BATCH_DELAYS: tuple[float, ...] = (0.0, 1.0, 3.0, 0.5, 2.0, 6.0)
#: When a signal comes in a turn of batches: mostly while the first batch runs.
_BATCH_SIGNAL_INSTANTS: tuple[float, ...] = (1.5, 0.5, 2.5, 1.0, 4.0, 7.0)


def build_batch_behaviour(c: Choices, hostile: bool = False) -> ToolBehaviour:
    """One dispatch in a turn of tool batches (see `tool_batches`)."""
    if hostile:
        return build_behaviour(c, hostile)
    return ToolBehaviour(c.pick(_BATCH_ACTIONS), c.pick(_BATCH_DELAYS), **c.pick(_RESULTS))


def build_tool_batches(c: Choices, hostile: bool = False) -> TurnScript:
    """A turn of tool batches (see `tool_batches`)."""
    batches = [(*c.pick(_ROUND_TEXTS), *build_batch(c)) for _ in range(c.pick((1, 2, 3)))]
    plan = tuple(
        (name, tuple(c.several(1, 6, build_batch_behaviour, hostile))) for name in KNOWN_TOOLS
    )
    signals: tuple[TimedSignal, ...] = ()
    if c.flag():
        signals = (TimedSignal(c.pick(_BATCH_SIGNAL_INSTANTS), c.pick(_SIGNAL_KINDS)),)
    return TurnScript(
        passes=(*batches, c.pick(_CHAIN_ENDINGS)),
        tool_plan=plan,
        signals=signals,
        continuation_style=c.flag(),
        tool_configs=_with_barriers(c, tuple(map(c.pick, _CONFIG_MENUS))),
    )


def tool_batches(*, hostile: bool = False) -> st.SearchStrategy[TurnScript]:
    """A turn of 1 to 3 tool batches, then closing text or an empty pass. Each batch holds
    2 to 6 calls (after no text, blank text or visible text): known tools, identical calls
    and calls of one tool, and now and then a call the gate refuses or one without a name.
    Each known tool plays 1 to 6 drawn behaviours, mixed on purpose: successes, failures,
    raises and hangs, at once or after virtual durations that interleave, so that in one
    batch calls finish out of emitted order, a deadline passes while siblings run, and a
    stop or a follow-up in half the turns lands mid-batch; tools are registered in any way
    `ToolConfig` allows, a barrier (``sequential``) among them now and then. With
    ``hostile``, the behaviours are `tool_behaviours(hostile=True)`'s: a tool that ignores
    its cancellation, raises a `BaseException` or returns garbage among its siblings. Draw
    the policy with `loop_policies()`, whose ``max_parallel_tools`` is sometimes 1 to 3."""
    return built(build_tool_batches, hostile)


def _with_call_ids(
    passes: Sequence[tuple[HostileItem, ...]],
) -> list[tuple[HostileItem, ...]]:
    """Give the calls provider call ids, unique across the turn as real providers do."""
    out: list[tuple[HostileItem, ...]] = []
    n = 0
    for items in passes:
        new: list[HostileItem] = []
        for item in items:
            if isinstance(item, FunctionCall):
                item = FunctionCall(
                    item.name, item.arguments, f"call_{n}", item.truncated, item.parse_error
                )
                n += 1
            new.append(item)
        out.append(tuple(new))
    return out


_SUPPRESS_SETS: tuple[frozenset[str], ...] = (
    frozenset({MEMORY_TOOL}),
    frozenset(),
    frozenset({MEMORY_TOOL, "send_sticker"}),
)


def build_policy(
    c: Choices,
    max_iterations: int = 8,
    hostile: bool = False,
    drafting: bool | None = False,
    review_tool_calls: bool | None = False,
    budgets: bool = True,
) -> LoopPolicy:
    """A `LoopPolicy` (see `loop_policies`)."""
    policy = LoopPolicy(
        # a menu, not integers(): Hypothesis draws integers' bounds far more often than
        # uniformly, and a ceiling of 1 would end most turns after their first pass
        max_function_call_iterations=c.pick(_iteration_ceilings(max_iterations)),
        soft_warn_iteration=c.pick(_SOFT_WARNINGS),
        max_consecutive_tool_errors=c.pick(_TOOL_ERROR_CEILINGS),
        continuation_tool_failure_threshold=c.pick((1, 1, 2, 3)),
        inactivity_timeout=c.pick((30.0, 10.0, 5.0, 2.0, 1.0)),
        first_token_timeout=c.pick((None, 60.0, 10.0, 3.0, 1.0)),
        abandoned_stream_settle=c.pick((5.0, 1.0, 0.0, 20.0)),
        tool_timeout=c.pick((30.0, 10.0, 3.0, 1.0)),
        delivery_flush_chars=c.pick((1, 2, 5, 10, 20, 50)),
        suppress_followup_after_pre_tool_text=c.pick(_SUPPRESS_SETS),
        max_pass_duration=c.pick((900.0, 900.0, 6.0, 2.5)),
    )
    if hostile:
        policy = attrs.evolve(
            policy,
            host_call_timeout=c.pick((30.0, 5.0, 1.0)),
            cancel_grace=c.pick((2.0, 0.5, 5.0)),
            max_pass_duration=c.pick((900.0, 60.0, 20.0, 8.0)),
        )
    # drawn after the others, so that the bytes of a compact seed before it keep their
    # meaning: the default most often, else a limit a drawn batch reaches
    policy = attrs.evolve(policy, max_parallel_tools=c.pick(_PARALLEL_LIMITS))
    if drafting is not False or review_tool_calls is not False:
        policy = build_review_fields(c, policy, drafting, review_tool_calls)
    # drawn last, for the same reason: the default first, else an allowance of identical
    # calls a script's repeated calls reach (docs/behaviour.md §3.11)
    policy = attrs.evolve(policy, max_identical_calls=c.pick(_IDENTICAL_CALL_LIMITS))
    # drawn last again: no limit most often, else one a script's batches reach, and the
    # iteration ceiling's manner (docs/behaviour.md §3.12, §2.1)
    policy = attrs.evolve(
        policy,
        max_tool_calls=c.pick(_TOOL_CALL_LIMITS),
        at_ceiling=c.pick(_CEILING_MANNERS),
    )
    # and last of all: no budget most often, else a token or cost ceiling a script's short
    # passes reach (docs/behaviour.md §2.8)
    budget = c.pick(_BUDGETS if budgets else (None,))
    if budget is None:
        return policy
    return attrs.evolve(policy, price=_PRICE, budget=budget)


@functools.cache
def _iteration_ceilings(most: int) -> tuple[int, ...]:
    return tuple(range(1, most + 1))


_SOFT_WARNINGS = tuple(range(1, 6))
_PARALLEL_LIMITS = (10, 10, 10, 1, 2, 3)
_IDENTICAL_CALL_LIMITS = (3, 3, 1, 2)
#: A tool-call limit in one policy of five: a limit of 1 to 3 ends most tool chains early,
#: and the other rules after a tool call need long chains to meet one another.
_TOOL_CALL_LIMITS: tuple[int | None, ...] = (None,) * 8 + (1, 3)
_CEILING_MANNERS: tuple[Literal["end", "answer"], ...] = ("end", "end", "end", "answer")
_TOOL_ERROR_CEILINGS = tuple(range(1, 5))
#: A budget in one policy of six: an output ceiling a reply or two reach (a drawn text is a
#: few tokens, a call's arguments a few more), a total and an input ceiling a second or
#: third pass's reading reaches, and a cost ceiling at a price.
_BUDGETS: tuple[Budget | None, ...] = (None,) * 25 + (
    Budget(output_tokens=3),
    Budget(output_tokens=12),
    Budget(total_tokens=120),
    Budget(input_tokens=90),
    Budget(cost=0.0003),
)
_PRICE = Price(input_per_million=1.0, output_per_million=4.0)


def loop_policies(
    *,
    max_iterations: int = 8,
    hostile: bool = False,
    drafting: bool | None = False,
    review_tool_calls: bool | None = False,
    budgets: bool = True,
) -> st.SearchStrategy[LoopPolicy]:
    """`LoopPolicy` values with small ceilings and short budgets, so limits are reached:
    1–``max_iterations`` passes, soft warning at 1–5, 1–4 consecutive tool errors, 1–3
    continuation failures, budgets of seconds (a pass's total budget included, so that a
    steadily streaming pass can run out of it), flushes every 1–50 characters, and 1–3
    identical calls allowed (the default, 3, most often). With
    ``hostile``, the host-call budget, the cancellation grace and the pass budget are drawn
    short too (defaults first).

    ``drafting`` and ``review_tool_calls`` switch drafting and the tool checkpoint on
    (``None``: each drawn). With either on, the review fields are drawn small too (defaults
    first): a held-prose ceiling of a few bytes or segments (so replies are cut), the host's
    send limit sometimes below it, 1–3 reviews, 0–2 revisions, 0–8 tool reviews, 0–2
    corrections and review timeouts of 2, 5 or 120 seconds.

    One policy in six has a token or cost budget of a few tokens (with a price), so that
    passes are refused and cut (docs/behaviour.md §2.8); ``budgets=False`` draws none."""
    return built(build_policy, max_iterations, hostile, drafting, review_tool_calls, budgets)


def build_review_fields(
    c: Choices, policy: LoopPolicy, drafting: bool | None, checkpoint: bool | None
) -> LoopPolicy:
    """``policy`` with drafting and the tool checkpoint switched on or off (``None``:
    drawn) and small review budgets (see `loop_policies`)."""
    drafts = c.flag() if drafting is None else drafting
    reviews_calls = c.flag() if checkpoint is None else checkpoint
    held_bytes, held_segments, send_limit = c.pick(_HELD_PROSE_LIMITS)
    return attrs.evolve(
        policy,
        drafting=drafts,
        review_tool_calls=reviews_calls,
        held_prose_max_bytes=held_bytes,
        held_prose_max_segments=held_segments,
        send_message_limit=send_limit,
        max_reviews=c.pick((2, 2, 1, 3)),
        max_revisions=c.pick((1, 1, 0, 2)),
        max_tool_reviews=c.pick((8, 8, 2, 1, 0)),
        max_tool_corrections=c.pick((2, 2, 1, 0)),
        review_timeout=c.pick(_REVIEW_TIMEOUTS),
    )


def _reviewed_policies(
    policies: st.SearchStrategy[LoopPolicy], drafting: bool | None, checkpoint: bool | None
) -> st.SearchStrategy[LoopPolicy]:
    """``policies`` with the review fields of `build_review_fields` drawn on top."""

    @st.composite
    def reviewed(draw: st.DrawFn) -> LoopPolicy:
        return build_review_fields(_Drawn(draw), draw(policies), drafting, checkpoint)

    return reviewed()


#: (held_prose_max_bytes, held_prose_max_segments, send_message_limit): the defaults in two
#: policies of three; otherwise a ceiling of bytes or segments, or a host's send limit
#: below the ceiling, small enough to cut a reply (each limit on its own, so a cut shrinks
#: to the one that made it).
_HELD_PROSE_LIMITS: tuple[tuple[int, int, int | None], ...] = ((65_536, 4_096, None),) * 16 + (
    (24, 4_096, None),
    (8, 4_096, None),
    (1, 4_096, None),
    (65_536, 3, None),
    (65_536, 1, None),
    (65_536, 4_096, 16),
    (65_536, 4_096, 6),
    (40, 4_096, 12),
)
