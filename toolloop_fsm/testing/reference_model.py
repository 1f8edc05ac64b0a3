"""The reference model: how a scripted turn must end, predicted without the engine.

`predict_endings(script, policy)` runs an independent, plain-Python discrete-event simulation
of the behaviour rules of one tool-loop turn on a `TurnScript` (the provider's passes, what
each tool does, host signals at virtual instants, what each channel call does) and returns
every `PredictedEnding` the rules allow: status, sub-reason, ``final_text``,
``undelivered_text``, passes, tool dispatches, the deliveries the channel confirmed, the
notices, the history's calls and outcomes, whether a tool delivered a response and the calls
a stop mid-batch found finished. `ending_of(result)` reads the same fields off an engine
result, and `difference(predicted, observed)` says where they part; `check_ending(run)` does
both for one run of `run_script`. This is the kit's invariant 10: the ending is the one the
rules predict.

Its rules are written from docs/behaviour.md's numbered rules, and each stage cites the rule
it follows (§2 a pass, §3 the gate and dispatch, §4 after a tool call, §5 context restart,
§14 drafting). The model shares no decision with the engine: it imports only values
(events, the policy, the result types) and the kit's script types, never the engine's
guards, states, machines, pump or turn state, and it keeps its own clock.

Theory of operation (what the stage functions below do not show):

* Time. Work that takes no virtual time (reading chunks up to the next pause, deciding, a
  tool that returns at once, a delivery to a channel without delay) finishes before the next
  timer falls due. The timers are: the end of a provider pause, the pass's stream budget, a
  tool's return and its deadline, the channel finishing a call, the settle window, and each
  host signal. A delivery the channel finishes at once (confirmed without delay, or refused
  by a raise) is settled right after the step that handed it over, before anything else.
* Ties. When several timers fall due at the same virtual instant, the rules do not say which
  comes first; the model follows every order and predicts every ending they lead to (usually
  one). Host signals at the same instant keep the script's order; one fired from another
  thread is taken like any other. Orders that lead back to a state of the turn already met
  at a tie are not followed again (a trickle whose chunks keep coinciding with confirmations
  would otherwise double the orders at every coincidence).
* Replay identity. A call is identified by its tool name and canonical arguments, and
  counted by occurrence within a replay segment (the attempt; a context restart begins a new
  segment). Every run that completed (succeeded, failed or timed out) is recorded under its
  identity and occurrence, so that occurrences line up; refusals and reuses are not runs.
  The n-th identical call of a segment reuses the outcome recorded for the n-th occurrence
  earlier in the turn when that run succeeded; otherwise it runs (a recorded failure runs
  again, and a deliberate repeat inside one segment is a new occurrence). A tool whose
  ``replay`` is ``"rerun"`` always runs.
* Repeats (docs/behaviour.md §3.11). A call that would take an occurrence of its identity
  past ``max_identical_calls`` in its segment is refused (a failure, taking no occurrence)
  unless its tool is ``repeatable``; it is decided after replay and the checkpoint's
  standing rejections, before the checkpoint's review.
* The tool-call limit (docs/behaviour.md §3.12). A call that would be admitted past
  ``max_tool_calls`` admitted calls of the turn is refused (a refusal counting as no
  failure, posting no notice); it is decided after the repeat guard, before the
  checkpoint's review. Every pass after the limit is reached, and with
  ``at_ceiling="answer"`` the pass numbered ``max_function_call_iterations``, is the final
  answer pass: a call it makes ends the turn ``timeout`` at that ceiling, text completes it
  ``answered_at_…`` that ceiling.
* Tool batches (docs/behaviour.md §3.10). Every call of a pass, in emitted order, is one
  batch. A call without a name ends the turn ``malformed_call`` before any runs; otherwise
  each call passes the gate on its own, in emitted order and before any call runs (a
  refusal, a reuse, the checkpoint's review, which holds the gate until its verdict). The
  admitted calls take their occurrences in emitted order and start in that order, at most
  ``max_parallel_tools`` running at once; a ``sequential`` tool waits until nothing runs and
  runs alone. Starting is a step of the turn's work (the dispatch numbers are given as the
  calls are started; each handler then starts, playing its tool's next planned behaviour),
  and a call that returns at once is done within its start. Each running call has its own
  return and its own deadline on the clock, and a finished call frees its slot for the next.
  When the last call finished, the batch's expressions and failure notices are announced in
  emitted order (§3.8), then §4 decides once for the batch: the counters take the outcomes
  in emitted order; any restart restarts with the other calls recorded (and resets the
  counters, §5 rule 3); otherwise every call is recorded, then the error ceiling, any call
  ending the turn, the continuation threshold, and the pre-tool-text exit when it holds for
  every call. The settle rule reads the last batch: every call's tool needs no follow-up. A
  stop or a failing channel cancels the running calls, announces and records none, and
  names in ``finished_calls`` the batch's calls that had already run (emitted order).
* Final text. A completed turn's ``final_text`` is the text of the pass that completed it (an
  empty pass that settles keeps the last pass text that was not blank; a turn ended after a
  tool round keeps that round's pre-tool text). Every other ending keeps only what the
  channel confirmed: the confirmed text of the last pass whose confirmed text is not blank.
  Scene metadata the provider sent is appended as a ``[Scene Metadata]`` block either way.
  ``undelivered_text`` is what the last pass streamed beyond what the channel confirmed
  (dropped from the buffer, suppressed, or still in flight when the turn ended).
* Settling. After any ending but a stop or a failure of the host's channel, deliveries still
  in flight are awaited: for the settle window after a timeout, for one inactivity budget
  otherwise. A stop while waiting ends the turn at once (a stream timeout becomes
  ``stopped_by_user``); a follow-up while waiting is ignored; a channel call failing while
  waiting ends the turn ``error``.

The hostile world (the kit's `ChannelAct` plans, hostile tools and providers):

* Channel calls. Deliveries (texts and expressions) go to the channel one after another, and
  so do notices and stop messages, on a line of their own beside them; the n-th call of each
  line plays the script's n-th act (``sends``, ``notices``; past the plan it confirms). A
  confirming delivery takes the channel's delay, a confirming notice no time; a slow call
  within the host-call budget confirms after its share of it; a call that raises fails at
  once (``host_error``, as does the script's failing delivery when it would have been
  confirmed). A call that hangs or runs past the budget (a slow call over it, a delivery
  whose delay exceeds it; one taking exactly the budget is a tie) is given up on when the
  budget runs out, and one that also ignores its cancellation only after the cancellation
  grace on top (``host_timeout`` both). Notices are the exception (docs/behaviour.md §7.3
  rule 2): they share one budget per turn, each bounded by what is left of it; one given up
  on changes nothing but spends the budget, and the notices after it are not sent (they are
  still the turn's). A failing call ends the turn ``error``
  at once wherever it is (streaming, running a tool, waiting for deliveries), keeping every
  confirmed delivery and awaiting none; once the turn has ended it changes nothing.
* A notice call that fails at the very instant it is made races the turn's own work at that
  instant: the rules do not say where among that work the failure is seen, so the model
  follows every point between two steps of it (a chunk read, a decision, a tool starting;
  each step is done whole) and after all of it.
* The turn returns only when its notices and stop message have been dealt with (each
  bounded as above). A delivery in flight that the channel confirms meanwhile was delivered
  and read like any other (in the deliveries, ``final_text`` and ``undelivered_text``); the
  ending stands.
* Tools. A tool raising its own `BaseException` subclass or `GeneratorExit`, or returning
  something that is not a `ToolResult`, fails like one raising an exception; one editing
  its arguments in place succeeds (the loop handed it its own copy, so its call's identity
  is what the provider sent); one ignoring its cancellation is, to the turn, a tool that
  never returns: timed out at its deadline and left behind (the grace it gets to stop is
  not waited for).
* Providers. An error quoting the provider's key fails the pass like any provider error;
  usage whose counts are not whole numbers of at least zero (NaN, infinity) is the
  provider's protocol failure, ending the pass ``error`` / ``provider_error``; a retry hint
  that is not finite changes nothing in one attempt. A trickle streams one chunk of its text
  every ``share`` of the inactivity budget, so only the pass's total budget
  (``max_pass_duration``) or a signal ends it.
* Generation turns. A script whose provider holds a key runs as a generation turn of one
  model with that one key: the attempt's ending is the turn's (no key or model is left to
  try), except that a stream timeout's notice is held by the outer tier and posted last,
  only when the turn ends neither ``completed`` nor ``stopped_by_user``.

Drafting and the tool checkpoint (a policy with ``drafting`` or ``review_tool_calls`` on; the
script's ``reviews`` say what the reviewer answers, in order, a pass once they run out):

* Holding. With drafting, every flush of text is held instead of delivered, and a tool's
  expression is held in its place (it is the turn's one expression all the same). The turn
  holds at most the smaller of ``held_prose_max_bytes`` and ``send_message_limit`` UTF-8
  bytes and ``held_prose_max_segments`` pieces, counted across passes and revisions; a
  flush that does not fit keeps its longest prefix of whole characters that does, and cuts
  the reply: nothing more is held, a pass still streaming ends at once as if its stream had
  ended, and the cut reply is completed (its call, if any, ignored).
* Completing a reply happens when a pass ends without a call while something is held, or
  when a tool round would end the turn (the tool asked to, a continuation provider's
  retries are spent, a silent tool followed visible text) while something is held. Nothing
  but expressions held: delivered unreviewed. Otherwise, the reviewer already gave no
  verdict once, or ``max_reviews`` were asked: delivered as it is. Otherwise it is reviewed.
* A reply's verdict: a cut reply is delivered as cut whatever it says (with the
  ``flush_limit`` notice, unless the host's send limit cut it); a pass delivers; a revision
  while ``max_revisions`` allow drops the held reply and starts a pass in a new replay
  segment (a successful call repeated is reused, never run again); a revision past the
  budget delivers; anything else, and the review timeout, delivers the reply unreviewed and
  the reviewer is not asked again in the turn. A stop under review ends the turn and sends
  nothing held; a follow-up ends it too; the host's channel failing ends it ``error``.
* The checkpoint, after the gate and the ledger (a replayed call is never reviewed): the
  identical call rejected before is rejected again without a review; a call of a rejected
  tool is a correction, rejected unreviewed when ``max_tool_corrections`` are spent or the
  reviewer cannot be asked; a new call is reviewed while ``max_tool_reviews`` allow and
  the reviewer answers. A pass runs it (an approved correction lifts its tool's
  rejection); a revision rejects it; no verdict or the timeout runs it — a correction stays
  rejected — and the reviewer is not asked again. A rejection is a failed round with no
  failure notice that counts as no error; a follow-up while a call is reviewed waits.
* Time. A reviewer answering at once answers right after the step that asked it (a notice
  failing at that instant may come first); a slow one answers after its delay; one that
  hangs is ended by the review timeout; one that raises gave no verdict.
* Texts. With drafting, a completed turn's final text is the delivered reply (or the text
  that completed it without one); any other ending keeps what the channel confirmed. The
  undelivered text is what is still held, then what was handed over and never confirmed,
  then the buffer of a pass cut short.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import attrs
import fastjsonschema
from attrs import define
from attrs import field
from attrs import frozen

from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.policy import ExitView
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.result import TOKEN_WEIGHT_UNIT
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import UsageEntry
from toolloop_fsm.result import token_weight
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.testing._lazy_names import REFERENCE_NAMES
from toolloop_fsm.testing.clock import VirtualClock
from toolloop_fsm.testing.harness import ScriptRun
from toolloop_fsm.testing.harness import build_tools
from toolloop_fsm.testing.hostile import SLOW_WITHIN_SHARE
from toolloop_fsm.testing.hostile import ChannelAct
from toolloop_fsm.testing.hostile import EchoKey
from toolloop_fsm.testing.hostile import HostileItem
from toolloop_fsm.testing.hostile import Trickle
from toolloop_fsm.testing.invariants import InvariantViolation
from toolloop_fsm.testing.reviewer import Hang
from toolloop_fsm.testing.reviewer import Raise
from toolloop_fsm.testing.reviewer import ReviewerAct
from toolloop_fsm.testing.reviewer import Slow
from toolloop_fsm.testing.scripted import Fail
from toolloop_fsm.testing.scripted import Pause
from toolloop_fsm.testing.scripted import ScriptItem
from toolloop_fsm.testing.strategies import ToolAction
from toolloop_fsm.testing.strategies import ToolBehaviour
from toolloop_fsm.testing.strategies import TurnScript

__all__ = list(REFERENCE_NAMES)

#: Orders of coinciding timers the model follows at most for one script.
MAX_ORDERINGS = 4096
#: Two timers this close (virtual seconds) fall due at the same instant.
_SAME_INSTANT = 1e-9
#: Finish reasons that mean the pass was cut, not finished: an empty pass so cut never settles.
_CUT_FINISHES = frozenset(
    {FinishKind.LENGTH, FinishKind.SPEAKER_GUARD, FinishKind.CONTINUATION_PENDING}
)
_STREAM_TIMEOUTS = ("first_token_timeout", "inactivity_timeout")

#: A failure of the host's channel ends the turn at once: nothing in flight is awaited.
_HOST_FAILURES = frozenset({"host_error", "host_timeout"})
#: How a channel call ends: confirmed, or failed as one of `_HOST_FAILURES`.
_CONFIRMED = "confirmed"
_GIVEN_UP = "given_up"  # a notice past the turn's notice budget: named, and it ends nothing
_STOP_MESSAGE = "stop message"
#: Tool actions that fail carrying nothing (after the behaviour's delay): they raise, or
#: return something that is not a result.
_RAISING_ACTIONS = frozenset(
    {
        ToolAction.RAISE,
        ToolAction.RAISE_BASE_EXCEPTION,
        ToolAction.RAISE_GENERATOR_EXIT,
        ToolAction.RETURN_GARBAGE,  # §3.6 rule 2: not a ToolResult, a failure all the same
    }
)
#: Tool actions that never return by themselves: only the deadline or a stop ends the round.
_NEVER_RETURNING = frozenset({ToolAction.HANG, ToolAction.IGNORE_CANCELLATION})


# =========================================================================== what it predicts
@frozen
class PredictedEnding:
    """How a turn ends, field by field as `GenerationTurnResult` reports it.

    ``delivered`` holds ``("text", …)`` / ``("expression", …)`` per confirmed delivery, in
    order; ``notices`` the keys of the notices posted, in order; ``history`` one
    ``(tool name, success)`` per call of each tool batch recorded, in emitted order (a
    restarting call records none); ``finished_calls`` the tools of the calls of the batch a
    stop or a failing channel cut short that had already run, in emitted order.
    ``undelivered_text`` is ``None`` only in an observed ending whose result has no such field.
    """

    status: TurnStatus
    reason: str | None
    final_text: str
    undelivered_text: str | None
    iterations: int
    tool_dispatches: int
    delivered: tuple[tuple[str, str], ...]
    notices: tuple[str, ...]
    history: tuple[tuple[str, bool], ...]
    tool_response_delivered: bool
    finished_calls: tuple[str, ...] = ()
    #: the messages that arrived while the turn ran (§8.5): each taken one's mode and the
    #: pass after which it was taken, in order; the modes of those left unanswered
    taken: tuple[tuple[str, int], ...] = ()
    unanswered: tuple[str, ...] = ()


class AmbiguousEnding(ValueError):
    """The script's coinciding timers allow more than one ending; ``endings`` lists them."""

    def __init__(self, endings: Sequence[PredictedEnding]) -> None:
        self.endings = tuple(endings)
        listed = "; ".join(f"{e.status.value} ({e.reason})" for e in self.endings)
        super().__init__(f"events at one instant allow {len(self.endings)} endings: {listed}")


