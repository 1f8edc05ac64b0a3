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

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import attrs
from attrs import frozen
from hypothesis import strategies as st

from toolloop_fsm.events import (
    Chunk,
    ContextRestart,
    FinishKind,
    FinishReason,
    FunctionCall,
    SceneMetadata,
    TextDelta,
    ThoughtDelta,
    UsageReport,
)
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.review import Finding, FindingCategory, Pass, ReviewUsage, Revise, Unavailable
from toolloop_fsm.testing.hostile import (
    ChannelAct,
    EchoKey,
    HostileItem,
    KeyEcho,
    Trickle,
)
from toolloop_fsm.testing.reviewer import Hang, Raise, ReviewerAct, Slow
from toolloop_fsm.testing.scripted import Fail, Pause, ScriptItem

__all__ = [
    "KNOWN_TOOLS",
    "MEMORY_TOOL",
    "PROVIDER_KEYS",
    "UNKNOWN_TOOLS",
    "TimedSignal",
    "ToolAction",
    "ToolBehaviour",
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
]

# --------------------------------------------------------------------------- the tool universe
MEMORY_TOOL = "update_short_term_memory"


@frozen
class _ToolShape:
    name: str
    requires_follow_up: bool
    timeout: float | None = None


#: The tools every scripted turn registers: two that need a follow-up (one with its own,
#: short deadline), and two silent ones (the memory tool ends the turn after pre-tool text).
_SHAPES: tuple[_ToolShape, ...] = (
    _ToolShape("get_weather", requires_follow_up=True),
    _ToolShape("send_sticker", requires_follow_up=False),
    _ToolShape(MEMORY_TOOL, requires_follow_up=False),
    _ToolShape("search", requires_follow_up=True, timeout=4.0),
)
KNOWN_TOOLS: tuple[str, ...] = tuple(shape.name for shape in _SHAPES)
#: Names no script registers; the first is a near miss of a known tool.
UNKNOWN_TOOLS: tuple[str, ...] = ("get_wether", "launch_rockets")

# --------------------------------------------------------------------------- script values