def ending_of(result: GenerationTurnResult) -> PredictedEnding:
    """The fields of an engine result the model predicts, for comparing with it."""
    return PredictedEnding(
        status=result.status,
        reason=result.reason,
        final_text=result.final_text,
        undelivered_text=getattr(result, "undelivered_text", None),
        iterations=result.iterations,
        tool_dispatches=result.tool_dispatches,
        delivered=tuple(
            ("expression", d.expression) if d.expression is not None else ("text", d.text or "")
            for d in result.delivered
        ),
        notices=tuple(notice.key for notice in result.notices),
        history=tuple((e.call.name, e.response.success) for e in result.history),
        tool_response_delivered=result.tool_response_delivered,
        finished_calls=result.finished_calls,
        taken=tuple((m.mode, m.iteration) for m in result.taken_messages),
        unanswered=tuple(m.mode for m in result.unanswered_messages),
    )


def difference(predicted: Sequence[PredictedEnding], observed: PredictedEnding) -> str | None:
    """``None`` when ``observed`` is one of the ``predicted`` endings; otherwise the fields in
    which it differs from the closest of them, one line each."""
    if observed in predicted:
        return None
    names = [a.name for a in PredictedEnding.__attrs_attrs__]

    def differing(expected: PredictedEnding) -> list[str]:
        return [n for n in names if getattr(expected, n) != getattr(observed, n)]

    closest = min(predicted, key=lambda expected: len(differing(expected)))
    lines = [
        f"  {name}: predicted {getattr(closest, name)!r}, engine {getattr(observed, name)!r}"
        for name in differing(closest)
    ]
    if len(predicted) > 1:
        lines.append(f"  ({len(predicted)} endings allowed by coinciding events; closest shown)")
    return "\n".join(lines)


def predict_endings(
    script: TurnScript,
    policy: LoopPolicy,
    *,
    tools: ToolRegistry | None = None,
    usage: Sequence[UsageEntry] = (),
) -> tuple[PredictedEnding, ...]:
    """Every ending the rules allow for ``script`` under ``policy`` (more than one only when
    timers coincide and their order decides). ``tools`` defaults to the registry
    `run_script` builds (only the tools' shapes are read, no handler runs). ``usage`` is the
    usage ledger the turn recorded — what the provider reported each pass read and wrote, or
    the estimate where it reported none — which a budget's rules are applied to (§2.8)."""
    if tools is None:
        tools = build_tools(script, clock=VirtualClock(), signals=TurnSignals(), executions=[])
    shapes = {
        tool.name: _ToolShape(
            requires_follow_up=tool.requires_follow_up,
            deadline=tool.timeout if tool.timeout is not None else policy.tool_timeout,
            rerun=getattr(tool, "replay", None) == "rerun",
            parameters=json.dumps(tool.parameters, sort_keys=True),
            sequential=tool.sequential,
            repeatable=getattr(tool, "repeatable", False),
        )
        for tool in tools
    }
    endings: list[PredictedEnding] = []
    explored: set[str] = set()
    path: list[int] | None = []
    runs = 0
    while path is not None:
        runs += 1
        if runs > MAX_ORDERINGS:
            raise RuntimeError(
                f"more than {MAX_ORDERINGS} orders of coinciding events; the model gives up"
            )
        choices = _Choices(path, explored)
        try:
            ending = _Simulation(script, policy, shapes, choices, tuple(usage)).run()
        except _Explored:
            pass  # every ending from here on was predicted by an earlier path
        else:
            if ending not in endings:
                endings.append(ending)
        path = choices.next_path()
    return tuple(endings)


def check_ending(run: ScriptRun) -> None:
    """Invariant 10 on one run of `run_script`: raise `InvariantViolation` (number 10) when
    the engine's ending is none of those the model predicts for the run's script and
    policy, naming each field that differs and listing the script."""
    predicted = predict_endings(
        run.script, run.policy, tools=run.tools, usage=run.result.usage.entries
    )
    mismatch = difference(predicted, ending_of(run.result))
    if mismatch is not None:
        raise InvariantViolation(
            10,
            f"the engine's ending is not the reference model's:\n{mismatch}\n"
            f"script:\n{describe_script(run.script, run.policy)}",
        )


def predict_ending(
    script: TurnScript,
    policy: LoopPolicy,
    *,
    tools: ToolRegistry | None = None,
    usage: Sequence[UsageEntry] = (),
) -> PredictedEnding:
    """The one ending the rules predict; raises `AmbiguousEnding` when coinciding events
    allow several (use `predict_endings` for those scripts)."""
    endings = predict_endings(script, policy, tools=tools, usage=usage)
    if len(endings) > 1:
        raise AmbiguousEnding(endings)
    return endings[0]


# =========================================================================== the world
@frozen
class _ToolShape:
    requires_follow_up: bool
    deadline: float
    rerun: bool
    parameters: str  # the arguments' JSON schema, as canonical JSON
    sequential: bool = False  # a barrier in its batch: it runs alone (§3.10 rule 2)
    repeatable: bool = False  # exempt from the repeated-call guard (§3.11 rule 6)


@frozen
class _Outcome:
    """A tool round's outcome as the loop sees it."""

    success: bool
    end_turn: bool = False
    delivered: bool = False
    expression: str | None = None
    restarts: bool = False
    dispatched: bool = False
    reused: bool = False
    rejected: bool = False  # the tool checkpoint's reviewer rejected the call: it never ran
    limited: bool = False  # refused by the tool-call limit (§3.12): no failure counted


_TIMED_OUT = _Outcome(success=False, dispatched=True)
_REFUSED = _Outcome(success=False)
_REJECTED = _Outcome(success=False, rejected=True)
_LIMITED = _Outcome(success=False, limited=True)


class _Choices:
    """One path through the tree of orders of coinciding timers (depth-first, in order).

    ``explored`` is shared by every path of one prediction: the states of the turn at the
    fresh choices taken so far (those past the replayed prefix). The tree is walked depth
    first, so when a later path meets such a state again, every order from there on was
    already followed: that path stops (`Explored`) instead of following them again."""

    def __init__(self, path: Sequence[int], explored: set[str]) -> None:
        self.path = list(path)
        self.taken: list[tuple[int, int]] = []
        self.explored = explored

    def meet(self, state: Callable[[], str]) -> None:
        """About to choose (past the replayed prefix) in the turn's ``state``: raise
        `_Explored` when it was met before."""
        if len(self.taken) < len(self.path):
            return  # replaying the prefix of this path
        seen = state()
        if seen in self.explored:
            raise _Explored
        self.explored.add(seen)

    def pick(self, options: int) -> int:
        depth = len(self.taken)
        choice = self.path[depth] if depth < len(self.path) else 0
        self.taken.append((choice, options))
        return choice

    def next_path(self) -> list[int] | None:
        for depth in range(len(self.taken) - 1, -1, -1):
            choice, options = self.taken[depth]
            if choice + 1 < options:
                return [c for c, _ in self.taken[:depth]] + [choice + 1]
        return None


class _Explored(Exception):
    """The orders from this state on were already followed by an earlier path."""


@define
class _Delivery:
    text: str | None = None
    expression: str | None = None
    pass_number: int = 0


@define
class _ChannelCall:
    """A call into the host's channel in progress: when it ends and how (`_CONFIRMED` or one
    of `_HOST_FAILURES`); ``instant``: it ends at the instant it was made."""

    due: float
    outcome: str
    instant: bool


@define
class _Pass:
    """One provider pass: its script, what it streamed so far and when."""

    number: int
    started_at: float
    items: list[HostileItem]
    position: int = 0
    resumes_at: float | None = None  # the end of the pause the stream is in
    last_chunk_at: float | None = None  # None: no chunk yet (the first-token budget runs)
    last_confirmed_at: float | None = None
    texts: list[str] = field(factory=list)
    buffer: list[str] = field(factory=list)  # text chunks not yet handed to the channel
    confirmed: list[str] = field(factory=list)  # this pass's text the channel confirmed
    calls: list[FunctionCall] = field(factory=list)  # its tool batch, in emitted order
    finish: FinishKind | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


@define
class _BatchCall:
    """One call of the tool batch (docs/behaviour.md §3.10): its place in the batch, its
    occurrence once it took one, its outcome once known; while it runs, when it returns
    (``None``: never by itself), when its deadline passes and what its handler plays."""

    position: int
    call: FunctionCall
    occurrence: tuple[str, int] | None = None
    outcome: _Outcome | None = None
    sequential: bool = False
    done_at: float | None = None
    deadline_at: float = 0.0
    behaviour: ToolBehaviour = field(factory=ToolBehaviour)

    @property
    def name(self) -> str:
        return str(self.call.name)


@define
class _Review:
    """The review being waited for: of the reply (``call`` is ``None``) or of a call
    (``correction`` when it corrects a rejected call). ``answer_at`` is when the reviewer
    answers (``None``: never), ``instant`` when it answers in the step that asked it;
    ``deadline_at`` is when the review timeout runs out."""

    verdict: object
    answer_at: float | None
    instant: bool
    deadline_at: float
    call: FunctionCall | None = None
    correction: bool = False


def _identity(call: FunctionCall) -> str:
    """A call's identity: its name and its arguments in canonical JSON."""
    try:
        canonical = json.dumps(call.arguments, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        canonical = repr(call.arguments)
    return f"{call.name}\\x00{canonical}"


def _utf8_prefix(text: str, size: int) -> str:
    """The longest prefix of ``text`` of at most ``size`` UTF-8 bytes (whole characters)."""
    kept: list[str] = []
    used = 0
    for character in text:
        width = len(character.encode("utf-8"))
        if used + width > size:
            break
        kept.append(character)
        used += width
    return "".join(kept)


#: docs/behaviour.md §9.12 rule 2 / invariant 9: a piece of a key is a run of 8 of its
#: characters (the whole of a shorter key)
_FRAGMENT = 8


def _key_starts(key: str | None) -> frozenset[str]:
    """What streamed text may end with that the next chunk could complete into a piece of
    ``key``: every proper beginning of every piece."""
    if not key:
        return frozenset()
    size = min(len(key), _FRAGMENT)
    pieces = {key[i : i + size] for i in range(len(key) - size + 1)}
    return frozenset(piece[:n] for piece in pieces for n in range(1, len(piece)))


def _whole_counts(usage: UsageReport) -> bool:
    """Usage counts are whole numbers of at least zero (not NaN, not infinite)."""
    return all(
        isinstance(count, int) and not isinstance(count, bool) and count >= 0
        for count in (usage.input_tokens, usage.output_tokens)
    )


# =========================================================================== the tool-round rules
# docs/behaviour.md §3 (a call, from the gate to the failure notice), §4 (after a tool call)
# and §5 (a context restart), one plain decision per numbered rule, read from that document
# alone. The simulation below asks them in the order the document gives and applies what
# they decide; they know nothing of time, the channel or the simulation.


@frozen
class _Counters:
    """What the rounds so far leave for the next (§4.2 rules 4-5): failures in a row,
    continuation failures in a row, and whether streamed text is suppressed."""

    failures: int = 0
    continuation_failures: int = 0
    suppressed: bool = False


def _malformed(call: FunctionCall) -> bool:
    """§3.1, §3.10 rule 1: a call without a name or with a blank name is a protocol failure
    that ends the turn before any call of its batch runs."""
    return not isinstance(call.name, str) or not call.name.strip()


def _refused(
    call: FunctionCall,
    registered: Mapping[str, _ToolShape],
    allowed: frozenset[str] | None,
    disabled: set[str],
) -> bool:
    """§3.2 truncated arguments, §3.3 unparseable arguments or (§3.10 rule 1) arguments
    that are not a JSON object, §3.4 a tool the model may not call (unknown, outside
    ``tools_allowed``, or disabled for the turn): the tool does not run and the call is a
    failure."""
    if call.truncated or call.parse_error is not None:
        return True
    if not isinstance(call.arguments, Mapping):
        return True
    name = str(call.name)
    may_call = name in registered and (allowed is None or name in allowed)
    return not may_call or name in disabled


def _reusable(recorded: _Outcome | None, shape: _ToolShape) -> bool:
    """§3.5: the call's occurrence was recorded earlier in the turn and that run succeeded,
    and the tool is not registered ``replay="rerun"``."""
    return not shape.rerun and recorded is not None and recorded.success


def _reused(recorded: _Outcome) -> _Outcome:
    """§3.5: what a reuse hands back — the recorded ``end_turn`` and ``delivered`` — and,
    being no run, no expression again (§3.8 rule 1) and no restart (§5)."""
    return _Outcome(
        success=True, end_turn=recorded.end_turn, delivered=recorded.delivered, reused=True
    )


def _arguments_accepted(shape: _ToolShape, arguments: object) -> bool:
    """§3.6: the arguments are checked against the tool's ``parameters`` schema before the
    handler runs; a violation, or a schema that cannot be compiled, is a failed call."""
    check = _schema_check(shape.parameters)
    if check is None:
        return False
    try:
        check(arguments)
    except fastjsonschema.JsonSchemaException:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _schema_check(parameters: str) -> Callable[[object], object] | None:
    """A schema (canonical JSON) compiled once; ``None`` when it cannot be compiled (a
    ``$ref`` to another document among them: it is never fetched)."""
    never_fetched = dict.fromkeys(("http", "https", "file", "ftp"), _no_fetching)
    try:
        return fastjsonschema.compile(json.loads(parameters), handlers=never_fetched)
    except Exception:  # any schema the validator cannot build is one that cannot be compiled
        return None


def _no_fetching(uri: str) -> object:
    raise ValueError(f"{uri} is another document; the schema's references are never fetched")


def _outcome_of(behaviour: ToolBehaviour) -> _Outcome:
    """§3.6 rule 2: what a handler that returned hands the loop. A `ToolResult` says success
    or failure and carries its fields; a raise of any kind is a failure carrying nothing."""
    if behaviour.action in _RAISING_ACTIONS:
        return _Outcome(success=False, dispatched=True)
    return _Outcome(
        success=behaviour.action is not ToolAction.FAIL,
        end_turn=behaviour.end_turn,
        delivered=behaviour.delivered,
        expression=behaviour.expression,
        restarts=behaviour.context_restart is not None,
        dispatched=True,
    )


def _shows_expression(outcome: _Outcome, shown_already: bool) -> bool:
    """§3.8 rule 1: a successful tool's expression, at most once per turn, never for a
    reused outcome."""
    return (
        outcome.success
        and outcome.expression is not None
        and not outcome.reused
        and not shown_already
    )


def _posts_failure_notice(outcome: _Outcome) -> bool:
    """§3.8 rule 2: every failure posts ``tool_failed`` — but a rejection by the tool
    checkpoint posts none (§14.6), nor a refusal by the tool-call limit (§3.12 rule 3)."""
    return not outcome.success and not outcome.rejected and not outcome.limited


def _restarts_context(outcome: _Outcome) -> bool:
    """§4.1: a successful outcome carrying a context restart restarts the context; a reused
    one never does (§5)."""
    return outcome.success and outcome.restarts and not outcome.reused


def _counted(
    counters: _Counters, outcome: _Outcome, *, continuation_style: bool, pre_tool_text: bool
) -> _Counters:
    """§4.2 rule 4 and §5 rule 3: a success resets both counters and lifts suppression.
    §4.2 rule 5: a failure adds one failure; on a continuation-style provider, after pre-tool
    text, also one continuation failure, and text is suppressed. A checkpoint rejection
    counts as no error (§14.6), nor does a refusal by the tool-call limit (§3.12 rule 3)."""
    if outcome.success:
        return _Counters()
    if outcome.rejected or outcome.limited:
        return counters
    if continuation_style and pre_tool_text:
        return _Counters(counters.failures + 1, counters.continuation_failures + 1, True)
    return attrs.evolve(counters, failures=counters.failures + 1)


def _disables(name: str, outcome: _Outcome, policy: LoopPolicy) -> bool:
    """§4.2 rule 4: a successful call of the memory tool disables it for the rest of the
    turn (§3.4 then refuses it)."""
    return outcome.success and name == policy.memory_tool_name


def _error_ceiling_reached(counters: _Counters, policy: LoopPolicy) -> bool:
    """§4.3: ``max_consecutive_tool_errors`` failures in a row."""
    return counters.failures >= policy.max_consecutive_tool_errors


def _tool_ends_turn(outcome: _Outcome) -> bool:
    """§4.4: a successful outcome with ``end_turn``."""
    return outcome.success and outcome.end_turn


def _continuation_retries_spent(
    counters: _Counters, policy: LoopPolicy, *, continuation_style: bool
) -> bool:
    """§4.5: on a continuation-style provider, the threshold of continuation failures."""
    return (
        continuation_style
        and counters.continuation_failures >= policy.continuation_tool_failure_threshold
    )


def _visible_text_suffices(
    name: str,
    outcome: _Outcome,
    shape: _ToolShape | None,
    policy: LoopPolicy,
    *,
    pre_tool_text: str | None,
    continuation_style: bool,
    iteration: int,
) -> bool:
    """§4.6, after a successful tool whose pass had non-blank pre-tool text: the policy's
    own rule when it sets ``end_after_pre_tool_text``, asked what it sees of the call; else
    rule 1, the memory tool as a member of the suppress set, whatever its follow-up setting;
    rule 2, a tool registered ``requires_follow_up=False`` that is in the set or runs on a
    continuation-style provider."""
    if not outcome.success or pre_tool_text is None:
        return False
    rule = policy.end_after_pre_tool_text
    if rule is not None:
        view = ExitView(
            tool_name=name,
            pre_tool_text=pre_tool_text,
            # a tool the registry does not know is taken to need one
            requires_follow_up=shape is None or shape.requires_follow_up,
            continuation_style=continuation_style,
            iteration=iteration,
        )
        answer: object = rule(view)
        if not isinstance(answer, bool):
            raise TypeError(f"end_after_pre_tool_text answered {answer!r}, not a bool")
        return answer
    in_set = name in policy.suppress_followup_after_pre_tool_text
    if name == policy.memory_tool_name and in_set:
        return True
    silent = shape is not None and not shape.requires_follow_up
    return silent and (in_set or continuation_style)


#: What §4 decides after a recorded batch: the sub-reason the turn ends with, or the next pass.
_NEXT_PASS = "next_pass"


# =========================================================================== the simulation
_Timer = tuple[float, Callable[[], None]]  # when it fires, and what happens then


class _Simulation:
    """One run of the rules along one order of coinciding timers."""

    def __init__(
        self,
        script: TurnScript,
        policy: LoopPolicy,
        tools: Mapping[str, _ToolShape],
        choices: _Choices,
        usage: tuple[UsageEntry, ...] = (),
    ) -> None:
        self.script = script
        self.policy = policy
        # §2.8: the usage ledger the budgets are applied to, and what the pass streaming may
        # still write under them (weight parts) with the sub-reason a cut takes
        self.usage = usage
        self.room: tuple[int, str] | None = None
        self.tools = tools
        self.choices = choices
        self.now = 0.0
        self.phase = "streaming"  # streaming, tool, settling, ended
        # a provider holding a key runs as a one-model generation turn
        self.generation = script.provider_key is not None
        # docs/behaviour.md §9.12 rule 2: streamed text ending in what could begin a piece of
        # the turn's key is held back until the next chunk or event
        self.key_starts = _key_starts(script.provider_key)
        self.key_tail = ""
        # the world: tool plans played per tool, the host's signals
        self.executions: dict[str, int] = {}
        self.signals = sorted(enumerate(script.signals), key=lambda s: (s[1].at, s[0]))
        # §8.5: the modes of the steered and queued messages held, in order, and of those
        # taken into the context with the pass after which each was
        self.held_messages: list[str] = []
        self.taken_messages: list[tuple[str, int]] = []
        # the channel's two lines: deliveries (the head of `queue` is being sent) and
        # notices / stop messages (`notice_queue` waits behind the call in progress)
        self.queue: deque[_Delivery] = deque()
        self.send_call: _ChannelCall | None = None
        self.sends = 0  # delivery calls made
        self.confirmations = 0  # deliveries that reached the point of being confirmed
        self.notice_queue: deque[str] = deque()
        self.notice_call: _ChannelCall | None = None
        self.notice_calls = 0
        # docs/behaviour.md §7.3 rule 2: the turn's notices share one host-call budget
        self.notice_budget = self.policy.host_call_timeout
        self.notice_budget_spent = False
        self.notice_started = 0.0
        self.confirmed: list[_Delivery] = []
        # the turn
        self.passes: list[_Pass] = []
        self.reading = False
        # the tool batch of the pass being answered (§3.10): its calls in emitted order, the
        # next to pass the gate, those admitted and not yet started, those dispatched whose
        # handler has yet to start, and those running
        self.batch: list[_BatchCall] = []
        self.gating = 0
        self.admitted: deque[_BatchCall] = deque()
        self.starting: deque[_BatchCall] = deque()
        self.running: list[_BatchCall] = []
        self.pre_tool_text: str | None = None
        self.dispatches = 0
        # §3.12: the calls admitted to run this turn, and whether the pass streaming is the
        # final answer pass (the ceiling that withdrew its tools, or None)
        self.calls_admitted = 0
        self.withdrawn: str | None = None
        self.counters = _Counters()
        self.last_batch: tuple[str, ...] = ()  # §4.2 rule 3: the last batch's tools
        self.visible_text_handed = False
        self.expression_taken = False  # §3.8 rule 1's one expression (drafting: held counts)
        self.expression_delivered = False  # §2.5 rule 2: handed to the channel
        self.expression_in_draft = False  # held in the draft a revision may drop (§14.4)
        self.tool_response_delivered = False
        self.disabled: set[str] = set()
        self.ledger: dict[tuple[str, int], _Outcome] = {}  # (identity, occurrence): last run
        self.occurrences: dict[str, int] = {}
        self.finished_calls: tuple[str, ...] = ()  # §3.10 rule 5: runs done before a stop
        self.history: list[tuple[str, bool]] = []
        self.notices: list[str] = []
        self.held_timeout_notice = False
        self.scene: list[str] = []
        # the ending
        self.status: TurnStatus | None = None
        self.reason: str | None = None
        self.completed_text = ""
        self.dropped = ""
        self.settle_due = 0.0
        self.unsent: list[_Delivery] = []  # handed over, never begun: the turn had ended
        # drafting and the tool checkpoint: the held presentation, the held-prose ceiling's
        # consumption, the review budgets, the checkpoint's rejections
        self.drafting = policy.drafting
        self.checkpoint = policy.review_tool_calls
        self.held: list[tuple[str, str]] = []  # ("text" | "expression", value), in order
        self.held_bytes = 0
        self.held_segments = 0
        self.cut = False
        self.cut_by_send_limit = False
        self.reviews = 0
        self.revisions = 0
        self.revised_at = 0  # the passes before the last revision
        self.reviewer_gone = False  # no verdict once: never asked again in the turn
        self.tool_reviews = 0
        self.corrections = 0
        self.rejected: set[str] = set()  # identities of rejected calls
        self.rejected_names: set[str] = set()
        self.acts_played = 0
        self.review: _Review | None = None

    @property
    def current(self) -> _Pass:
        return self.passes[-1]

    def state(self) -> str:
        """Everything that decides how the turn goes on from here, as one text (a pass by
        what it has yet to stream, not by what it read)."""
        fields = {
            name: value
            for name, value in vars(self).items()
            if name not in ("script", "policy", "tools", "choices", "passes")
        }
        passes = [
            (
                p.number,
                p.started_at,
                p.items[p.position :],
                p.resumes_at,
                p.last_chunk_at,
                p.last_confirmed_at,
                p.texts,
                p.buffer,
                p.confirmed,
                p.calls,
                p.finish,
            )
            for p in self.passes
        ]
        return repr((sorted(fields.items()), passes))

    # ------------------------------------------------------------------ the event loop
    def run(self) -> PredictedEnding:
        self.start_pass()
        # the turn returns once it has ended and its notices are dealt with
        while self.phase != "ended" or self.notice_call is not None:
            send = self.send_call
            if send is not None and send.instant:
                self.delivery_done()  # an instant channel answers right after the step
                continue
            review = self.review
            if review is not None and review.instant and self.phase == "review":
                # so does a reviewer that answers at once (a step of the turn's work)
                if self.racing_notice_first():
                    self.notice_done()
                else:
                    self.review_answers()
                continue
            if self.phase != "ended" and (self.reading or self.starting):
                if self.racing_notice_first():
                    self.notice_done()
                elif self.reading:
                    self.read_item()
                else:
                    self.start_tool()
                continue
            self.next_timer()
        return self.ending()

    def racing_notice_first(self) -> bool:
        """A notice call failing at the instant it was made, while the turn still has work
        to do at that instant: the failure may come before any step of that work (each
        step — a chunk read, a decision, a tool starting, a reviewer's verdict — is done
        whole)."""
        call = self.notice_call
        if call is None or not call.instant:
            return False
        return self.choices.pick(2) == 1

    def next_timer(self) -> None:
        """Move the clock to the earliest timer and fire it (in every order, at a tie)."""
        phase_timers = self._PHASE_TIMERS.get(self.phase)
        due = phase_timers(self) if phase_timers is not None else []
        if self.send_call is not None:
            due.append((self.send_call.due, self.delivery_done))
        if self.notice_call is not None:
            due.append((self.notice_call.due, self.notice_done))
        if self.signals and self.phase != "ended":
            due.append((max(self.signals[0][1].at, self.now), self.signal_arrives))
        if not due:
            raise RuntimeError(f"the turn waits on nothing in phase {self.phase!r}")
        first = min(at for at, _ in due)
        ready = [fire for at, fire in due if at - first <= _SAME_INSTANT]
        if len(ready) > 1:
            self.choices.meet(self.state)
        fire = ready[self.choices.pick(len(ready))] if len(ready) > 1 else ready[0]
        self.now = max(self.now, first)
        fire()

    def _streaming_timers(self) -> list[_Timer]:
        """A paused stream resumes; the pass's budget runs out."""
        due: list[_Timer] = []
        if self.current.resumes_at is not None:
            due.append((self.current.resumes_at, self.stream_resumes))
        due.append((self._stream_due(), self.stream_budget_expires))
        return due

    def _tool_timers(self) -> list[_Timer]:
        """Each running call of the batch returns, or its own deadline passes."""
        due: list[_Timer] = []
        for running in self.running:
            if running.done_at is not None:
                due.append((running.done_at, functools.partial(self.tool_returns, running)))
            due.append(
                (running.deadline_at, functools.partial(self.tool_deadline_expires, running))
            )
        return due

    def _settling_timers(self) -> list[_Timer]:
        """The settle window ends."""
        return [(self.settle_due, self.settle_window_ends)]

    def _review_timers(self) -> list[_Timer]:
        """The reviewer answers; the review's deadline passes."""
        review = self.review
        assert review is not None
        due: list[_Timer] = []
        if review.answer_at is not None:
            due.append((review.answer_at, self.review_answers))
        due.append((review.deadline_at, self.review_deadline_expires))
        return due

    # the timers each phase runs, besides a delivery, a notice and a signal in flight
    _PHASE_TIMERS: ClassVar[Mapping[str, Callable[[_Simulation], list[_Timer]]]] = {
        "streaming": _streaming_timers,
        "tool": _tool_timers,
        "settling": _settling_timers,
        "review": _review_timers,
    }

    # ------------------------------------------------------------------ stream once
    def start_pass(self) -> None:
        """docs/behaviour.md §2.1: before every pass, the iteration ceiling; then the pass
        opens: the steered messages held join its context (§8.5 rule 2), and the one-time
        *still working* notice is posted as the pass after the soft-warning iteration
        begins."""
        if len(self.passes) >= self.policy.max_function_call_iterations:
            self.post("max_iterations")
            self.decide(TurnStatus.TIMEOUT, "iteration_ceiling")
            return
        number = len(self.passes) + 1
        room = self.budget_room(number)
        if isinstance(room, str):  # §2.8 rule 3: the pass does not start
            self.post("budget_exceeded")
            self.decide(TurnStatus.TIMEOUT, room)
            return
        self.room = None if room is None else (room[0] * TOKEN_WEIGHT_UNIT, room[1])
        self.withdrawn = self.tools_withdrawn(number)
        if "steer" in self.held_messages:
            self.take(["steer"])
        if number == self.policy.soft_warn_iteration + 1:
            self.post("still_working")
        items = self.script.passes[number - 1] if number <= len(self.script.passes) else ()
        self.passes.append(_Pass(number, self.now, list(items)))
        self.phase = "streaming"
        self.reading = True

    def take(self, modes: list[str]) -> None:
        """§8.5 rule 4: the held messages of ``modes`` are taken, in the order they came."""
        for mode in [m for m in self.held_messages if m in modes]:
            self.taken_messages.append((mode, len(self.passes)))
        self.held_messages = [m for m in self.held_messages if m not in modes]

    def answers_held(self) -> bool:
        """§8.5 rule 3: a turn that would end ``completed`` holding messages takes them all
        and opens one more pass, when the iteration ceiling and the budgets leave one."""
        if not self.held_messages or self.phase == "settling":
            return False
        if len(self.passes) >= self.policy.max_function_call_iterations:
            return False
        if isinstance(self.budget_room(len(self.passes) + 1), str):
            return False
        self.take(["steer", "queue"])
        self.start_pass()
        return True

    def budget_room(self, number: int) -> tuple[int, str] | str | None:
        """§2.8 rules 1-4 before pass ``number``, from the ledger's entries of the passes
        and reviews before it: the sub-reason of a ceiling the pass would break (it does not
        start), else the tokens the tightest ceiling lets it write with the sub-reason of
        that ceiling, or ``None`` when no budget is set. The pass is expected to read what
        the last pass read; the ceilings are tried input, output, total, cost, and the
        first of the tightest rooms is the one that cuts."""
        budget = self.policy.budget
        if budget is None:
            return None
        earlier = [entry for entry in self.usage if entry.iteration < number]
        read = sum(entry.input_tokens for entry in earlier)
        wrote = sum(entry.output_tokens for entry in earlier)
        passes = [entry for entry in earlier if entry.source == "author"]
        reads = passes[-1].input_tokens if passes else 0
        if budget.input_tokens is not None and read + reads > budget.input_tokens:
            return "token_budget"
        rooms: list[tuple[int, str]] = []
        if budget.output_tokens is not None:
            rooms.append((budget.output_tokens - wrote, "token_budget"))
        if budget.total_tokens is not None:
            rooms.append((budget.total_tokens - read - wrote - reads, "token_budget"))
        price = self.policy.price
        if budget.cost is not None and price is not None:
            money = budget.cost - price.cost(read, wrote) - price.cost(reads, 0)
            per_token = price.output_per_million / 1_000_000
            if money < 0:
                rooms.append((0, "cost_budget"))
            elif per_token > 0:
                rooms.append((int(money / per_token), "cost_budget"))
        if not rooms:
            return None
        tokens, reason = min(rooms, key=lambda room: room[0])
        return reason if tokens < 1 else (tokens, reason)

    def within_room(self, text: str) -> tuple[str, bool]:
        """§2.8 rule 5: what of ``text`` the pass may write, weighed by the estimate of §2.2
        rule 3, and whether it reached the room (the pass is cut there)."""
        assert self.room is not None
        room, reason = self.room
        weight = token_weight(text)
        if weight <= room:
            self.room = (room - weight, reason)
            return text, False
        kept = 0
        for index, char in enumerate(text):
            kept += token_weight(char)
            if kept > room:
                return text[:index], True
        return text, True  # unreachable: the whole text weighs more than the room

    def cut_at_budget(self) -> None:
        """§2.8 rule 5: the pass is cut where it reached its room; what fits is delivered,
        its calls never run, and the turn ends at the ceiling."""
        assert self.room is not None
        self.reading = False
        self.flush()
        self.post("budget_exceeded")
        self.decide(TurnStatus.TIMEOUT, self.room[1])

    def tools_withdrawn(self, number: int) -> str | None:
        """§3.12 rule 4: once the calls admitted reach ``max_tool_calls``, every later pass is
        offered no tools; §2.1 rule 1: with ``at_ceiling="answer"``, so is the pass numbered
        ``max_function_call_iterations``. The limit is named first when both hold."""
        limit = self.policy.max_tool_calls
        if limit is not None and self.calls_admitted >= limit:
            return "tool_call_limit"
        if (
            self.policy.at_ceiling == "answer"
            and number == self.policy.max_function_call_iterations
        ):
            return "iteration_ceiling"
        return None

    def _stream_due(self) -> float:
        """The first-token budget runs from the pass's start until its first chunk of any
        kind; then the inactivity budget runs from the later of the last chunk and the last
        delivery the channel confirmed during the pass. The pass's total budget runs from its
        start whatever happens."""
        current = self.current
        whole_pass = current.started_at + self.policy.max_pass_duration
        if current.last_chunk_at is None:
            return min(whole_pass, current.started_at + self.policy.effective_first_token_timeout)
        last = current.last_chunk_at
        if current.last_confirmed_at is not None:
            last = max(last, current.last_confirmed_at)
        return min(whole_pass, last + self.policy.inactivity_timeout)

    def read_item(self) -> None:
        """Read the stream up to its next pause, failure or end (no time passes). A trickle
        is a pause of its share of the inactivity budget, then its text, again and again."""
        current = self.current
        if current.position == len(current.items):
            self.reading = False
            self.release_held()
            self.stream_ends()
            return
        item = current.items[current.position]
        current.position += 1
        if self.key_starts and not isinstance(item, Pause | Trickle):
            if isinstance(item, TextDelta):
                let_through = self.hold_key_start(item)
                if let_through is None:
                    return
                item = let_through
            else:
                self.release_held()  # what arrived before another kind of chunk goes first
                if self.phase != "streaming":
                    return
        if isinstance(item, Trickle):
            self._unroll_trickle(current, item)
        elif isinstance(item, Pause):
            self.reading = False
            current.resumes_at = self.now + item.seconds
        elif isinstance(item, Fail | EchoKey):
            self.reading = False
            self.end_stream(TurnStatus.ERROR, "provider_error")
        elif isinstance(item, UsageReport) and not _whole_counts(item):
            self.reading = False  # a chunk the rules refuse: the provider broke the protocol
            self.end_stream(TurnStatus.ERROR, "provider_error")
        else:
            self.take_chunk(item)

    def _unroll_trickle(self, current: _Pass, item: Trickle) -> None:
        """One more beat of a trickle (unless it has run out): a pause of its share of the
        inactivity budget, its text, then the rest of it, next in the stream."""
        if item.count is not None and item.count <= 0:
            return
        rest = Trickle(item.share, item.text, None if item.count is None else item.count - 1)
        interval = item.share * self.policy.inactivity_timeout
        current.items[current.position : current.position] = [
            Pause(interval),
            TextDelta(item.text),
            rest,
        ]

    def hold_key_start(self, chunk: TextDelta) -> TextDelta | None:
        """docs/behaviour.md §9.12 rule 2: the text is let through after what was held, but
        for its longest ending that could begin a piece of a key (``None``: all of it held)."""
        text = self.key_tail + chunk.text
        cut = len(text)
        for size in range(min(len(text), _FRAGMENT - 1), 0, -1):
            if text[-size:] in self.key_starts:
                cut = len(text) - size
                break
        self.key_tail = text[cut:]
        if not text:
            return chunk  # an empty chunk holds nothing back: it passes as it came
        return TextDelta(text[:cut]) if cut else None

    def release_held(self) -> None:
        """The held text is the model's: it goes to the loop before whatever comes next (the
        end of the stream, a provider's failure, another chunk, a deadline, a signal), but
        not after a host failure (`host_fails`)."""
        if self.key_tail and self.phase == "streaming":
            held, self.key_tail = self.key_tail, ""
            self.take_chunk(TextDelta(held))

    def stream_resumes(self) -> None:
        self.current.resumes_at = None
        self.reading = True

    def take_chunk(self, chunk: ScriptItem) -> None:
        """Every chunk re-arms the budget. Text is buffered and handed to the channel once
        ``delivery_flush_chars`` are buffered; every call joins the pass's tool batch, in
        emitted order (§3.10 rule 1); the last finish reason counts; scene metadata is kept
        for the final text."""
        current = self.current
        current.last_chunk_at = self.now
        if isinstance(chunk, TextDelta):
            text, cut = chunk.text, False
            if self.room is not None:
                text, cut = self.within_room(text)
            if text or not cut:
                current.texts.append(text)
                current.buffer.append(text)
                if sum(map(len, current.buffer)) >= self.policy.delivery_flush_chars:
                    self.flush(mid_stream=True)
            if cut:
                self.cut_at_budget()
        elif isinstance(chunk, ThoughtDelta):
            # thoughts are written output too (§2.8 rule 5), shown to nobody
            if self.room is not None and self.within_room(chunk.text)[1]:
                self.cut_at_budget()
        elif isinstance(chunk, FunctionCall):
            current.calls.append(chunk)
        elif isinstance(chunk, FinishReason):
            current.finish = chunk.kind
        elif isinstance(chunk, SceneMetadata):
            self.scene.append(chunk.text)

    def flush(self, *, mid_stream: bool = False) -> None:
        """Hand the buffered text to the channel as one delivery — unless text is suppressed
        (a continuation-style provider after a failed tool), when it is dropped. Drafting
        holds it instead (``mid_stream``: the pass is still streaming)."""
        current = self.current
        if not current.buffer:
            return
        text = "".join(current.buffer)
        current.buffer.clear()
        if self.counters.suppressed:
            return
        if self.drafting:
            self.hold_text(text, mid_stream=mid_stream)
            return
        if text.strip():
            self.visible_text_handed = True
        self.hand_over(_Delivery(text=text, pass_number=current.number))

    def end_stream(self, status: TurnStatus, reason: str | None) -> None:
        """A pass cut short (provider failure, budget, stop, follow-up, host failure): the
        buffered text is dropped, never delivered."""
        self.release_held()
        current = self.current
        self.dropped = "".join(current.buffer)
        current.buffer.clear()
        current.resumes_at = None
        self.reading = False
        self.decide(status, reason)

    def stream_budget_expires(self) -> None:
        """A genuine timeout (a stop would already have ended the pass): the stream is
        aborted and the timeout notice posted."""
        current = self.current
        if self.now >= current.started_at + self.policy.max_pass_duration - _SAME_INSTANT:
            reason = "pass_duration_timeout"  # the whole pass's budget, however it streamed
        elif current.last_chunk_at is None:
            reason = "first_token_timeout"
        else:
            reason = "inactivity_timeout"
        if self.generation:
            self.held_timeout_notice = True  # the outer tier posts it, last, if at all
        else:
            self.post("timeout")
        self.end_stream(TurnStatus.TIMEOUT, reason)

    def stream_ends(self) -> None:
        """docs/behaviour.md §2.4, §2.5: the pass ended normally; a call goes to the gate; otherwise
        text completes the turn, and an empty pass settles or ends ``empty_response``. The buffer is
        flushed first in every case."""
        current = self.current
        self.flush()
        if self.drafting and self.cut:
            self.complete_reply()  # cut at the ceiling: the reply is over, its calls ignored
        elif current.calls and self.withdrawn and not any(map(_malformed, current.calls)):
            # §3.12 rule 5, §2.1 rule 1: the final answer pass called anyway: nothing runs
            self.post(
                "tool_call_limit" if self.withdrawn == "tool_call_limit" else "max_iterations"
            )
            self.decide(TurnStatus.TIMEOUT, self.withdrawn)
        elif current.calls:
            self.open_batch(current.calls)
        elif self.drafting and self.held:
            self.complete_reply()
        elif current.text.strip():
            self.completed_text = current.text
            # §3.12 rule 6: an answer on the final answer pass says the tools were withdrawn
            self.decide(TurnStatus.COMPLETED, self.withdrawn and f"answered_at_{self.withdrawn}")
        elif self.settles(current):
            texts = [p.text for p in self.passes[self.revised_at :] if p.text.strip()]
            self.completed_text = texts[-1] if texts else ""
            self.decide(TurnStatus.COMPLETED, "settled_after_tool")
        else:
            self.decide(TurnStatus.EMPTY_RESPONSE)

    def settles(self, current: _Pass) -> bool:
        """docs/behaviour.md §2.5 rule 2: an empty pass that was not cut is a finished reply when a
        tool already delivered a response (itself, or by a delivered expression), or when visible
        text or the turn's expression was delivered and the last tool needs no follow-up. An
        expression only held in a draft a revision dropped was never delivered (§14.4)."""
        if current.finish in _CUT_FINISHES:
            return False
        if self.tool_response_delivered:
            return True
        shapes = [self.tools.get(name) for name in self.last_batch]
        shown = self.visible_text_handed or self.expression_delivered
        # §3.10 rule 4: the settle rule holds when it holds for every call of the batch
        return (
            shown
            and bool(shapes)
            and all(shape is not None and not shape.requires_follow_up for shape in shapes)
        )

    # ------------------------------------------------------------------ the tool batch
    def open_batch(self, calls: Sequence[FunctionCall]) -> None:
        """docs/behaviour.md §3.10 rule 1: every call of the pass, in emitted order, is one
        batch. A call without a name ends the turn ``malformed_call`` before any call of
        the batch runs (§3.1); otherwise each call passes the gate on its own."""
        text = self.current.text
        self.pre_tool_text = text if text.strip() else None
        if any(_malformed(call) for call in calls):
            self.decide(TurnStatus.ERROR, "malformed_call")
            return
        self.batch = [
            _BatchCall(position, call, sequential=self._sequential(call))
            for position, call in enumerate(calls)
        ]
        self.gating = 0
        self.admitted.clear()
        self.starting.clear()
        self.running = []
        self.phase = "tool"
        self.gate_next()

    def _sequential(self, call: FunctionCall) -> bool:
        shape = self.tools.get(str(call.name))
        return shape is not None and shape.sequential

    def gate_next(self) -> None:
        """§2.4 rule 3, §3.2-§3.5, §3.11, §3.12 and §14.6 for each call in emitted order,
        before any call runs: a refusal is that call's failure, a replayed call hands back
        its recorded outcome (never reviewed), the checkpoint rejects again what it
        rejected, a repeat past the allowance is refused, so is a call past the tool-call
        limit, the checkpoint may review the call (the gate goes on after its verdict);
        anything else is admitted. Then the admitted calls are dispatched."""
        while self.gating < len(self.batch):
            entry = self.batch[self.gating]
            self.gating += 1
            call = entry.call
            if _refused(call, self.tools, self.script.tools_allowed, self.disabled):
                self.call_known(entry, _REFUSED)
                continue
            identity = _identity(call)
            recorded = self.ledger.get((identity, self.occurrences.get(identity, 0)))
            if recorded is not None and _reusable(recorded, self.tools[entry.name]):
                self.take_occurrence(entry)
                self.call_known(entry, _reused(recorded))
                continue
            if self.checkpoint and self.checkpoint_rejects(entry, identity):
                continue
            if self.repeats_too_often(entry, identity):
                self.call_known(entry, _REFUSED)
                continue
            limit = self.policy.max_tool_calls
            if limit is not None and self.calls_admitted >= limit:
                self.call_known(entry, _LIMITED)  # §3.12 rules 1-2
                continue
            if self.checkpoint and self.checkpoint_reviews(entry):
                if self.phase == "review":
                    return  # the gate goes on once the verdict is in
                continue
            self.admit(entry)
        self.launch()

    def take_occurrence(self, entry: _BatchCall) -> None:
        """§3.5, §3.10 rule 6: the call is the next occurrence of its identity in the
        replay scope, taken in emitted order (a reuse or a run; a refused call or one the
        checkpoint rejects takes none)."""
        identity = _identity(entry.call)
        occurrence = self.occurrences.get(identity, 0)
        self.occurrences[identity] = occurrence + 1
        entry.occurrence = (identity, occurrence)

    def admit(self, entry: _BatchCall) -> None:
        """The call passed the gate: it takes its occurrence and waits to be dispatched."""
        self.take_occurrence(entry)
        self.admitted.append(entry)
        self.calls_admitted += 1
        self.phase = "tool"

    def launch(self) -> None:
        """§3.10 rule 2: admitted calls start in emitted order, at most
        ``max_parallel_tools`` running at once; a ``sequential`` tool is a barrier (the calls
        before it finish, it runs alone, then the rest). Each start is a dispatch under the
        call's own deadline; arguments the schema refuses fail at once (§3.6). Once every
        call of the batch is known, §4 decides."""
        most = self.policy.max_parallel_tools
        while self.admitted:
            busy = [*self.running, *self.starting]
            entry = self.admitted[0]
            if busy and (entry.sequential or any(b.sequential for b in busy)):
                break
            if len(busy) >= most:
                break
            self.admitted.popleft()
            self.dispatches += 1
            shape = self.tools[entry.name]
            if not _arguments_accepted(shape, entry.call.arguments):
                self.call_finished(entry, _Outcome(success=False, dispatched=True))
                return  # call_finished launched what follows
            entry.deadline_at = self.now + shape.deadline
            self.starting.append(entry)
        idle = not self.admitted and not self.running and not self.starting
        if idle and self.phase == "tool":
            self.batch_done()

    def start_tool(self) -> None:
        """A dispatched call's handler starts (after the dispatching step): it plays its
        tool's next planned behaviour, or succeeds plainly once the plan is used up."""
        entry = self.starting.popleft()
        plan = self.script.plan_for(entry.name)
        played = self.executions.get(entry.name, 0)
        self.executions[entry.name] = played + 1
        entry.behaviour = plan[played] if played < len(plan) else ToolBehaviour()
        self.running.append(entry)
        if entry.behaviour.action not in _NEVER_RETURNING:
            entry.done_at = self.now + entry.behaviour.delay
            if entry.behaviour.delay <= 0:
                self.tool_returns(entry)

    def tool_returns(self, entry: _BatchCall) -> None:
        self.call_finished(entry, _outcome_of(entry.behaviour))

    def tool_deadline_expires(self, entry: _BatchCall) -> None:
        """§3.6 rule 1: this call's deadline; it is abandoned and the model told it timed
        out. Its siblings go on (§3.10 rule 2)."""
        self.call_finished(entry, _TIMED_OUT)

    def call_finished(self, entry: _BatchCall, outcome: _Outcome) -> None:
        """A dispatched call finished (returned, raised, timed out): its run is recorded
        under its occurrence (§3.5: failures too), its outcome is known, and the batch's
        calls waiting for a slot start."""
        if entry in self.running:
            self.running.remove(entry)
        if entry.occurrence is not None:
            self.ledger[entry.occurrence] = outcome
        self.call_known(entry, outcome)
        if self.phase == "tool":
            self.launch()

    def call_known(self, entry: _BatchCall, outcome: _Outcome) -> None:
        """A call's outcome is known (a run, a refusal, a reuse, a rejection); it is
        announced with the batch's (`announce`)."""
        entry.outcome = outcome

    def announce(self, outcomes: Sequence[_Outcome]) -> None:
        """§3.8 for each call of the finished batch, in emitted order (§3.10 rule 4: what
        follows a tool call follows the batch): a success's expression (the turn's one), a
        failure's notice."""
        for outcome in outcomes:
            if _shows_expression(outcome, self.expression_taken):  # §3.8 rule 1
                assert outcome.expression is not None
                self.show_expression(outcome.expression)
            if _posts_failure_notice(outcome):  # §3.8 rule 2
                self.post("tool_failed")

    # ------------------------------------------------------------------ after the batch
    def batch_done(self) -> None:
        """§3.10 rule 4, §4 once the batch's last call finished: the counters take the
        outcomes in emitted order; any restart restarts (§4.1, §5) with the other calls
        recorded; otherwise every call is recorded (§4.2) and §4.3-§4.7 decide for the
        batch."""
        batch = self.batch
        outcomes = [entry.outcome for entry in batch]
        assert all(outcome is not None for outcome in outcomes)
        known = [outcome for outcome in outcomes if outcome is not None]
        self.announce(known)
        continuation_style = self.script.continuation_style
        pre_tool_text = self.pre_tool_text is not None
        for outcome in known:
            self.counters = _counted(
                self.counters,
                outcome,
                continuation_style=continuation_style,
                pre_tool_text=pre_tool_text,
            )
        self.last_batch = tuple(entry.name for entry in batch)  # §4.2 rule 3, §5 rule 3
        restarts = any(_restarts_context(outcome) for outcome in known)
        # §4.2 rules 1, 3 and 4: a history entry per call (none for a restarting one, §5
        # rule 4), a delivered response, the memory tool disabled
        for entry, outcome in zip(batch, known, strict=True):
            if _restarts_context(outcome):
                continue
            self.history.append((entry.name, outcome.success))
            self.tool_response_delivered |= outcome.success and outcome.delivered
            if _disables(entry.name, outcome, self.policy):
                self.disabled.add(entry.name)
        self.batch = []
        if restarts:  # §4.1: §5 rules 3-6, the counters reset after the batch counted
            self.counters = _Counters()
            self.occurrences = {}
            self.start_pass()
            return
        decided = self._after_batch(batch, known, pre_tool_text=self.pre_tool_text)
        if decided == "consecutive_tool_errors":  # §4.3
            self.post("tool_error_loop")
            self.decide(TurnStatus.ERROR, decided)
            return
        if decided == "continuation_retries_exhausted":  # §4.5
            self.post("retry_exhausted")
        if decided == _NEXT_PASS:  # §4.7
            self.start_pass()
        elif self.drafting and self.held:
            self.complete_reply()  # §14.3: the round would end the turn with a reply held
        else:  # §4.4-§4.6: completed with the pre-tool text
            self.completed_text = self.pre_tool_text or ""
            self.decide(TurnStatus.COMPLETED, decided)

    def _after_batch(
        self,
        batch: Sequence[_BatchCall],
        outcomes: Sequence[_Outcome],
        *,
        pre_tool_text: str | None,
    ) -> str:
        """§4.3-§4.7 for the batch (§3.10 rule 4): the error ceiling on the counters; any
        call ending the turn; the continuation threshold; the pre-tool-text exit when it
        holds for every call; else the next pass."""
        continuation_style = self.script.continuation_style
        if _error_ceiling_reached(self.counters, self.policy):
            return "consecutive_tool_errors"
        if any(_tool_ends_turn(outcome) for outcome in outcomes):
            return "end_turn"
        if _continuation_retries_spent(
            self.counters, self.policy, continuation_style=continuation_style
        ):
            return "continuation_retries_exhausted"
        if all(
            _visible_text_suffices(
                entry.name,
                outcome,
                self.tools.get(entry.name),
                self.policy,
                pre_tool_text=pre_tool_text,
                continuation_style=continuation_style,
                iteration=len(self.passes),
            )
            for entry, outcome in zip(batch, outcomes, strict=True)
        ):
            return "pre_tool_text_suffices"
        return _NEXT_PASS

    # ------------------------------------------------------------------ drafting

    def show_expression(self, expression: str) -> None:
        """§3.8 rule 1: the turn's one expression — held in its place in a draft (§14.2),
        else handed over at once, answering the user itself (§2.5)."""
        self.expression_taken = True
        if self.drafting:
            self.expression_in_draft = True
            self.hold_expression(expression)
        else:
            self.expression_delivered = True
            self.tool_response_delivered = True
            self.hand_over(_Delivery(expression=expression))

    def hold_text(self, text: str, *, mid_stream: bool) -> None:
        """Hold a flush of text within the held-prose ceiling: the turn's bytes (the smaller
        of the ceiling and the host's send limit) and segments, across passes and
        revisions. A flush that does not fit keeps what fits of it (whole characters) and
        cuts the reply; nothing more is held, and a pass still streaming ends there."""
        if self.cut or not text:
            return
        policy = self.policy
        limit, by_send_limit = policy.held_prose_max_bytes, False
        if policy.send_message_limit is not None and policy.send_message_limit < limit:
            limit, by_send_limit = policy.send_message_limit, True
        room = limit - self.held_bytes
        size = len(text.encode("utf-8"))
        if size <= room and self.held_segments < policy.held_prose_max_segments:
            self.keep("text", text, size)
            return
        if self.held_segments >= policy.held_prose_max_segments:
            by_send_limit = False  # the segment ceiling is the library's own
        elif room > 0:
            kept = _utf8_prefix(text, room)
            if kept:
                self.keep("text", kept, len(kept.encode("utf-8")))
        self.cut, self.cut_by_send_limit = True, by_send_limit
        if mid_stream and self.reading:
            self.reading = False  # the rest of the pass is never read
            self.stream_ends()

    def hold_expression(self, expression: str) -> None:
        """A tool's expression is held in its place (while a segment is left and the reply
        was not cut); it is the turn's one expression either way."""
        if self.cut or self.held_segments >= self.policy.held_prose_max_segments:
            return
        self.keep("expression", expression, 0)

    def keep(self, kind: str, value: str, size: int) -> None:
        self.held.append((kind, value))
        self.held_bytes += size
        self.held_segments += 1

    def held_text(self) -> str:
        return "".join(value for kind, value in self.held if kind == "text")

    def complete_reply(self) -> None:
        """Complete the held reply: nothing but expressions held, delivered unreviewed; a
        reviewer that gave no verdict before, or no review left, delivered as it is;
        otherwise the reviewer is asked."""
        if not self.held_text().strip():
            self.deliver_held("no_pending_prose")
        elif self.reviewer_gone:
            self.deliver_held("draft_unreviewed")
        elif self.reviews >= self.policy.max_reviews:
            self.deliver_held("reviews_exhausted")
        else:
            self.reviews += 1
            self.ask_reviewer(None)

    def deliver_held(self, reason: str) -> None:
        """Hand the held presentation to the channel in order; it is the turn's final text.
        A reply cut at the ceiling is followed by the ``flush_limit`` notice, unless the
        host's own send limit cut it."""
        texts: list[str] = []
        for kind, value in self.held:
            if kind == "text":
                texts.append(value)
                if value.strip():
                    self.visible_text_handed = True
                self.hand_over(_Delivery(text=value, pass_number=len(self.passes)))
            else:
                self.expression_delivered = True
                self.tool_response_delivered = True
                self.hand_over(_Delivery(expression=value))
        self.held = []
        self.expression_in_draft = False
        self.completed_text = "".join(texts)
        if self.cut and not self.cut_by_send_limit:
            self.post("flush_limit")
        self.decide(TurnStatus.COMPLETED, reason)

    def ask_reviewer(self, call: FunctionCall | None, *, correction: bool = False) -> None:
        """The reviewer plays its next act (a pass once they run out): a verdict or a raise
        answers at once, a slow verdict after its delay, a hang never; the review timeout
        bounds the wait."""
        acts: Sequence[ReviewerAct] = self.script.reviews
        act = acts[self.acts_played] if self.acts_played < len(acts) else Pass()
        self.acts_played += 1
        deadline = self.now + self.policy.review_timeout
        review = _Review(act, self.now, True, deadline, call, correction)
        if isinstance(act, Hang):
            review.verdict, review.answer_at, review.instant = None, None, False
        elif isinstance(act, Raise):
            review.verdict = None  # a reviewer that raised gave no verdict
        elif isinstance(act, Slow):
            review.verdict = act.verdict
            review.answer_at, review.instant = self.now + act.seconds, act.seconds <= 0
        self.review = review
        self.phase = "review"

    def review_answers(self) -> None:
        review = self.review
        assert review is not None
        self.review = None
        verdict = review.verdict
        if review.call is not None:
            self.call_verdict(review, verdict)
            return
        if self.cut:
            self.deliver_held("cut_at_length_limit")  # no room to revise: as cut
        elif isinstance(verdict, Pass):
            self.deliver_held("draft_passed")
        elif isinstance(verdict, Revise) and self.revisions < self.policy.max_revisions:
            self.revise()
        elif isinstance(verdict, Revise):
            self.deliver_held("revisions_exhausted")
        else:
            self.reviewer_gone = True
            self.deliver_held("draft_unreviewed")

    def review_deadline_expires(self) -> None:
        """The reviewer did not answer in time: it is not asked again in the turn; a held
        reply is delivered as it is, a call runs unreviewed (a correction stays rejected)."""
        review = self.review
        assert review is not None
        self.review = None
        self.reviewer_gone = True
        if review.call is None:
            self.deliver_held("review_timeout")
            return
        entry = self.batch[self.gating - 1]
        self.phase = "tool"
        if review.correction:
            self.reject(entry)
        else:
            self.admit(entry)
        self.gate_next()

    def revise(self) -> None:
        """The first revisions the budget allows: the held reply and the model's own words
        are dropped (every tool outcome stays), one instruction asks for a replacement, and
        the passes that follow replay like a new segment (a successful call repeated is
        reused, never run again)."""
        self.revisions += 1
        self.held = []
        if self.expression_in_draft:
            # §14.4: the dropped draft's expression was never shown; the replacement may show one
            self.expression_in_draft = False
            self.expression_taken = False
        self.cut = False
        self.pre_tool_text = None
        self.revised_at = len(self.passes)
        self.occurrences = {}
        self.start_pass()

    # ------------------------------------------------------------------ the tool checkpoint
    def repeats_too_often(self, entry: _BatchCall, identity: str) -> bool:
        """§3.11: the call would take an occurrence of its identity past
        ``max_identical_calls`` in its replay segment (the identical calls that ran, were
        reused or were admitted before it), and its tool is not ``repeatable``."""
        shape = self.tools[entry.name]
        seen = self.occurrences.get(identity, 0)
        return not shape.repeatable and seen >= self.policy.max_identical_calls

    def _checkpoint_available(self) -> bool:
        return not self.reviewer_gone and self.tool_reviews < self.policy.max_tool_reviews

    def checkpoint_rejects(self, entry: _BatchCall, identity: str) -> bool:
        """The tool checkpoint's standing rejections (§14.6 rules 1-2), before any call
        runs (§3.10 rule 6): the identical call rejected before is rejected again; a call
        of a rejected tool is a correction, rejected when no correction is left or the
        reviewer cannot be asked."""
        if identity in self.rejected:
            self.call_known(entry, _REJECTED)
            return True
        correction = entry.name in self.rejected_names
        limit = self.policy.max_tool_corrections
        if correction and (self.corrections >= limit or not self._checkpoint_available()):
            self.reject(entry)
            return True
        return False

    def checkpoint_reviews(self, entry: _BatchCall) -> bool:
        """§14.6 rules 3-4: a call is reviewed while reviews are left and the reviewer
        answers. ``False``: it runs unreviewed."""
        correction = entry.name in self.rejected_names
        if not self._checkpoint_available():
            return False
        self.tool_reviews += 1
        if correction:
            self.corrections += 1
        self.ask_reviewer(entry.call, correction=correction)
        return True

    def call_verdict(self, review: _Review, verdict: object) -> None:
        """The verdict on the call under review; then the gate goes on with the next call
        of the batch."""
        entry = self.batch[self.gating - 1]
        self.phase = "tool"
        if isinstance(verdict, Pass):
            if review.correction:
                self.rejected_names.discard(entry.name)  # an approved correction
            self.admit(entry)
        elif isinstance(verdict, Revise):
            self.reject(entry)
        else:
            self.reviewer_gone = True
            if review.correction:
                self.reject(entry)  # only an approval lets a correction run
            else:
                self.admit(entry)
        self.gate_next()

    def reject(self, entry: _BatchCall) -> None:
        """The call does not run; the model is shown it was rejected (no failure)."""
        self.rejected.add(_identity(entry.call))
        self.rejected_names.add(entry.name)
        self.call_known(entry, _REJECTED)

    # ------------------------------------------------------------------ host signals
    def signal_arrives(self) -> None:
        """A stop ends the turn at once wherever it is (its message, if any, goes to the
        channel's notice line; a held reply is never sent); a follow-up ends a pass being
        streamed or a drafted reply under review, waits for the next turn during a tool
        chain (a call under review included), and changes nothing once the turn has
        ended."""
        _, signal = self.signals.pop(0)
        if signal.kind in ("steer", "queue"):
            self.held_messages.append(signal.kind)  # §8.5: held, whatever the turn is doing
            return
        if signal.kind == "stop":
            self.signals.clear()  # one stop ends the turn; nothing later can matter
            if signal.stop_message is not None:
                self.call_channel_line(_STOP_MESSAGE)  # queued at the front of the channel
            if self.phase == "streaming":
                self.end_stream(TurnStatus.STOPPED_BY_USER, None)
            elif self.phase == "tool":
                self.drop_batch()  # §3.10 rule 5
                self.decide(TurnStatus.STOPPED_BY_USER, "stopped_during_tool")
            elif self.phase == "review":
                self.review = None  # nothing held is ever sent
                self.decide(TurnStatus.STOPPED_BY_USER, "stopped_during_review")
            elif self.phase == "settling":
                if self.status is TurnStatus.TIMEOUT and self.reason in _STREAM_TIMEOUTS:
                    self.status, self.reason = TurnStatus.STOPPED_BY_USER, "stopped_while_settling"
                self.end_turn()
        elif self.phase == "streaming":
            self.end_stream(TurnStatus.FOLLOW_UP_INTERRUPT, None)
        elif self.phase == "review" and self.review is not None and self.review.call is None:
            self.review = None  # a drafted reply yields to the new message, unsent
            self.decide(TurnStatus.FOLLOW_UP_INTERRUPT, None)

    # ------------------------------------------------------------------ the channel
    def _channel_call(self, act: ChannelAct, *, delivery: bool) -> _ChannelCall:
        """How one channel call made now ends. A confirming delivery takes the channel's
        delay, a confirming notice no time; a slow call within the host-call budget takes its
        share of it; a raise fails at once; a hang, a call over the budget and a delivery
        slower than the budget are given up on when it runs out; one that also ignores its
        cancellation is given up on after the grace on top."""
        budget = self.policy.host_call_timeout
        now = self.now
        if act is ChannelAct.CONFIRM:
            delay = self.script.delivery_delay if delivery else 0.0
            # a delivery taking exactly the budget returns as the budget runs out: a tie
            overdue = delay > budget + _SAME_INSTANT or (
                abs(delay - budget) <= _SAME_INSTANT and self.choices.pick(2) == 1
            )
            if overdue:
                return _ChannelCall(now + budget, "host_timeout", instant=False)
            return _ChannelCall(now + delay, _CONFIRMED, instant=delay <= 0)
        if act is ChannelAct.RAISE:
            return _ChannelCall(now, "host_error", instant=True)
        if act is ChannelAct.SLOW_WITHIN:
            return _ChannelCall(now + SLOW_WITHIN_SHARE * budget, _CONFIRMED, instant=False)
        if act is ChannelAct.IGNORE_CANCELLATION:
            grace = self.policy.cancel_grace
            return _ChannelCall(now + budget + grace, "host_timeout", instant=False)
        return _ChannelCall(now + budget, "host_timeout", instant=False)  # hang, slow over

    @staticmethod
    def _act(plan: Sequence[ChannelAct], index: int) -> ChannelAct:
        return plan[index] if index < len(plan) else ChannelAct.CONFIRM

    def hand_over(self, delivery: _Delivery) -> None:
        """Deliveries go to the channel one after another."""
        self.queue.append(delivery)
        if self.send_call is None:
            self.start_send()

    def start_send(self) -> None:
        act = self._act(self.script.sends, self.sends)
        self.sends += 1
        self.send_call = self._channel_call(act, delivery=True)

    def delivery_done(self) -> None:
        """The channel finished the delivery at the head of the line: confirmed (which also
        re-arms a streaming pass's inactivity budget) or failed (a host failure ends the turn
        ``error`` at once). After the turn has ended, while it waits for its notices, a
        confirmation still counts as delivered and read (the ending stands), and nothing more
        is sent."""
        call = self.send_call
        assert call is not None
        self.send_call = None
        delivery = self.queue.popleft()
        outcome = call.outcome
        if outcome == _CONFIRMED:
            failing = self.confirmations == self.script.failing_delivery
            self.confirmations += 1
            if failing:
                outcome = "host_error"
        if outcome != _CONFIRMED:
            if self.phase != "ended":
                self.host_fails(outcome)
            else:
                self.unsent.insert(0, delivery)  # never confirmed: it stays undelivered
            return
        self.confirmed.append(delivery)
        if delivery.text is not None:
            self.passes[delivery.pass_number - 1].confirmed.append(delivery.text)
        if self.phase == "ended":
            return  # confirmed before the turn returned: read, but nothing more is sent
        if self.phase == "streaming":
            self.current.last_confirmed_at = self.now
        if self.queue:
            self.start_send()
        elif self.phase == "settling":
            self.end_turn()

    def post(self, key: str) -> None:
        """Post a notice: it is the turn's, and a call on the channel's notice line."""
        self.notices.append(key)
        self.call_channel_line(key)

    def call_channel_line(self, what: str) -> None:
        """A notice or stop message joins the channel's notice line."""
        self.notice_queue.append(what)
        if self.notice_call is None:
            self.start_notice()

    def start_notice(self) -> None:
        """The next call of the notice line starts; one that confirms at once is done at
        once and the next one starts. A notice once the turn's notice budget is spent is
        not sent at all (it is still the turn's notice)."""
        while self.notice_queue and self.notice_call is None:
            what = self.notice_queue.popleft()
            is_notice = what != _STOP_MESSAGE
            if is_notice and self.notice_budget_spent:
                continue
            act = self._act(self.script.notices, self.notice_calls)
            self.notice_calls += 1
            call = self._notice_call(act) if is_notice else self._channel_call(act, delivery=False)
            if not (call.instant and call.outcome == _CONFIRMED):
                self.notice_call = call
                self.notice_started = self.now

    def _notice_call(self, act: ChannelAct) -> _ChannelCall:
        """docs/behaviour.md §7.3 rule 2: a notice is bounded by what is left of the turn's
        notice budget; one that runs past it (a hang, a slow call over what is left) is given
        up on then, and one that also ignores its cancellation after the grace on top: it
        changes nothing but the budget, which is spent from then on."""
        left = self.notice_budget
        now = self.now
        if act is ChannelAct.CONFIRM:
            return _ChannelCall(now, _CONFIRMED, instant=True)
        if act is ChannelAct.RAISE:
            return _ChannelCall(now, "host_error", instant=True)
        if act is ChannelAct.SLOW_WITHIN:
            delay = SLOW_WITHIN_SHARE * self.policy.host_call_timeout
            # a call taking exactly what is left returns as the budget runs out: a tie
            overdue = delay > left + _SAME_INSTANT or (
                abs(delay - left) <= _SAME_INSTANT and self.choices.pick(2) == 1
            )
            if not overdue:
                return _ChannelCall(now + delay, _CONFIRMED, instant=False)
        if act is ChannelAct.IGNORE_CANCELLATION:
            return _ChannelCall(now + left + self.policy.cancel_grace, _GIVEN_UP, instant=False)
        return _ChannelCall(now + left, _GIVEN_UP, instant=False)  # hang, slow over

    def notice_done(self) -> None:
        """A notice or stop message call ended: a failure ends a turn still running
        ``error`` (a notice given up on fails nothing: it spends the notice budget); then
        the line goes on."""
        call = self.notice_call
        assert call is not None
        self.notice_call = None
        if call.outcome == _GIVEN_UP:
            self.notice_budget_spent = True
        elif call.outcome != _CONFIRMED and self.phase != "ended":
            self.host_fails(call.outcome)
        if not self.notice_budget_spent and call.outcome == _CONFIRMED:
            self.notice_budget = max(0.0, self.notice_budget - (self.now - self.notice_started))
            self.notice_budget_spent = self.notice_budget <= 0
        self.start_notice()

    def host_fails(self, reason: str) -> None:
        """The host's channel failed (``host_error``) or did not return (``host_timeout``):
        the pass or the tool is cut short and the turn ends ``error`` at once; text held back
        as a possible start of a key is not let through (nothing more is sent)."""
        self.key_tail = ""
        if self.phase == "streaming":
            self.end_stream(TurnStatus.ERROR, reason)
        else:
            self.drop_batch()
            self.review = None
            self.decide(TurnStatus.ERROR, reason)

    def drop_batch(self) -> None:
        """The turn ends mid-batch (a stop, a failing channel): no call of it starts, the
        running ones are cancelled, and those already run are named (§3.10 rule 5)."""
        self.finished_calls = tuple(
            entry.name
            for entry in self.batch
            if entry.outcome is not None and entry.outcome.dispatched
        )
        self.batch = []
        self.admitted.clear()
        self.starting.clear()
        self.running = []

    def settle_window_ends(self) -> None:
        self.end_turn()

    # ------------------------------------------------------------------ the ending
    def decide(self, status: TurnStatus, reason: str | None = None) -> None:
        """The turn's ending is decided. A stop and a host failure end it at once; otherwise
        it waits (bounded) for deliveries in flight: the settle window after a timeout, one
        inactivity budget after anything else. A turn that would end ``completed`` holding
        messages answers them first (§8.5 rule 3)."""
        if status is TurnStatus.COMPLETED and self.held_messages and self.answers_held():
            return
        self.status, self.reason = status, reason
        self.reading = False
        if status is TurnStatus.STOPPED_BY_USER or reason in _HOST_FAILURES or not self.queue:
            self.end_turn()
            return
        self.phase = "settling"
        window = (
            self.policy.abandoned_stream_settle
            if status is TurnStatus.TIMEOUT
            else self.policy.inactivity_timeout
        )
        self.settle_due = self.now + window

    def end_turn(self) -> None:
        """The turn has ended: deliveries not yet begun are never sent (the one in progress
        may still be confirmed before the turn returns)."""
        self.phase = "ended"
        while len(self.queue) > (1 if self.send_call is not None else 0):
            self.unsent.insert(0, self.queue.pop())

    def streamed_texts(self, status: TurnStatus) -> tuple[str, str]:
        """A completed turn keeps its completing text; any other ending keeps only the text
        the channel confirmed (the last pass whose confirmed text is not blank). What the
        last pass streamed beyond what the channel confirmed never reached the user:
        dropped from the buffer, suppressed, or still in flight when the turn ended."""
        if status is TurnStatus.COMPLETED:
            final_text = self.completed_text
        else:
            seen = ["".join(p.confirmed) for p in self.passes]
            shown = [text for text in seen if text.strip()]
            final_text = shown[-1] if shown else ""
        dropped = ""
        if self.passes:
            last = self.passes[-1]
            streamed, confirmed = "".join(last.texts), "".join(last.confirmed)
            dropped = streamed[len(confirmed) :] if streamed.startswith(confirmed) else streamed
        return final_text, dropped

    def drafted_texts(self, status: TurnStatus) -> tuple[str, str]:
        """Drafting: text reaches the user only as the delivered draft. A completed turn
        keeps its completing text (the delivered draft); any other ending what the channel
        confirmed. Undelivered: what is still held (a draft a stop or a failure left
        unsent), then what was handed over and never confirmed."""
        if status is TurnStatus.COMPLETED:
            final_text = self.completed_text
        else:
            final_text = "".join(d.text for d in self.confirmed if d.text is not None)
        unsent = [*self.queue, *self.unsent]
        dropped = self.held_text() + "".join(d.text for d in unsent if d.text is not None)
        dropped += self.dropped  # the buffer of a pass cut short, never held
        return final_text, dropped

    def ending(self) -> PredictedEnding:
        """How the turn ended, with the texts `streamed_texts` or `drafted_texts` say."""
        status = self.status
        assert status is not None
        if self.drafting:
            final_text, dropped = self.drafted_texts(status)
        else:
            final_text, dropped = self.streamed_texts(status)
        if self.scene:
            final_text = f"{final_text}\n\n[Scene Metadata]\n" + "\n".join(self.scene)
        notices = list(self.notices)
        if self.held_timeout_notice and status not in (
            TurnStatus.COMPLETED,
            TurnStatus.STOPPED_BY_USER,
        ):
            notices.append("timeout")  # the outer tier posts a held timeout notice last
        return PredictedEnding(
            status=status,
            reason=self.reason,
            final_text=final_text,
            undelivered_text=dropped,
            iterations=len(self.passes),
            tool_dispatches=self.dispatches,
            delivered=tuple(
                ("expression", d.expression) if d.expression is not None else ("text", d.text or "")
                for d in self.confirmed
            ),
            notices=tuple(notices),
            history=tuple(self.history),
            tool_response_delivered=self.tool_response_delivered,
            finished_calls=self.finished_calls,
            taken=tuple(self.taken_messages),
            unanswered=tuple(self.held_messages),
        )


def describe_script(script: TurnScript, policy: LoopPolicy) -> str:
    """The script and the policy fields the model reads, one item a line, for failure
    messages."""
    lines = [f"policy: {_policy_text(policy)}"]
    for number, items in enumerate(script.passes, 1):
        lines.append(f"pass {number}: " + ", ".join(_item_text(item) for item in items))
    for name, plan in script.tool_plan:
        lines.append(f"tool {name}: " + ", ".join(map(_behaviour_text, plan)))
    for signal in script.signals:
        message = f" ({signal.stop_message!r})" if signal.stop_message is not None else ""
        thread = " from another thread" if signal.from_thread else ""
        lines.append(f"signal {signal.kind}{message} at {signal.at:g}{thread}")
    lines.append(
        f"channel: delay {script.delivery_delay:g}, failing delivery {script.failing_delivery}, "
        f"sends {_acts_text(script.sends)}, notices {_acts_text(script.notices)}; "
        f"allowlist {sorted(script.tools_allowed) if script.tools_allowed is not None else None}; "
        f"continuation_style {script.continuation_style}"
    )
    for config in script.tool_configs:
        lines.append(
            f"tool {config.name} registered: requires_follow_up={config.requires_follow_up}, "
            f"replay={config.replay}, timeout={config.timeout}"
        )
    if script.provider_key is not None:
        lines.append("provider holds a key: a one-model generation turn")
    if policy.drafting or policy.review_tool_calls:
        acts = ", ".join(map(_act_text, script.reviews)) or "passes everything"
        lines.append(f"reviewer: {acts}")
    return "\n".join(lines)


def _act_text(act: ReviewerAct) -> str:
    if isinstance(act, Slow):
        return f"{_act_text(act.verdict)} after {act.seconds:g}s"
    if isinstance(act, Raise):
        return f"raises {type(act.error).__name__}"
    if isinstance(act, Revise):
        return f"Revise({len(act.findings)} findings)"
    if isinstance(act, Hang):
        return "hangs"
    return type(act).__name__ + (f"({act.reason!r})" if hasattr(act, "reason") else "")


def _acts_text(acts: Sequence[ChannelAct]) -> str:
    return "[" + ", ".join(act.value for act in acts) + "]" if acts else "confirm"


def _policy_text(policy: LoopPolicy) -> str:
    names: tuple[str, ...] = (
        "max_function_call_iterations",
        "soft_warn_iteration",
        "max_consecutive_tool_errors",
        "continuation_tool_failure_threshold",
        "inactivity_timeout",
        "first_token_timeout",
        "abandoned_stream_settle",
        "tool_timeout",
        "delivery_flush_chars",
        "max_pass_duration",
        "host_call_timeout",
        "cancel_grace",
    )
    if policy.max_identical_calls != LoopPolicy().max_identical_calls:
        names += ("max_identical_calls",)
    if policy.max_tool_calls is not None or policy.at_ceiling != "end":
        names += ("max_tool_calls", "at_ceiling")
    if policy.budget is not None or policy.price is not None:
        names += ("budget", "price")
    if policy.drafting or policy.review_tool_calls:
        names += (
            "drafting",
            "review_tool_calls",
            "held_prose_max_bytes",
            "held_prose_max_segments",
            "send_message_limit",
            "max_reviews",
            "max_revisions",
            "max_tool_reviews",
            "max_tool_corrections",
            "review_timeout",
        )
    fields = [f"{name}={getattr(policy, name)!r}" for name in names]
    fields.append(f"suppress={sorted(policy.suppress_followup_after_pre_tool_text)}")
    return ", ".join(fields)


def _item_text(item: HostileItem) -> str:
    if isinstance(item, Trickle):
        count = "forever" if item.count is None else f"{item.count}x"
        return f"Trickle({item.text!r} every {item.share:g} of the inactivity budget, {count})"
    if isinstance(item, EchoKey):
        return f"EchoKey({item.style.value})"
    if isinstance(item, Pause):
        return f"Pause({item.seconds:g})"
    if isinstance(item, Fail):
        return f"Fail({item.error.kind})"
    if isinstance(item, FunctionCall):
        flags = " truncated" if item.truncated else ""
        flags += " unparseable" if item.parse_error is not None else ""
        return f"Call({item.name!r}, {item.arguments!r}{flags})"
    if isinstance(item, TextDelta):
        return f"Text({item.text!r})"
    return repr(item)


def _behaviour_text(behaviour: ToolBehaviour) -> str:
    fields: dict[str, Any] = {
        "end_turn": behaviour.end_turn,
        "delivered": behaviour.delivered,
        "expression": behaviour.expression,
        "restart": behaviour.context_restart is not None,
    }
    shown = ", ".join(f"{k}={v!r}" for k, v in fields.items() if v)
    delay = f" after {behaviour.delay:g}s" if behaviour.delay else ""
    return f"{behaviour.action.value}{delay}" + (f" ({shown})" if shown else "")