class ToolAction(StrEnum):
    """What a tool handler does on one dispatch (after its ``delay``).

    The last four are hostile: raise a `RogueBaseException` (a host's own `BaseException`
    subclass) or `GeneratorExit`, hang while swallowing every cancellation until the kit
    releases it after the turn, or edit its arguments in place and then succeed.
    """

    SUCCEED = "succeed"
    FAIL = "fail"
    RAISE = "raise"
    HANG = "hang"
    RAISE_BASE_EXCEPTION = "raise_base_exception"
    RAISE_GENERATOR_EXIT = "raise_generator_exit"
    IGNORE_CANCELLATION = "ignore_cancellation"
    MUTATE_ARGUMENTS = "mutate_arguments"


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
    """A host signal at virtual instant ``at``: ``stop`` (/kill, with an optional message)
    or ``follow_up`` (a new user message); ``from_thread`` fires it from another thread (see
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
    refuses or that is malformed, a provider failure, a stall, or closing text."""
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
    usage and thoughts; now and then a call of any kind (the first call of a pass is the
    one dispatched, later ones are ignored) and, rarely, a provider failure."""
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


_ENDINGS = _ending_menu()
_BODY_ITEMS = _body_menu()
_BODIES = {n: st.lists(st.sampled_from(_BODY_ITEMS), max_size=n) for n in range(8)}

#: Items only a hostile provider sends: non-finite usage and retry hints, an error quoting
#: the provider's key (each way it happens), and a stream that trickles forever.
_NON_FINITE: tuple[ScriptItem, ...] = (
    UsageReport(math.nan, 3),  # type: ignore[arg-type]
    UsageReport(4, math.inf),  # type: ignore[arg-type]
    Fail(ProviderError("scripted rate limit", kind="rate_limit", retryable=True,
                       status_code=429, retry_after=math.inf)),
    Fail(ProviderError("scripted overload", kind="server", retryable=True, status_code=503,
                       retry_after=math.nan)),
)  # fmt: skip
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
_HOSTILE_BODIES = {n: st.lists(st.sampled_from(_HOSTILE_BODY_ITEMS), max_size=n) for n in range(8)}
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


def provider_passes(
    *, max_items: int = 5, hostile: bool = False, drafting: bool = False
) -> st.SearchStrategy[tuple[HostileItem, ...]]:
    """One provider pass: up to ``max_items`` random items, then an ending drawn from a
    menu weighted toward a tool call. Shrinks toward the empty pass. With ``hostile``, the
    menus also hold the items of a hostile provider (after the kind ones). With
    ``drafting``, a third of the endings are a closing reply instead (drafting reviews a
    reply when a pass ends without a call)."""
    bodies: Mapping[int, st.SearchStrategy[list[HostileItem]]]
    bodies = _HOSTILE_BODIES if hostile else _BODIES  # type: ignore[assignment]
    items = _HOSTILE_BODY_ITEMS if hostile else _BODY_ITEMS
    body = bodies.get(max_items)
    if body is None:
        body = st.lists(st.sampled_from(items), max_size=max_items)
    if drafting:
        endings = _HOSTILE_DRAFTING_ENDINGS if hostile else _DRAFTING_ENDINGS
    else:
        endings = _HOSTILE_ENDINGS if hostile else _ENDINGS
    return st.builds(lambda items, end: (*items, *end), body, st.sampled_from(endings))


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
)


def tool_behaviours(*, hostile: bool = False) -> st.SearchStrategy[ToolBehaviour]:
    """One dispatch's behaviour: succeed (with optional message, data, end_turn, delivered,
    expression, context restart), fail (message, data and expression kept), raise or hang,
    after a virtual delay; with ``hostile``, also raise a `BaseException` subclass or
    `GeneratorExit`, ignore cancellation, or mutate the arguments."""
    return st.builds(
        lambda action, delay, fields: ToolBehaviour(action, delay, **fields),
        st.sampled_from(_HOSTILE_ACTIONS if hostile else _ACTIONS),
        st.sampled_from(_TOOL_DELAYS),
        st.sampled_from(_RESULTS),
    )


def timed_signals(*, hostile: bool = False) -> st.SearchStrategy[TimedSignal]:
    """A stop (with or without a stop message) or a follow-up at a virtual instant. The
    instants come from a small menu so that signals coincide with other events. With
    ``hostile``, a signal may come from another thread."""
    return st.builds(
        TimedSignal,
        at=st.sampled_from(_INSTANTS),
        kind=st.sampled_from(("stop", "follow_up")),
        stop_message=st.sampled_from((None, "sorry, stopping")),
        from_thread=st.booleans() if hostile else st.just(False),
    )


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


_BEHAVIOUR_LISTS = st.lists(tool_behaviours(), max_size=3).map(tuple)
_HOSTILE_BEHAVIOUR_LISTS = st.lists(tool_behaviours(hostile=True), max_size=3).map(tuple)
_SIGNAL = timed_signals()
_HOSTILE_SIGNAL = timed_signals(hostile=True)
#: how many host signals a turn gets: none in half the turns (a signal cuts a turn short)
_SIGNAL_COUNTS = {n: st.sampled_from((0, 0, *range(1, n + 1))) for n in range(4)}
_BOOLEANS = st.booleans()
_DELAYS = st.sampled_from(_DELIVERY_DELAYS)
_FAILING = st.sampled_from((None, None, None, None, None, None, None, 0, 1, 2, 4))
_ALLOWED = st.sampled_from(_ALLOWLISTS)
_PREFILLS = st.sampled_from((None, "Sure, "))
#: What a channel call does, confirming most often (a hostile call cuts a turn short).
_CHANNEL_ACTS = (
    ChannelAct.CONFIRM, ChannelAct.CONFIRM, ChannelAct.CONFIRM, ChannelAct.CONFIRM,
    ChannelAct.RAISE, ChannelAct.HANG, ChannelAct.SLOW_WITHIN, ChannelAct.SLOW_OVER,
    ChannelAct.IGNORE_CANCELLATION,
)  # fmt: skip
_SEND_PLANS = st.lists(st.sampled_from(_CHANNEL_ACTS), max_size=3).map(tuple)
_NOTICE_PLANS = st.lists(st.sampled_from(_CHANNEL_ACTS), max_size=2).map(tuple)
#: Fake API keys: no 8-character run of one occurs in any scripted text, so finding one
#: anywhere is a leak.
PROVIDER_KEYS: tuple[str, ...] = ("hk-7Qm2xZ9pLk4vR8tW3nB6", "hk-Jd5sYc1uHf8gTe2wKa9")
_KEYS = st.sampled_from(PROVIDER_KEYS)


# --------------------------------------------------------------------------- the reviewer
_FINDINGS: tuple[Finding, ...] = (
    Finding(FindingCategory.VOICE, "The reply sounds flat.", "Answer warmly."),
    Finding(FindingCategory.REPETITION, "It says the same thing twice.", "Say it once."),
    Finding(FindingCategory.TOOL_USE, "This call is not needed.", "Answer from the results."),
    Finding(FindingCategory.CONTINUITY, "It contradicts the forecast.", "Keep to the data."),
    Finding(FindingCategory.CHARACTER, "Out of character ü.", "Stay in the role."),
)
_FINDING_LISTS = st.lists(st.sampled_from(_FINDINGS), min_size=1, max_size=4).map(tuple)
#: How long a slow reviewer takes: within every drawn review timeout (1 s), past the
#: shortest only (3 s), past all of them (300 s). No value equals a drawn timeout, so a slow
#: answer and the review deadline never coincide.
_REVIEW_DELAYS: tuple[float, ...] = (1.0, 3.0, 300.0)
_REVIEW_TIMEOUTS: tuple[float, ...] = (120.0, 5.0, 2.0)
_USAGE_OF_A_REVIEW = ReviewUsage(40, 6)
#: The kinds of act, passes and revisions most often (simplest first).
_ACT_KINDS = ("pass", "revise", "pass", "revise", "unavailable", "raise", "hang", "slow", "slow")
_ACT_KIND = st.sampled_from(_ACT_KINDS)
_PASSES = st.sampled_from((Pass(), Pass(usage=_USAGE_OF_A_REVIEW)))
_UNAVAILABLE = st.sampled_from((Unavailable("refusal"), Unavailable("malformed")))
_RAISES = st.sampled_from((Raise(RuntimeError("the reviewer is down")), Raise(TimeoutError())))
_DELAY = st.sampled_from(_REVIEW_DELAYS)
_REVISIONS: st.SearchStrategy[Pass | Revise | Unavailable] = st.builds(Revise, _FINDING_LISTS)


def _verdicts(kind: str) -> st.SearchStrategy[Pass | Revise | Unavailable]:
    if kind == "pass":
        return _PASSES
    if kind == "revise":
        return _REVISIONS
    return _UNAVAILABLE


_SLOW_VERDICT_KIND = st.sampled_from(("pass", "revise", "unavailable"))


def reviewer_acts() -> st.SearchStrategy[ReviewerAct]:
    """One answer of the reviewer: `Pass` (with or without usage), `Revise` with 1–4
    findings, `Unavailable`, a raise, a `Hang` (only the review timeout ends it), or a
    `Slow` verdict within or past the review timeouts `loop_policies` draws."""

    @st.composite
    def acts(draw: st.DrawFn) -> ReviewerAct:
        kind = draw(_ACT_KIND)
        if kind == "hang":
            return Hang()
        if kind == "raise":
            return draw(_RAISES)
        if kind == "slow":
            return Slow(draw(_DELAY), draw(_verdicts(draw(_SLOW_VERDICT_KIND))))
        return draw(_verdicts(kind))

    return acts()


_REVIEWER_SCRIPTS = st.lists(reviewer_acts(), max_size=5).map(tuple)


def reviewer_scripts() -> st.SearchStrategy[tuple[ReviewerAct, ...]]:
    """What the reviewer answers to its first reviews, in order (up to five acts; it passes
    once they run out). Shrinks toward a reviewer that passes everything."""
    return _REVIEWER_SCRIPTS


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
    passes = st.lists(
        provider_passes(max_items=max_items, hostile=hostile, drafting=drafting),
        min_size=1,
        max_size=max_passes,
    )
    counts = _SIGNAL_COUNTS.get(max_signals)
    if counts is None:
        counts = st.sampled_from((0, 0, *range(1, max_signals + 1)))
    behaviour_lists = _HOSTILE_BEHAVIOUR_LISTS if hostile else _BEHAVIOUR_LISTS
    signal = _HOSTILE_SIGNAL if hostile else _SIGNAL

    @st.composite
    def scripts(draw: st.DrawFn) -> TurnScript:
        drawn = draw(passes)
        if draw(_BOOLEANS):
            drawn = _with_call_ids(drawn)
        plan = tuple((name, draw(behaviour_lists)) for name in KNOWN_TOOLS)
        script = TurnScript(
            passes=tuple(drawn),
            tool_plan=tuple((name, b) for name, b in plan if b),
            signals=tuple(draw(signal) for _ in range(draw(counts))),
            delivery_delay=draw(_DELAYS),
            failing_delivery=draw(_FAILING),
            tools_allowed=draw(_ALLOWED),
            prefill=draw(_PREFILLS),
            continuation_style=draw(_BOOLEANS),
        )
        if drafting:
            script = attrs.evolve(script, reviews=draw(_REVIEWER_SCRIPTS))
        if not hostile:
            return script
        quotes_key = any(isinstance(i, EchoKey) for items in drawn for i in items)
        return attrs.evolve(
            script,
            sends=draw(_SEND_PLANS),
            notices=draw(_NOTICE_PLANS),
            provider_key=draw(_KEYS) if quotes_key else None,
        )

    return scripts()


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


def loop_policies(
    *,
    max_iterations: int = 8,
    hostile: bool = False,
    drafting: bool | None = False,
    review_tool_calls: bool | None = False,
) -> st.SearchStrategy[LoopPolicy]:
    """`LoopPolicy` values with small ceilings and short budgets, so limits are reached:
    1–``max_iterations`` passes, soft warning at 1–5, 1–4 consecutive tool errors, 1–3
    continuation failures, budgets of seconds (a pass's total budget included, so that a
    steadily streaming pass can run out of it), and flushes every 1–50 characters. With
    ``hostile``, the host-call budget, the cancellation grace and the pass budget are drawn
    short too (defaults first).

    ``drafting`` and ``review_tool_calls`` switch drafting and the tool checkpoint on
    (``None``: each drawn). With either on, the review fields are drawn small too (defaults
    first): a held-prose ceiling of a few bytes or segments (so replies are cut), the host's
    send limit sometimes below it, 1–3 reviews, 0–2 revisions, 0–8 tool reviews, 0–2
    corrections and review timeouts of 2, 5 or 120 seconds."""
    policies = _kind_policies(max_iterations)
    if hostile:
        policies = _hostile_policies(policies)
    if drafting is False and review_tool_calls is False:
        return policies
    return _reviewed_policies(policies, drafting, review_tool_calls)


def _switch(value: bool | None) -> st.SearchStrategy[bool]:
    return _BOOLEANS if value is None else st.just(value)


def _reviewed_policies(
    policies: st.SearchStrategy[LoopPolicy], drafting: bool | None, checkpoint: bool | None
) -> st.SearchStrategy[LoopPolicy]:
    fields = st.fixed_dictionaries(
        {
            "drafting": _switch(drafting),
            "review_tool_calls": _switch(checkpoint),
            "held_prose_limits": _HELD_PROSE_LIMITS,
            "max_reviews": st.sampled_from((2, 2, 1, 3)),
            "max_revisions": st.sampled_from((1, 1, 0, 2)),
            "max_tool_reviews": st.sampled_from((8, 8, 2, 1, 0)),
            "max_tool_corrections": st.sampled_from((2, 2, 1, 0)),
            "review_timeout": st.sampled_from(_REVIEW_TIMEOUTS),
        }
    )
    return st.builds(_with_review_fields, policies, fields)


def _with_review_fields(policy: LoopPolicy, fields: dict[str, Any]) -> LoopPolicy:
    changes = dict(fields)  # the drawn value stays as drawn (Hypothesis reports it)
    held_bytes, held_segments, send_limit = changes.pop("held_prose_limits")
    return attrs.evolve(
        policy,
        held_prose_max_bytes=held_bytes,
        held_prose_max_segments=held_segments,
        send_message_limit=send_limit,
        **changes,
    )


#: (held_prose_max_bytes, held_prose_max_segments, send_message_limit): the defaults in two
#: policies of three; otherwise a ceiling of bytes or segments, or a host's send limit
#: below the ceiling, small enough to cut a reply (each limit on its own, so a cut shrinks
#: to the one that made it).
_HELD_PROSE_LIMITS = st.sampled_from(
    ((65_536, 4_096, None),) * 16
    + (
        (24, 4_096, None), (8, 4_096, None), (1, 4_096, None), (65_536, 3, None),
        (65_536, 1, None), (65_536, 4_096, 16), (65_536, 4_096, 6), (40, 4_096, 12),
    )
)  # fmt: skip


def _hostile_policies(kind: st.SearchStrategy[LoopPolicy]) -> st.SearchStrategy[LoopPolicy]:
    return st.builds(
        lambda policy, host, grace, pass_budget: attrs.evolve(
            policy, host_call_timeout=host, cancel_grace=grace, max_pass_duration=pass_budget
        ),
        kind,
        st.sampled_from((30.0, 5.0, 1.0)),
        st.sampled_from((2.0, 0.5, 5.0)),
        st.sampled_from((900.0, 60.0, 20.0, 8.0)),
    )


def _kind_policies(max_iterations: int) -> st.SearchStrategy[LoopPolicy]:
    return st.builds(
        LoopPolicy,
        # sampled_from, not integers(): Hypothesis draws integers' bounds far more often
        # than uniformly, and a ceiling of 1 would end most turns after their first pass
        max_function_call_iterations=st.sampled_from(range(1, max_iterations + 1)),
        soft_warn_iteration=st.sampled_from(range(1, 6)),
        max_consecutive_tool_errors=st.sampled_from(range(1, 5)),
        continuation_tool_failure_threshold=st.sampled_from((1, 1, 2, 3)),
        inactivity_timeout=st.sampled_from((30.0, 10.0, 5.0, 2.0, 1.0)),
        first_token_timeout=st.sampled_from((None, 60.0, 10.0, 3.0, 1.0)),
        abandoned_stream_settle=st.sampled_from((5.0, 1.0, 0.0, 20.0)),
        tool_timeout=st.sampled_from((30.0, 10.0, 3.0, 1.0)),
        delivery_flush_chars=st.sampled_from((1, 2, 5, 10, 20, 50)),
        suppress_followup_after_pre_tool_text=st.sampled_from(_SUPPRESS_SETS),
        max_pass_duration=st.sampled_from((900.0, 900.0, 6.0, 2.5)),
    )
