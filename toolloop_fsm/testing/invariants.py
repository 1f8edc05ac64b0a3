"""The invariant checker: the run invariants of docs/invariants.md as one function a test calls
per run.

`check_invariants(result, policy=…, …)` checks invariants 1–9
(docs/invariants.md §1–§9), and 11 for a drafted turn, against one finished run and
raises `InvariantViolation` (an `AssertionError`, so pytest and Hypothesis treat it as a
failed assertion) whose message starts ``invariant N:`` and says what was seen. Everything
but ``result`` and ``policy`` is optional: each extra witness (the channel, the provider, the
tool executions, the virtual time, the chunks the provider actually streamed, the tools, the
request, the keys, the log records, what was still running when the turn returned) switches
on the checks that need it.

The checker does not trust the engine's own bookkeeping where a witness exists: tool calls
are keyed here with an independent canonical form, usage is re-added from the chunks the
provider streamed, delivered text is compared with what the channel confirmed, and the
arguments on the history with what the model sent.

Every call of a pass is one tool batch (docs/behaviour.md §3.10), so the checks are the
batch's: invariant 2 bounds the dispatches by the calls emitted (and each pass's runs by its
batch); invariant 3 counts a batch's failures in emitted order and looks at the ceiling
after the whole batch; invariant 4 finds no call, by its occurrence taken in emitted order,
run twice; invariant 7 finds every call of a batch answered exactly once, in emitted order,
with the pre-tool text once, on the batch's first entry; invariant 8 counts every call of a
pass in an estimated usage.

With drafting or the tool checkpoint on (`LoopPolicy.drafting`,
`LoopPolicy.review_tool_calls`), invariant 2 also covers the review budgets (reviews,
revisions, tool reviews, corrections) and the held-prose ceiling; invariant 4 treats the
passes after a revision as a new replay scope (a revision never runs a successful call
again); invariant 6 counts each review's wait, bounded by the review timeout; invariant 7
accepts a call the checkpoint rejected (status ``review_rejected``: it never ran, and it is
no failure for invariant 3) and the pre-tool text a revision took out of the history; and
invariant 11 is drafting's promise, held until reviewed: with drafting on, nothing reaches
the channel before the reviewer was asked for the last time, nothing at all unless the held
draft was delivered (never after a stop, a follow-up or a failure), and what is delivered
after a review is the candidate the reviewer saw. ``reviews_asked`` (each time the kit's
reviewer was asked, `ReviewAsked`) switches on the checks that need it.

Invariant 1 covers whatever the host does: the result is one terminal state; host code that
ignored its cancellation, or was still running when the turn returned, is named in the
result's ``abandoned_calls``; a host signal fired from another thread did not raise.
Invariant 9 (no key, nor any 8-character run of one, in what the channel was delivered, the
result's JSON, its repr, its traces, the notices, the error message, the attached exception
or the library's log records) is checked for the ``keys`` given.

The virtual-time bound (invariant 6), with F the first-token budget, I the inactivity
budget, M the pass budget, S the abandoned-stream settle window, H the host-call budget, G
the grace given to code that ignores its cancellation and T_j the deadline of dispatch j::

    elapsed ≤ Σ_k min(P_k, F + I·(c_k + D), M)  +  Σ_j t_j  +  Σ_h w_h  +  max(I, S)

where, for each provider pass k, P_k is the longest the script lets the pass take (its
pauses and trickles: a scripted stream cannot take longer than that) and c_k the number of
chunks it streamed; D is the number of deliveries the channel confirmed (each confirmed
delivery re-arms the rolling inactivity budget). The first-token budget covers the wait for
the first chunk, after which every chunk and every confirmed delivery buys at most one more
inactivity budget, and no pass outlasts M however steadily it trickles. A tool run takes
t_j = min(T_j, its duration) when it returned or raised, T_j when it was cancelled, and
T_j + G when it ignored its cancellation (the calls of a batch run at once, so the sum
over them is a bound, not the figure). Each host call (a delivery, a notice, the stop
message) takes w_h = min(H, its duration) when it returned or raised, H when it hung, and
H + G when it ignored its cancellation. The final settle wait is bounded by the inactivity
budget (or the shorter abandoned-stream window after a timeout) and happens once per turn.
Nothing else in the loop waits. Without the host-call records of a `HostileChannel`, tool
runs count their whole deadline and host calls nothing, as the kind channel's deliveries
are covered by D.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import attrs
from attrs import define

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import REVIEW_REJECTED_STATUS
from toolloop_fsm.result import TOOL_CALL_LIMIT_STATUS
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import result_to_json
from toolloop_fsm.result import token_weight
from toolloop_fsm.result import tokens_of_weight
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.testing.channel import RecordingChannel
from toolloop_fsm.testing.hostile import HostileChannel
from toolloop_fsm.testing.hostile import HostileProvider
from toolloop_fsm.testing.hostile import leaked_runs
from toolloop_fsm.testing.scripted import Fail
from toolloop_fsm.testing.scripted import Pause
from toolloop_fsm.testing.scripted import ScriptedProvider

__all__ = [
    "InvariantViolation",
    "ReviewAsked",
    "ToolExecution",
    "call_identity",
    "check_invariants",
]

#: The inner tier's terminal states (the outer tier adds ``skipped``).
_INNER_FINAL = frozenset(s.value for s in TurnStatus if s is not TurnStatus.SKIPPED)
_ALL_FINAL = frozenset(s.value for s in TurnStatus)
#: Float slack for virtual-time comparisons (timers are float sums).
_EPSILON = 1e-6


class InvariantViolation(AssertionError):
    """A run broke one of the invariants of docs/invariants.md; ``invariant`` is its number."""

    def __init__(self, invariant: int, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"invariant {invariant}: {message}")


@define
class ToolExecution:
    """One time a tool handler actually started running (recorded by the handler itself).

    ``arguments`` are a copy taken as the handler started, before it could change them.
    ``stop_requested`` is whether the host had asked to stop at the instant the handler
    started; ``outcome`` is ``"succeeded"``, ``"failed"`` or ``"raised"`` once the handler
    returned or raised, and stays ``None`` when it was cancelled (deadline, stop) or hung.
    ``finished_at`` is when it returned or raised, ``ended_at`` when it stopped running by
    any means (``None`` while it runs); ``cancel_ignored`` says it swallowed a cancellation.
    """

    name: str
    arguments: Mapping[str, Any]
    dispatch: int
    started_at: float
    stop_requested: bool
    outcome: str | None = None
    finished_at: float | None = None
    #: the provider pass whose call this is (the handler's ``ToolContext.iteration``)
    iteration: int | None = None
    ended_at: float | None = None
    cancel_ignored: bool = False

    @property
    def label(self) -> str:
        """How the engine names this run when it abandons it."""
        return f"tool {self.name} (dispatch {self.dispatch})"


@define
class ReviewAsked:
    """One time the reviewer was asked (recorded by the kit's reviewer as it was asked).

    ``kind``: a drafted reply (``response``) or a proposed call (``tool_call``, ``call``
    naming its tool, ``correction`` when the packet said it corrects a rejected call).
    ``delivered_before``: how many deliveries the channel had confirmed at that instant;
    ``sends_before``: how many it had begun (``None`` when the channel does not say).
    ``candidate``: the text the reviewer was shown; ``reviews_done`` / ``revisions_done``:
    what the packet said the budget stood at; ``attempt`` the attempt of a generation
    turn that asked. ``ended_at`` is when the review ended by any
    means (``None`` while it runs), ``answered`` whether it returned or raised rather than
    being cancelled.
    """

    kind: ReviewKind
    at: float
    delivered_before: int
    sends_before: int | None = None
    candidate: str = ""
    call: str | None = None
    correction: bool = False
    reviews_done: int = 0
    revisions_done: int = 0
    ended_at: float | None = None
    answered: bool = False
    #: the attempt of a generation turn that asked (0 for a tool loop)
    attempt: int = 0


def call_identity(name: str, arguments: Any) -> str:
    """A call's identity for invariant 4: its name and canonical JSON arguments.

    Deliberately computed here rather than with the engine's own key function, so that a
    bug in the engine's keying cannot hide itself.
    """
    try:
        canonical = json.dumps(arguments, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        canonical = repr(arguments)
    return f"{name}\x00{canonical}"


#: A failed response for a call that never ran and counts as no tool error.
_NOT_RUN_STATUSES = (REVIEW_REJECTED_STATUS, TOOL_CALL_LIMIT_STATUS)


def _fail(invariant: int, message: str) -> None:
    raise InvariantViolation(invariant, message)


def check_invariants(
    result: GenerationTurnResult,
    *,
    policy: LoopPolicy,
    channel: RecordingChannel | None = None,
    provider: ScriptedProvider | None = None,
    executions: Sequence[ToolExecution] | None = None,
    elapsed: float | None = None,
    streamed: Sequence[Sequence[object]] | None = None,
    tools: ToolRegistry | Iterable[Tool] | None = None,
    request: TurnRequest | None = None,
    keys: Collection[str] = (),
    log_text: str = "",
    running_at_return: Sequence[str] | None = None,
    signal_errors: Sequence[BaseException] = (),
    reviews_asked: Sequence[ReviewAsked] | None = None,
) -> None:
    """Check one finished run of the tool loop (or a one-model generation turn) against
    invariants 1–9 (docs/invariants.md), and 11 when the policy turns drafting on.

    ``channel``: the `RecordingChannel` the run delivered to (invariant 5).
    ``provider``: the `ScriptedProvider` it streamed from — its ``requests`` (invariants 2
    and 7) and its scripted ``passes`` (pause totals for invariant 6).
    ``executions``: every tool handler start, in order (invariants 2 and 4).
    ``elapsed``: virtual seconds the run took (invariant 6; needs ``provider`` or
    ``streamed``).
    ``streamed``: per provider pass, the chunks the provider actually yielded (exact usage
    for invariant 8, exact pre-tool text for invariant 7, chunk counts for invariant 6).
    ``tools``: the registry (per-tool deadlines for invariant 6, registered names for 4).
    ``request``: the `TurnRequest` (the allowlist for invariant 4, the prefill for 7).
    ``keys``: API keys the turn was given, which must appear nowhere (invariant 9), and
    ``log_text`` the library's log records during the run (searched for them too).
    ``running_at_return``: host code still running when the turn returned, as the engine
    names it; each must be named in the result's ``abandoned_calls`` (invariant 1).
    ``signal_errors``: what calls to the turn's signals raised (none may: invariant 1).
    ``reviews_asked``: each time the reviewer was asked, in order (invariants 2, 6 and 11,
    for a policy with drafting or the tool checkpoint on).

    A `HostileChannel` also gives every host call with its timing (invariants 1 and 6).
    """
    registry = tools if isinstance(tools, ToolRegistry) or tools is None else ToolRegistry(tools)
    _check_terminal(result)
    _check_returned(result, channel, executions, running_at_return, signal_errors)
    _check_ceilings(result, policy, provider, executions, streamed)
    reviewed = policy.drafting or policy.review_tool_calls
    if reviewed:
        _check_review_budgets(result, policy, provider, request, reviews_asked)
    _check_error_runs(result, policy)
    if executions is not None:
        # a tool's change to its arguments reaching the history is §7's, though it would
        # also make the run look unanswered to §4's count: §7 is asked first
        _check_arguments_as_sent(result, streamed, executions)
        _check_tool_runs(executions, registry, request, result, policy)
    _check_deliveries(result, channel)
    if elapsed is not None:
        _check_time(
            result,
            policy,
            elapsed,
            provider,
            streamed,
            executions,
            registry,
            channel,
            reviews_asked,
        )
    _check_history(result, provider, streamed, request, executions, policy)
    _check_usage(result, provider, streamed)
    if keys:
        _check_secrecy(result, channel, keys, log_text)
    if policy.drafting:
        _check_held_until_reviewed(result, policy, channel, reviews_asked)


# --------------------------------------------------------------------------- 1
def _check_terminal(result: GenerationTurnResult) -> None:
    status = result.status
    if not isinstance(status, TurnStatus):
        _fail(1, f"status {status!r} is not a TurnStatus")
    if status.value not in _INNER_FINAL:
        _fail(
            1,
            f"the inner tier ended with status {status.value!r}, which only the outer "
            "tier may produce",
        )
    trace = result.trace
    if not trace:
        _fail(1, "the result carries an empty trace")
    if trace[0].state != "ready":
        _fail(1, f"the trace starts in {trace[0].state!r}, not 'ready'")
    for index in range(1, len(trace)):
        if trace[index].state != trace[index - 1].next_state:
            _fail(1, f"the trace jumps at step {index}: {trace[index - 1]} then {trace[index]}")
    terminal = [i for i, step in enumerate(trace) if step.next_state in _ALL_FINAL]
    if terminal != [len(trace) - 1]:
        steps = "; ".join(
            f"#{i} {trace[i].state} --{trace[i].event}--> {trace[i].next_state}" for i in terminal
        )
        _fail(
            1,
            f"expected exactly one terminal step, the last of {len(trace)}; got "
            f"{len(terminal)}: {steps or 'none'}",
        )
    if trace[-1].next_state != status.value:
        _fail(1, f"the trace ends in {trace[-1].next_state!r} but the status is {status.value!r}")


def _check_returned(
    result: GenerationTurnResult,
    channel: RecordingChannel | None,
    executions: Sequence[ToolExecution] | None,
    running_at_return: Sequence[str] | None,
    signal_errors: Sequence[BaseException],
) -> None:
    """Whatever the host did, the turn returned a usable result and named what it left."""
    for err in signal_errors:
        _fail(
            1,
            f"a host signal raised {type(err).__name__}: {err} (the turn's signals must "
            "be safe to call from any thread)",
        )
    if result.retry_after is not None and not math.isfinite(result.retry_after):
        _fail(
            1,
            f"the result's retry_after is {result.retry_after!r}: a retry hint must be a "
            "finite number of seconds or none",
        )
    # an engine without the field names nothing: every straggler is then reported missing
    abandoned: tuple[str, ...] = tuple(getattr(result, "abandoned_calls", ()))
    ignored = [e.label for e in executions or () if e.cancel_ignored]
    if isinstance(channel, HostileChannel):
        ignored += [call.label for call in channel.calls if call.cancel_ignored]
    for label in ignored:
        if label not in abandoned:
            _fail(
                1,
                f"{label} ignored its cancellation, yet the result's abandoned_calls "
                f"{list(abandoned)} do not name it (status {result.status.value}, reason "
                f"{result.reason})",
            )
    named = list(abandoned)
    for label in running_at_return or ():
        if label not in named:
            _fail(
                1,
                f"{label} was still running when the turn returned, yet the result's "
                f"abandoned_calls {list(abandoned)} do not name it",
            )
        named.remove(label)


# --------------------------------------------------------------------------- 2
def _check_ceilings(
    result: GenerationTurnResult,
    policy: LoopPolicy,
    provider: ScriptedProvider | None,
    executions: Sequence[ToolExecution] | None,
    streamed: Sequence[Sequence[object]] | None = None,
) -> None:
    ceiling = policy.max_function_call_iterations
    if result.iterations > ceiling:
        _fail(2, f"{result.iterations} provider passes, above the ceiling of {ceiling}")
    emitted = _calls_emitted(result, provider, streamed)
    if emitted is not None and result.tool_dispatches > sum(emitted):
        _fail(
            2,
            f"{result.tool_dispatches} tool dispatches, but the provider emitted only "
            f"{sum(emitted)} calls in {result.iterations} passes",
        )
    if len(result.stream_results) > result.iterations:
        _fail(2, f"{len(result.stream_results)} stream results for {result.iterations} passes")
    _check_tool_call_limit(result, policy)
    _check_answer_at_ceiling(result, policy)
    _check_budget(result, policy, provider)
    if provider is not None:
        requests = len(provider.requests)
        # The last pass may be cancelled (stop, host error) before its reader ever asked the
        # provider; no earlier one can be, and the provider never sees an uncounted pass.
        if requests > result.iterations or requests < result.iterations - 1:
            _fail(
                2,
                f"the provider was asked {requests} times but the result counts "
                f"{result.iterations} passes",
            )
    if executions is not None:
        if len(executions) > result.tool_dispatches:
            _fail(
                2, f"{len(executions)} tool executions but only {result.tool_dispatches} dispatches"
            )
        dispatches = [e.dispatch for e in executions]
        if len(set(dispatches)) != len(dispatches):
            _fail(2, f"one dispatch ran a tool more than once: dispatch numbers {dispatches}")
        if emitted is not None:
            _check_runs_within_batches(executions, emitted)


def _check_tool_call_limit(result: GenerationTurnResult, policy: LoopPolicy) -> None:
    """No more dispatches than ``max_tool_calls``; a call refused by the limit, and the
    endings the limit names, only once the turn dispatched that many (docs/behaviour.md
    §3.12: a call admitted within the limit always dispatches — a refused or reused one
    takes none of it)."""
    limit = policy.max_tool_calls
    refused = sum(e.response.status == TOOL_CALL_LIMIT_STATUS for e in result.history)
    named = result.reason in ("tool_call_limit", "answered_at_tool_call_limit")
    if limit is None:
        if refused or named:
            _fail(2, f"the turn has no tool-call limit, yet {_limit_sign(refused, result)}")
        return
    if result.tool_dispatches > limit:
        _fail(2, f"{result.tool_dispatches} tool dispatches, above max_tool_calls={limit}")
    if (refused or named) and result.tool_dispatches < limit:
        _fail(
            2,
            f"only {result.tool_dispatches} of max_tool_calls={limit} dispatched, yet "
            f"{_limit_sign(refused, result)}",
        )


def _limit_sign(refused: int, result: GenerationTurnResult) -> str:
    if refused:
        return f"{refused} calls were refused for the tool-call limit"
    return f"it ended {result.status.value} ({result.reason})"


def _check_budget(
    result: GenerationTurnResult, policy: LoopPolicy, provider: ScriptedProvider | None
) -> None:
    """docs/behaviour.md §2.8: a budget ending only under a budget, naming a ceiling the
    policy set at the figure it set; and no pass asked for more output than the output and
    total ceilings left it after what the ledger held before it (nor started without a
    token to write)."""
    budget = policy.budget
    exceeded = result.budget_exceeded
    ended = result.reason in ("token_budget", "cost_budget")
    if budget is None:
        if ended or exceeded is not None:
            _fail(2, f"the policy has no budget, yet the turn ended {result.reason}")
        return
    if ended != (exceeded is not None):
        _fail(2, f"the turn ended {result.reason} with budget_exceeded={exceeded!r}")
    if exceeded is not None:
        allowed = getattr(budget, exceeded.limit)
        reason = "cost_budget" if exceeded.limit == "cost" else "token_budget"
        if exceeded.scope != "turn" or allowed != exceeded.allowed or reason != result.reason:
            _fail(2, f"{exceeded!r} is not a ceiling of {budget!r} ending {result.reason}")
    if provider is None:
        return
    for number, request in enumerate(provider.requests, start=1):
        before = [e for e in result.usage.entries if e.iteration < number]
        written = sum(e.output_tokens for e in before)
        lefts: list[int] = []
        if budget.output_tokens is not None:
            lefts.append(budget.output_tokens - written)
        if budget.total_tokens is not None:
            lefts.append(budget.total_tokens - written - sum(e.input_tokens for e in before))
        if lefts and (request.max_output is None or request.max_output > min(lefts)):
            _fail(
                2,
                f"pass {number} asked for max_output={request.max_output} with "
                f"{min(lefts)} tokens left of {budget!r}",
            )
        if request.max_output is not None and request.max_output < 1:
            _fail(2, f"pass {number} started with no token to write (max_output=0)")


def _check_answer_at_ceiling(result: GenerationTurnResult, policy: LoopPolicy) -> None:
    """An answer at the iteration ceiling (docs/behaviour.md §2.1) only with
    ``at_ceiling="answer"``, on the pass the ceiling allows last."""
    if result.reason != "answered_at_iteration_ceiling":
        return
    ceiling = policy.max_function_call_iterations
    if policy.at_ceiling != "answer" or result.iterations != ceiling:
        _fail(
            2,
            f"the turn answered at the iteration ceiling on pass {result.iterations} of "
            f"{ceiling}, with at_ceiling={policy.at_ceiling!r}: only the last pass of "
            'at_ceiling="answer" is the final answer pass',
        )


def _calls_emitted(
    result: GenerationTurnResult,
    provider: ScriptedProvider | None,
    streamed: Sequence[Sequence[object]] | None,
) -> list[int] | None:
    """How many calls each pass of the turn emitted (its tool batch), from what the
    provider yielded, else from its script; ``None`` when neither is known."""
    passes: Sequence[Sequence[object]] | None = streamed
    if passes is None and provider is not None:
        passes = provider.passes
    if passes is None:
        return None
    return [
        sum(isinstance(chunk, FunctionCall) for chunk in passes[k]) if k < len(passes) else 0
        for k in range(result.iterations)
    ]


def _check_runs_within_batches(executions: Sequence[ToolExecution], emitted: Sequence[int]) -> None:
    """A pass runs at most the calls of its batch (docs/behaviour.md §3.10 rule 1)."""
    runs: dict[int, int] = {}
    for execution in executions:
        if execution.iteration is not None:
            runs[execution.iteration] = runs.get(execution.iteration, 0) + 1
    for iteration, count in sorted(runs.items()):
        calls = emitted[iteration - 1] if 0 < iteration <= len(emitted) else 0
        if count > calls:
            _fail(2, f"pass {iteration} ran {count} tools, but its batch held {calls} calls")


def _check_review_budgets(
    result: GenerationTurnResult,
    policy: LoopPolicy,
    provider: ScriptedProvider | None,
    request: TurnRequest | None,
    reviews_asked: Sequence[ReviewAsked] | None,
) -> None:
    """The review budgets of drafting and the tool checkpoint: at most ``max_reviews``
    reviews of a reply, ``max_revisions`` revisions, ``max_tool_reviews`` reviews of a call
    and ``max_tool_corrections`` corrections shown to the reviewer, whether counted from
    the result's review records, the trace, what the reviewer was asked or what the
    provider was sent (each revision adds one user instruction holding the draft)."""
    records = result.reviews
    replies = [r for r in records if r.kind is ReviewKind.RESPONSE]
    calls = [r for r in records if r.kind is ReviewKind.TOOL_CALL]
    asked = list(reviews_asked or ())
    asked_replies = [a for a in asked if a.kind is ReviewKind.RESPONSE]
    asked_calls = [a for a in asked if a.kind is ReviewKind.TOOL_CALL]
    revisions = sum(1 for step in _loop_trace(result) if step.next_state == "revising")
    counts = (
        ("reviews of a reply recorded", len(replies), policy.max_reviews, "max_reviews"),
        ("reviews of a reply asked", len(asked_replies), policy.max_reviews, "max_reviews"),
        ("revisions", revisions, policy.max_revisions, "max_revisions"),
        ("reviews of a call recorded", len(calls), policy.max_tool_reviews, "max_tool_reviews"),
        ("reviews of a call asked", len(asked_calls), policy.max_tool_reviews, "max_tool_reviews"),
        (
            "corrections shown to the reviewer",
            sum(1 for a in asked_calls if a.correction),
            policy.max_tool_corrections,
            "max_tool_corrections",
        ),
    )
    for what, count, ceiling, name in counts:
        if count > ceiling:
            _fail(
                2,
                f"{count} {what}, above {name}={ceiling} (status "
                f"{result.status.value}, reason {result.reason})",
            )
    revised = sum(1 for r in replies if r.verdict == "revise")
    if revisions > revised:
        _fail(2, f"{revisions} revisions but only {revised} reviews asked for one")
    for index, reply in enumerate(asked_replies):
        if reply.reviews_done != index:
            _fail(
                2,
                f"the reviewer was told {reply.reviews_done} reviews of the reply were done "
                f"when it was asked for review {index + 1}",
            )
    if provider is None or not provider.requests or request is None:
        return
    given = sum(1 for m in request.context if m.get("role") == "user")
    added = [m for m in provider.requests[-1].context if m.get("role") == "user"][given:]
    # the messages the turn took in while it ran (§8.5) are the host's, not instructions
    for taken in result.taken_messages:
        if taken.iteration >= len(provider.requests):
            continue  # the pass it joined opened, but its request never reached the provider
        match = next((m for m in added if m.get("content") == taken.text), None)
        if match is None:
            _fail(2, f"the turn took the {taken.mode} message {taken.text!r}, never sent")
        else:
            added.remove(match)
    if len(added) > revisions:
        _fail(
            2,
            f"the provider was sent {len(added)} user messages the turn added, but it made "
            f"{revisions} revisions (one instruction each)",
        )
    candidates = [a.candidate for a in asked_replies]
    for message in added:
        content = message.get("content")
        if reviews_asked is not None and not any(
            isinstance(content, str) and c in content for c in candidates
        ):
            _fail(
                2,
                "a revision's instruction to the model does not hold any draft the reviewer "
                "was shown",
            )


# --------------------------------------------------------------------------- 3
def _check_error_runs(result: GenerationTurnResult, policy: LoopPolicy) -> None:
    """Replay the recorded tool batches in order: each step out of ``checking_tool_outcome``
    answers one batch, whose entries are the history's entries of that pass
    (docs/behaviour.md §3.10 rule 4). Its outcomes count in emitted order: each failure
    adds one to the run, each success resets it. A batch that restarts the context resets
    the run (§5 rule 3) whatever its other calls did.

    A call the tool checkpoint rejected (status ``review_rejected``) neither counts nor
    resets the run. A batch that leaves the run at the ceiling or above must end the loop at
    once (the very next step leaves for ``building_result``, nothing more is recorded) with
    status ``error``. One relabelling is accepted, and only when the trace shows it: a stop
    that arrives while the ended turn waits for deliveries in flight
    (``settling --stop_requested-->``) makes it ``stopped_by_user``, so that no outer tier
    retries a turn the user stopped.
    """
    ceiling = policy.max_consecutive_tool_errors
    trace = _loop_trace(result)
    history = result.history
    recorded = 0
    run = 0
    iteration = 0
    for index, step in enumerate(trace):
        if step.state == "starting_pass" and step.next_state == "awaiting_first_token":
            iteration += 1
        if step.state != "checking_tool_outcome":
            continue
        if step.next_state not in ("restarting_context", "recording_tool_outcome"):
            continue
        batch: list[ToolHistoryEntry] = []
        while recorded < len(history) and history[recorded].iteration == iteration:
            batch.append(history[recorded])
            recorded += 1
        if step.next_state == "restarting_context":
            run = 0
            continue
        if not batch:
            _fail(
                7,
                f"the trace records the tool batch of pass {iteration}, but the history "
                "holds no entry for it",
            )
        for entry in batch:
            if entry.response.status in _NOT_RUN_STATUSES:
                continue  # the checkpoint's rejection, the limit's refusal: no failure
            run = 0 if entry.response.success else run + 1
        if run >= ceiling:
            _check_ceiling_ends_turn(result, trace, index, run, recorded)
    _check_history_matches_run(result, recorded, run, ceiling)


def _check_history_matches_run(
    result: GenerationTurnResult, recorded: int, run: int, ceiling: int
) -> None:
    """Once the trace is replayed: the history holds every outcome it recorded, and a turn
    that ended for consecutive tool errors ended on a run at the ceiling or above it (a
    batch's failures all count before the ceiling is looked at)."""
    if recorded != len(result.history):
        _fail(
            7,
            f"the history holds {len(result.history)} entries but the trace records "
            f"{recorded} tool outcomes",
        )
    if result.reason == "consecutive_tool_errors" and run < ceiling:
        _fail(
            3, f"the turn ended for consecutive tool errors after a run of {run}, below {ceiling}"
        )


def _check_ceiling_ends_turn(
    result: GenerationTurnResult,
    trace: Sequence[TraceStep],
    index: int,
    run: int,
    recorded: int,
) -> None:
    """The run of failures recorded at ``trace[index]`` reached the ceiling (or passed it,
    within one batch): the very next
    step leaves for ``building_result`` with nothing more recorded, and the turn ends
    ``error`` (or ``stopped_by_user`` when a stop arrived while it settled)."""
    after = trace[index + 1] if index + 1 < len(trace) else None
    stopped_while_settling = any(
        s.state == "settling" and s.event == "stop_requested" for s in trace[index:]
    )
    ended = (
        after is not None
        and after.state == "recording_tool_outcome"
        and after.next_state == "building_result"
        and recorded == len(result.history)
    )
    status_ok = result.status is TurnStatus.ERROR or (
        result.status is TurnStatus.STOPPED_BY_USER and stopped_while_settling
    )
    if not (ended and status_ok):
        _fail(
            3,
            f"{run} tool failures in a row (at or above the ceiling) at history entry "
            f"{recorded}, but the turn went on to "
            f"{after.next_state if after else 'nothing'} and ended "
            f"{result.status.value} ({result.reason}) with "
            f"{len(result.history)} entries",
        )


# --------------------------------------------------------------------------- 4
def _check_tool_runs(
    executions: Sequence[ToolExecution],
    registry: ToolRegistry | None,
    request: TurnRequest | None,
    result: GenerationTurnResult,
    policy: LoopPolicy | None = None,
) -> None:
    """No tool after a stop; only registered, allowed tools; no call (by occurrence)
    run twice because the engine replayed it; and no identity of a tool that is not
    ``repeatable`` taking more than ``max_identical_calls`` occurrences in a scope (the
    repeated-call guard, docs/behaviour.md §3.11: a refused repeat takes none).

    Replay is by occurrence: the passes after a context restart, or after a revision of a
    drafted reply, form a new scope, and the n-th identical call of a scope matches the
    n-th identical call recorded before it, taken in emitted order across the calls of each
    tool batch (docs/behaviour.md §3.10 rule 6). A call that runs at occurrence n although
    the n-th recorded one succeeded was replayed into a second run (unless its tool is
    marked ``replay="rerun"``); a call reused at occurrence n although nothing succeeded
    there was never run at all. A deliberate repeat inside one scope is a new occurrence
    and runs, and so is an identical call later in the same batch.
    """
    for execution in executions:
        _check_run_allowed(execution, registry, request)
    if any(execution.iteration is None for execution in executions):
        return  # without the pass of each run, occurrences cannot be told apart
    limit = policy.max_identical_calls if policy is not None else None
    _check_no_replay(result, _runs_by_pass(executions), registry, limit)


def _check_run_allowed(
    execution: ToolExecution, registry: ToolRegistry | None, request: TurnRequest | None
) -> None:
    """The run started before any stop, of a registered tool the turn allows."""
    if execution.stop_requested:
        _fail(
            4,
            f"tool {execution.name!r} (dispatch {execution.dispatch}) started at "
            f"t={execution.started_at:g} after a stop was requested",
        )
    if registry is not None and registry.get(execution.name) is None:
        _fail(4, f"unregistered tool {execution.name!r} ran")
    allowed = request.tools_allowed if request is not None else None
    if allowed is not None and execution.name not in allowed:
        _fail(4, f"tool {execution.name!r} ran although the turn allows only {sorted(allowed)}")


def _runs_by_pass(
    executions: Sequence[ToolExecution],
) -> dict[int, dict[str, list[ToolExecution]]]:
    """The runs of each pass by call identity, in the order they started (every run knows
    its pass)."""
    ran: dict[int, dict[str, list[ToolExecution]]] = {}
    for execution in executions:
        assert execution.iteration is not None
        identity = call_identity(execution.name, execution.arguments)
        ran.setdefault(execution.iteration, {}).setdefault(identity, []).append(execution)
    return ran


def _check_no_replay(
    result: GenerationTurnResult,
    ran: Mapping[int, Mapping[str, Sequence[ToolExecution]]],
    registry: ToolRegistry | None,
    identical_limit: int | None = None,
) -> None:
    """Occurrence by occurrence in each scope (see `_check_tool_runs`). In each pass, the
    calls of one identity take the scope's next occurrences in emitted order: a rejected
    call takes none, nor does a call of a tool the gate refused (no call of that identity
    ran in the pass and every one failed). Of the occurrences taken, those that succeeded
    earlier in the turn are reused and the others run (every one, for a tool that reruns):
    the pass's runs of the identity must be exactly those, and a rejected call never runs.
    A pass whose batch was not recorded whole (a restarting call has no entry; a stop or a
    failure cut the last batch short) may hold runs without entries: each took the next
    occurrence, which must not have succeeded before — unless the gate reused it (the pass's
    trace names each call it reused, `call_already_recorded`, and a reused call of a batch
    cut short has no entry either): a run steps over at most that many succeeded
    occurrences."""
    scope_of = _scope_of_each_pass(result)
    restarted = _restarted_passes(result)
    reused_left = Counter(_passes_before(result, "next_call", guard="call_already_recorded"))
    refused = _refused_at_gate(result)
    recorded: dict[str, list[bool]] = {}  # by identity: did the n-th occurrence succeed
    seen: dict[tuple[int, str], int] = {}
    by_pass: dict[int, dict[str, list[ToolHistoryEntry]]] = {}
    for entry in result.history:
        identity = call_identity(entry.call.name, entry.call.arguments)
        by_pass.setdefault(entry.iteration, {}).setdefault(identity, []).append(entry)
    for iteration in sorted({*by_pass, *ran}):
        incomplete = iteration in restarted or iteration == result.iterations
        scope = scope_of.get(iteration, 0)
        entries_of = by_pass.get(iteration, {})
        runs_of = ran.get(iteration, {})
        for identity in dict.fromkeys([*entries_of, *runs_of]):
            entries = entries_of.get(identity, [])
            runs = list(runs_of.get(identity, ()))
            answered = [e for e in entries if e.response.status not in _NOT_RUN_STATUSES]
            refused_here = refused.get(iteration, frozenset())
            taking = _occurrence_takers(
                [e for e in answered if e.position not in refused_here], runs
            )
            name = entries[0].call.name if entries else runs[0].name
            arguments = entries[0].call.arguments if entries else runs[0].arguments
            where = f"call {name}({_short(arguments)}) in pass {iteration}"
            rejected = len(answered) < len(entries)
            if rejected and len(runs) > len(answered) and not incomplete:
                _fail(
                    4,
                    f"the checkpoint rejected {name!r} in pass {iteration} (or the tool-call "
                    f"limit refused it), yet it ran (dispatch {runs[-1].dispatch}): a "
                    "rejected or limited call never runs",
                )
            if not runs and not any(e.response.success for e in taking):
                continue  # refused by the gate (or a failure handed back): no occurrence
            tool = registry.get(name) if registry is not None else None
            rerun = tool is not None and tool.replay == "rerun"
            first = seen.get((scope, identity), 0)
            outcomes = recorded.setdefault(identity, [])
            reused = [_reusable(outcomes, first + k, rerun) for k in range(len(taking))]
            expected = reused.count(False)
            extra = len(runs) - expected
            if extra > 0 and not incomplete:
                _fail(
                    4,
                    f"{where} ran {len(runs)} times (dispatches "
                    f"{[r.dispatch for r in runs]}), but only {expected} of its occurrences "
                    f"{first + 1}..{first + len(taking)} had not already succeeded: a "
                    "succeeded occurrence must be reused",
                )
            if extra < 0 and any(
                e.response.success for e, r in zip(taking, reused, strict=True) if not r
            ):
                _fail(
                    4,
                    f"{where} was reused at an occurrence among {first + 1}.."
                    f"{first + len(taking)} that never succeeded",
                )
            taken = [e.response.success for e in taking]
            if incomplete and extra > 0:
                # a restarting call has no entry, yet took its occurrence in emitted order:
                # the occurrences that ran took the runs' outcomes in dispatch order (the
                # calls of a batch start in emitted order), whichever of them has an entry
                by_dispatch = sorted(runs, key=lambda run: run.dispatch)
                ran_outcomes = iter([run.outcome == "succeeded" for run in by_dispatch])
                taken = [
                    True if r else next(ran_outcomes, t) for t, r in zip(taken, reused, strict=True)
                ]
            else:
                ran_outcomes = iter(run.outcome == "succeeded" for run in runs[expected:])
            for _ in range(max(0, extra)):  # runs the history does not answer
                occurrence = first + len(taken)
                while reused_left[iteration] and _reusable(outcomes, occurrence, rerun):
                    reused_left[iteration] -= 1  # the gate reused it: no entry, no run
                    reused.append(True)
                    taken.append(True)
                    occurrence += 1
                if _reusable(outcomes, occurrence, rerun):
                    _fail(
                        4,
                        f"{where} ran again at occurrence {occurrence + 1}, which had "
                        "already succeeded and had to be reused",
                    )
                reused.append(False)
                taken.append(next(ran_outcomes, False))
            seen[(scope, identity)] = first + len(taken)
            repeatable = tool is not None and tool.repeatable
            taken_count = first + len(taken)
            if identical_limit is not None and not repeatable and taken_count > identical_limit:
                _fail(
                    4,
                    f"{where} took occurrence {taken_count} of its identity, past "
                    f"max_identical_calls={identical_limit}: a repeat past the allowance is "
                    "refused, never run or reused (docs/behaviour.md §3.11)",
                )
            for k, (success, was_reused) in enumerate(zip(taken, reused, strict=True)):
                if was_reused:
                    continue
                if first + k < len(outcomes):
                    outcomes[first + k] = success
                else:
                    outcomes.extend([False] * (first + k - len(outcomes)))
                    outcomes.append(success)


def _occurrence_takers(
    answered: Sequence[ToolHistoryEntry], runs: Sequence[ToolExecution]
) -> list[ToolHistoryEntry]:
    """The entries of one identity in one pass that took an occurrence, in emitted order:
    every success (a run or a reuse), and as many failures as runs failed — a failure
    that did not run was refused by the gate (a truncated call is recorded without its
    arguments, so it may share a run's identity) and takes none."""
    failed_runs = sum(run.outcome != "succeeded" for run in runs)
    taking: list[ToolHistoryEntry] = []
    for entry in answered:
        if entry.response.success:
            taking.append(entry)
        elif failed_runs > 0:
            failed_runs -= 1
            taking.append(entry)
    return taking


#: The gate's refusals (docs/behaviour.md §2.4): the call is answered with a failure and
#: takes no occurrence (an unparseable or truncated call is recorded without its arguments,
#: so it may share the identity of calls that ran).
GATE_REFUSALS = frozenset(
    {
        "call_arguments_not_object",
        "call_arguments_truncated",
        "call_arguments_unparseable",
        "call_outside_allowlist",
        "call_rejected_before",
        "correction_cannot_be_approved",
        "call_repeats_too_often",
    }
)


def _refused_at_gate(result: GenerationTurnResult) -> dict[int, frozenset[int]]:
    """By pass, the batch positions of the calls the gate refused: each call leaves the
    gate once, in emitted order, by the guard that decided it."""
    iteration = 0
    gated: dict[int, int] = {}
    refused: dict[int, set[int]] = {}
    for step in _loop_trace(result):
        if step.state == "starting_pass" and step.next_state == "awaiting_first_token":
            iteration += 1
        elif step.state == "gating_call":
            position = gated.get(iteration, 0)
            gated[iteration] = position + 1
            if step.guard in GATE_REFUSALS:
                refused.setdefault(iteration, set()).add(position)
    return {iteration: frozenset(positions) for iteration, positions in refused.items()}


def _reusable(outcomes: Sequence[bool], occurrence: int, rerun: bool) -> bool:
    """The occurrence (counted from 0) succeeded earlier in the turn, and its tool does not
    rerun: it must be reused."""
    return not rerun and occurrence < len(outcomes) and outcomes[occurrence]


def _restarted_passes(result: GenerationTurnResult) -> frozenset[int]:
    """The passes whose batch restarted the context (its restarting calls have no entry)."""
    return frozenset(_passes_before(result, "restarting_context"))


def _passes_before(
    result: GenerationTurnResult, state: str, *, guard: str | None = None
) -> list[int]:
    """The number of the pass each entry into ``state`` (by ``guard``, when given) followed,
    in order."""
    iteration = 0
    passes: list[int] = []
    for step in _loop_trace(result):
        if step.state == "starting_pass" and step.next_state == "awaiting_first_token":
            iteration += 1
        elif step.next_state == state and (guard is None or step.guard == guard):
            passes.append(iteration)
    return passes


def _loop_trace(result: GenerationTurnResult) -> tuple[TraceStep, ...]:
    """The tool loop's own steps: the result's trace, or, for a generation turn, its
    attempts' traces one after the other."""
    if result.attempts:
        return tuple(step for attempt in result.attempts for step in attempt.trace)
    return result.trace


def _scope_of_each_pass(result: GenerationTurnResult) -> dict[int, int]:
    """Each provider pass's replay scope: a context restart opens a new one, and so does
    the revision of a drafted reply (the model writes the reply again, and a successful
    call it repeats is reused, never run again)."""
    scope_of: dict[int, int] = {}
    iteration = scope = 0
    for step in _loop_trace(result):
        if step.next_state in ("restarting_context", "revising"):
            scope += 1
        elif step.state == "starting_pass" and step.next_state == "awaiting_first_token":
            iteration += 1
            scope_of[iteration] = scope
    return scope_of


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- 5
def _check_deliveries(result: GenerationTurnResult, channel: RecordingChannel | None) -> None:
    seqs = [d.seq for d in result.delivered]
    if seqs != sorted(set(seqs)):
        _fail(5, f"the result's deliveries are not in a strict order: seqs {seqs}")
    expressions = [d.expression for d in result.delivered if d.expression is not None]
    if len(expressions) > 1:
        _fail(
            5, f"{len(expressions)} expressions delivered in one turn (at most one): {expressions}"
        )
    if channel is None:
        return
    seen = [(d.text, d.expression) for d in channel.delivered]
    claimed = [(d.text, d.expression) for d in result.delivered]
    if seen == claimed:
        return
    for index, (got, kept) in enumerate(zip(seen, claimed, strict=False)):
        if got != kept:
            _fail(
                5,
                f"delivery #{index}: the channel recorded {got!r} but the result has "
                f"{kept!r} (status {result.status.value})",
            )
    if len(seen) > len(claimed):
        _fail(
            5,
            f"the channel recorded {len(seen)} deliveries but the result keeps only "
            f"{len(claimed)}; lost: {seen[len(claimed) :]!r} (status "
            f"{result.status.value}, reason {result.reason})",
        )
    _fail(
        5,
        f"the result claims {len(claimed)} deliveries the channel never recorded "
        f"({len(seen)} recorded); extra: {claimed[len(seen) :]!r}",
    )


# --------------------------------------------------------------------------- 6
def _check_time(
    result: GenerationTurnResult,
    policy: LoopPolicy,
    elapsed: float,
    provider: ScriptedProvider | None,
    streamed: Sequence[Sequence[object]] | None,
    executions: Sequence[ToolExecution] | None,
    registry: ToolRegistry | None,
    channel: RecordingChannel | None,
    reviews_asked: Sequence[ReviewAsked] | None = None,
) -> None:
    if provider is None and streamed is None:
        return  # without the chunk counts there is no finite bound to check against
    deliveries = max(len(result.delivered), len(channel.delivered) if channel else 0)
    passes_bound = _pass_waits(result, policy, provider, streamed, deliveries)
    tools_bound = _tool_waits(result, policy, executions, registry, channel)
    host_bound = _host_call_waits(policy, channel)
    reviews_bound = _review_waits(result, policy, reviews_asked)
    settle = max(policy.inactivity_timeout, policy.abandoned_stream_settle)
    bound = passes_bound + tools_bound + host_bound + reviews_bound + settle
    if elapsed > bound + _EPSILON:
        first, inactivity = policy.effective_first_token_timeout, policy.inactivity_timeout
        budget, host, grace = (
            policy.max_pass_duration,
            policy.host_call_timeout,
            policy.cancel_grace,
        )
        _fail(
            6,
            f"the run took {elapsed:g} virtual s, above the bound {bound:g} s "
            f"(passes {passes_bound:g} + tools {tools_bound:g} + host calls "
            f"{host_bound:g} + reviews {reviews_bound:g} + settle {settle:g}; "
            f"F={first:g}, I={inactivity:g}, "
            f"M={budget:g}, H={host:g}, G={grace:g}, {result.iterations} passes, "
            f"{result.tool_dispatches} dispatches, {deliveries} deliveries; status "
            f"{result.status.value}, reason {result.reason})",
        )


def _pass_waits(
    result: GenerationTurnResult,
    policy: LoopPolicy,
    provider: ScriptedProvider | None,
    streamed: Sequence[Sequence[object]] | None,
    deliveries: int,
) -> float:
    """How long the turn may have spent in its passes: each one its script's pauses, at
    most its first-token and inactivity budgets over the chunks and deliveries, at most the
    pass budget."""
    first = policy.effective_first_token_timeout
    inactivity = policy.inactivity_timeout
    bound = 0.0
    for k in range(result.iterations):
        pauses = math.inf
        if isinstance(provider, HostileProvider):
            pauses = provider.pause_total(k)
        elif provider is not None:
            pauses = _pause_total(provider.passes[k] if k < len(provider.passes) else ())
        if streamed is not None and k < len(streamed):
            chunks = len(streamed[k])
        elif provider is not None and k < len(provider.passes):
            chunks = sum(1 for item in provider.passes[k] if not isinstance(item, Pause | Fail))
        else:
            chunks = 0
        bound += min(pauses, first + inactivity * (chunks + deliveries), policy.max_pass_duration)
    return bound


def _tool_waits(
    result: GenerationTurnResult,
    policy: LoopPolicy,
    executions: Sequence[ToolExecution] | None,
    registry: ToolRegistry | None,
    channel: RecordingChannel | None,
) -> float:
    """How long the turn may have waited for its tools: each run until its deadline (and the
    grace, when it ignored its cancellation), or until it finished, when the channel's
    timings are known; every dispatch not seen run, the longest deadline."""
    timeouts = [policy.tool_timeout]
    if registry is not None:
        timeouts.extend(t.timeout for t in registry if t.timeout is not None)
    worst_tool = max(timeouts)

    def deadline_of(name: str) -> float:
        tool = registry.get(name) if registry is not None else None
        if tool is None:
            return worst_tool
        return tool.timeout if tool.timeout is not None else policy.tool_timeout

    timed = isinstance(channel, HostileChannel)  # every host call's timing is known
    runs = list(executions) if executions is not None else []
    bound = 0.0
    for run in runs:
        deadline = deadline_of(run.name)
        if run.cancel_ignored:
            bound += deadline + policy.cancel_grace
        elif timed and run.finished_at is not None:
            bound += min(deadline, run.finished_at - run.started_at)
        else:
            bound += deadline
    return bound + max(0, result.tool_dispatches - len(runs)) * worst_tool


def _host_call_waits(policy: LoopPolicy, channel: RecordingChannel | None) -> float:
    """How long the turn may have waited for a hostile channel's calls (each one until it
    ended, bounded by the host call timeout, and the grace when it ignored its
    cancellation); no bound of their own for another channel."""
    host = policy.host_call_timeout
    bound = 0.0
    if isinstance(channel, HostileChannel):
        for call in channel.calls:
            if call.cancel_ignored:
                bound += host + policy.cancel_grace
            elif call.finished_at is not None and call.outcome in ("confirmed", "raised"):
                bound += min(host, call.finished_at - call.started_at)
            else:
                bound += host
    return bound


def _review_waits(
    result: GenerationTurnResult, policy: LoopPolicy, reviews_asked: Sequence[ReviewAsked] | None
) -> float:
    """How long the turn may have waited for its reviewer: each review asked, until it
    ended, bounded by the review timeout. Without the witness, the timeout for every review
    the result records and for one more that a stop or a failure may have cancelled."""
    if not (policy.drafting or policy.review_tool_calls):
        return 0.0
    timeout = policy.review_timeout
    if reviews_asked is None:
        return (len(result.reviews) + 1) * timeout
    return sum(
        timeout if asked.ended_at is None else min(timeout, asked.ended_at - asked.at)
        for asked in reviews_asked
    )


def _pause_total(script: Sequence[object]) -> float:
    total = 0.0
    for item in script:
        if isinstance(item, Fail):
            break
        if isinstance(item, Pause):
            total += item.seconds
    return total


# --------------------------------------------------------------------------- 7
def _check_history(
    result: GenerationTurnResult,
    provider: ScriptedProvider | None,
    streamed: Sequence[Sequence[object]] | None,
    request: TurnRequest | None,
    executions: Sequence[ToolExecution] | None = None,
    policy: LoopPolicy | None = None,
) -> None:
    failed_statuses: tuple[str, ...] = ("tool_execution_failed",)
    if policy is not None and policy.review_tool_calls:
        failed_statuses += (REVIEW_REJECTED_STATUS,)
    if policy is not None and policy.max_tool_calls is not None:
        failed_statuses += (TOOL_CALL_LIMIT_STATUS,)
    revised = _revised_passes(result) if policy is not None and policy.drafting else ()
    erased = max(revised, default=0)
    _check_entries(
        result.history, "the result's history", result, streamed, failed_statuses, erased
    )
    if executions is None:
        _check_arguments_as_sent(result, streamed, executions)
    if provider is None:
        return
    for index, sent in enumerate(provider.requests):
        # the request for pass index + 1 follows the revisions made after passes up to index
        before = max((r for r in revised if r <= index), default=0)
        _check_request(index, sent, result, streamed, request, failed_statuses, before, erased)


def _revised_passes(result: GenerationTurnResult) -> tuple[int, ...]:
    """The pass after whose review each revision was made: a revision takes the pre-tool
    text of every pass up to it out of the history (the model's own words before its draft
    was sent back)."""
    return tuple(_passes_before(result, "revising"))


def _without_erased_text(
    history: Sequence[ToolHistoryEntry], erased: int
) -> tuple[ToolHistoryEntry, ...]:
    return tuple(
        attrs.evolve(entry, pre_tool_text=None) if entry.iteration <= erased else entry
        for entry in history
    )


def _check_request(
    index: int,
    sent: ProviderRequest,
    result: GenerationTurnResult,
    streamed: Sequence[Sequence[object]] | None,
    request: TurnRequest | None,
    failed_statuses: tuple[str, ...] = ("tool_execution_failed",),
    erased_before: int = 0,
    erased: int = 0,
) -> None:
    """``erased_before``: the passes whose pre-tool text a revision had taken out when this
    request was sent; ``erased``: those it took out by the end of the turn."""
    history = tuple(sent.history)
    where = f"request {index + 1}"
    # the entries a held message moved into the context before it (§8.5 rule 4): one tool
    # message each beyond those the request's own context held
    given = sum(1 for m in request.context if m.get("role") == "tool") if request else 0
    moved = sum(1 for m in sent.context if m.get("role") == "tool") - given
    prefix = tuple(result.history[moved : moved + len(history)])
    if erased:  # a revision took the model's own words out: compare without them
        same = _without_erased_text(history, erased) == _without_erased_text(prefix, erased)
    else:
        same = history == prefix
    if not same:
        _fail(
            7,
            f"{where}'s history is not a prefix of the turn's history (after the {moved} "
            "entries its context holds; an entry was rewritten, dropped or reordered)",
        )
    for entry in history:
        if entry.iteration > index:
            _fail(
                7,
                f"{where} carries an entry from pass {entry.iteration}, which had not happened yet",
            )
    _check_entries(history, where, result, streamed, failed_statuses, erased_before)
    if index == 0 and request is not None and sent.prefill != request.prefill:
        _fail(
            7,
            f"the first request's prefill is {sent.prefill!r}, not the turn's {request.prefill!r}",
        )
    prefill = sent.prefill or ""
    for entry in history:
        text = entry.pre_tool_text
        if text and prefill and text in prefill:
            _fail(
                7,
                f"{where} repeats the pre-tool text {text!r} of pass {entry.iteration} in "
                f"its prefill {prefill!r}",
            )


def _check_entries(
    history: Sequence[ToolHistoryEntry],
    where: str,
    result: GenerationTurnResult,
    streamed: Sequence[Sequence[object]] | None,
    failed_statuses: tuple[str, ...] = ("tool_execution_failed",),
    erased: int = 0,
) -> None:
    """Each entry is well formed. ``failed_statuses``: what a failed response may say it
    is — with the tool checkpoint on, a call its reviewer rejected (``review_rejected``);
    with a tool-call limit, a call the limit refused (``tool_call_limit``). ``erased``: the
    passes up to this one had their pre-tool text taken out by a revision (it may be
    none)."""
    ids: dict[str, int] = {}
    last: dict[int, int] = {}  # by pass: the position of its batch's last entry so far
    for index, entry in enumerate(history):
        label = f"{where}, entry {index} ({entry.call.name!r}, pass {entry.iteration})"
        _check_entry_form(entry, label, failed_statuses)
        _check_entry_answered_once(entry, index, label, ids, last)
        _check_entry_pre_tool_text(entry, label, result, streamed, erased)
    _check_batches_answered(history, where, result, streamed)


def _check_entry_form(
    entry: ToolHistoryEntry, label: str, failed_statuses: tuple[str, ...]
) -> None:
    """A named call with object arguments, a response naming the same tool, and a failure
    that says which kind it is and why."""
    call, response = entry.call, entry.response
    if not isinstance(call.name, str) or not call.name.strip():
        _fail(7, f"{label}: a call without a name")
    if not isinstance(call.arguments, Mapping):
        _fail(7, f"{label}: arguments {call.arguments!r} are not an object")
    if response.tool_name is not None and response.tool_name != call.name:
        _fail(7, f"{label}: the response names {response.tool_name!r}")
    if not response.success and (
        response.status not in failed_statuses or not (response.reason or "").strip()
    ):
        _fail(
            7,
            f"{label}: a failed response needs status "
            f"{' or '.join(map(repr, failed_statuses))} and a reason, got "
            f"{response.status!r} / {response.reason!r}",
        )


def _check_entry_answered_once(
    entry: ToolHistoryEntry,
    index: int,
    label: str,
    ids: dict[str, int],
    last: dict[int, int],
) -> None:
    """No call id answered twice; each pass's batch is one run of entries that opens at
    position 0 and whose positions rise, in emitted order (``ids`` and ``last`` gather what
    the entries before this one answered)."""
    call_id = entry.call.call_id
    if call_id is not None:
        if call_id in ids:
            _fail(7, f"{label}: call id {call_id!r} already answered at entry {ids[call_id]}")
        ids[call_id] = index
    before = last.get(entry.iteration)
    if before is None:
        if last and entry.iteration < max(last):
            _fail(7, f"{label}: its batch comes after a later pass's batch")
        if entry.position != 0:
            _fail(7, f"{label}: its batch opens at position {entry.position}, not 0")
    else:
        if entry.iteration != max(last):
            _fail(7, f"{label}: its batch is split by another pass's entries")
        if entry.position <= before:
            _fail(
                7,
                f"{label}: position {entry.position} after position {before} of its batch: "
                "a batch is answered once per call, in emitted order",
            )
    last[entry.iteration] = entry.position


def _check_batches_answered(
    history: Sequence[ToolHistoryEntry],
    where: str,
    result: GenerationTurnResult,
    streamed: Sequence[Sequence[object]] | None,
) -> None:
    """Each pass's entries answer the calls its batch emitted, in emitted order: their names
    are the emitted calls' in order, leaving out only a call that restarted the context
    (it has no entry, docs/behaviour.md §5 rule 4); in the result's history, a batch that
    did not restart is answered whole, every call once (§3.10 rule 3)."""
    if streamed is None:
        return
    restarted = _restarted_passes(result)
    by_pass: dict[int, list[str]] = {}
    for entry in history:
        by_pass.setdefault(entry.iteration, []).append(entry.call.name)
    for iteration, names in by_pass.items():
        if not 0 < iteration <= len(streamed):
            continue
        emitted = [str(c.name) for c in streamed[iteration - 1] if isinstance(c, FunctionCall)]
        remaining = iter(emitted)
        if not all(name in remaining for name in names):
            _fail(
                7,
                f"{where}: pass {iteration} answers {names}, not its batch {emitted} in "
                "emitted order",
            )
        whole = where == "the result's history" and iteration not in restarted
        if whole and len(names) != len(emitted):
            _fail(
                7,
                f"{where}: pass {iteration} answers {len(names)} of the {len(emitted)} calls "
                f"of its batch {emitted}: every call is answered once",
            )


def _check_entry_pre_tool_text(
    entry: ToolHistoryEntry,
    label: str,
    result: GenerationTurnResult,
    streamed: Sequence[Sequence[object]] | None,
    erased: int,
) -> None:
    """The pre-tool text is what the pass streamed (none for whitespace), once per batch:
    on its first entry only (docs/behaviour.md §3.10 rule 3), unless a revision took it
    out of the history."""
    text = entry.pre_tool_text
    if text is not None and not text.strip():
        _fail(7, f"{label}: whitespace-only pre-tool text {text!r} (should be none)")
    if entry.position != 0:
        if text is not None:
            _fail(7, f"{label}: pre-tool text {text!r} repeated on position {entry.position}")
        return
    expected = _pass_text(entry.iteration, result, streamed)
    if entry.iteration <= erased and text is None:
        return  # a revision took the model's words out of the history
    if expected is not None:
        wanted = expected if expected.strip() else None
        if text != wanted:
            _fail(7, f"{label}: pre-tool text {text!r}, but the pass streamed {expected!r}")


def _pass_text(
    iteration: int, result: GenerationTurnResult, streamed: Sequence[Sequence[object]] | None
) -> str | None:
    if streamed is not None and 0 < iteration <= len(streamed):
        return "".join(c.text for c in streamed[iteration - 1] if isinstance(c, TextDelta))
    for stream_result in result.stream_results:
        if stream_result.iteration == iteration:
            return stream_result.text
    return None


def _check_arguments_as_sent(
    result: GenerationTurnResult,
    streamed: Sequence[Sequence[object]] | None,
    executions: Sequence[ToolExecution] | None,
) -> None:
    """The history carries each call's arguments as the model sent them, whatever the tool
    did with the arguments it was handed. An entry is paired with the call its pass emitted
    at its position (a restarting batch, whose restarting calls have no entry, is left
    out); without the streamed chunks, a pass answered by one entry and one run pairs them."""
    restarted = _restarted_passes(result)
    sent_by_call: dict[tuple[int, int], Any] = {}
    if streamed is not None:
        for k, chunks in enumerate(streamed, start=1):
            calls = [c for c in chunks if isinstance(c, FunctionCall)]
            for position, call in enumerate(calls):
                if call.parse_error is None and not call.truncated:
                    sent_by_call[(k, position)] = (call.name, call.arguments, "the model sent")
    entries_of: dict[int, int] = {}
    for entry in result.history:
        entries_of[entry.iteration] = entries_of.get(entry.iteration, 0) + 1
    runs_of: dict[int | None, list[ToolExecution]] = {}
    for execution in executions or ():
        runs_of.setdefault(execution.iteration, []).append(execution)
    for iteration, runs in runs_of.items():
        key = (iteration or 0, 0)
        if len(runs) == 1 and entries_of.get(iteration or 0) == 1 and key not in sent_by_call:
            sent_by_call[key] = (runs[0].name, runs[0].arguments, "the tool was handed")
    for entry in result.history:
        if entry.iteration in restarted:
            continue
        sent = sent_by_call.get((entry.iteration, entry.position))
        if sent is None or sent[0] != entry.call.name or not isinstance(sent[1], Mapping):
            continue
        if entry.call.arguments != sent[1]:
            _fail(
                7,
                f"the history holds {entry.call.name}({_short(entry.call.arguments)}) for "
                f"pass {entry.iteration}, but {sent[2]} {_short(sent[1])}: a tool's "
                "change to its arguments reached the history",
            )


# --------------------------------------------------------------------------- 8
def _check_usage(
    result: GenerationTurnResult,
    provider: ScriptedProvider | None,
    streamed: Sequence[Sequence[object]] | None,
) -> None:
    by_pass: dict[int, list[Any]] = {}
    for entry in result.usage.entries:
        # a reviewer's verdict carries its own usage, entered beside the pass it followed
        if entry.source == "author":
            by_pass.setdefault(entry.iteration, []).append(entry)
    _check_ledger_entries(result, by_pass)
    passes: Sequence[Sequence[object]] | None = streamed
    if passes is None and provider is not None:
        passes = provider.passes
    if passes is None:
        return
    for k in range(result.iterations):
        _check_pass_usage(
            k + 1,
            passes[k] if k < len(passes) else (),
            by_pass.get(k + 1, []),
            result,
            exact=streamed is not None,
        )
    total_in = sum(e.input_tokens for e in result.usage.entries)
    if total_in != result.usage.input_tokens:
        _fail(8, "the ledger's input total is not the sum of its entries")


def _check_ledger_entries(result: GenerationTurnResult, by_pass: Mapping[int, list[Any]]) -> None:
    """No more reviewer entries than reviews, whole figures, and at most one entry for each
    pass the turn made (``by_pass``: the model's own entries, by pass)."""
    reviews = len(result.reviews)
    asked = sum(1 for e in result.usage.entries if e.source != "author")
    if asked > reviews:
        _fail(8, f"{asked} reviewer usage entries for {reviews} reviews")
    for entry in result.usage.entries:
        for label, value in (("input", entry.input_tokens), ("output", entry.output_tokens)):
            if not _whole(value):
                _fail(
                    8,
                    f"pass {entry.iteration}'s ledger entry holds {value!r} {label} tokens: "
                    "a usage figure is a whole number of at least 0",
                )
    for iteration, entries in by_pass.items():
        if len(entries) > 1:
            _fail(8, f"pass {iteration} has {len(entries)} ledger entries")
        if not 1 <= iteration <= result.iterations:
            _fail(8, f"a ledger entry for pass {iteration}, of {result.iterations} passes")


def _check_pass_usage(
    iteration: int,
    chunks: Sequence[object],
    entries: Sequence[Any],
    result: GenerationTurnResult,
    *,
    exact: bool,
) -> None:
    """The pass's ledger entry is what its provider reported (``exact``: the chunks are the
    ones it streamed), a running total of the reports, or, without any, an estimate."""
    reported = [c for c in chunks if isinstance(c, UsageReport)]
    reports = [r for r in reported if _whole(r.input_tokens) and _whole(r.output_tokens)]
    folds = _usage_folds(reports)
    got = (
        (entries[0].input_tokens, entries[0].output_tokens, entries[0].estimated)
        if entries
        else None
    )
    if not reported:
        _check_estimate(iteration, chunks, got, result, exact=exact)
        return
    if len(reports) < len(reported):
        # a report that is no usage figure (NaN, infinite) may end the pass as a
        # protocol failure: the ledger then holds a running total of the good ones, or
        # an estimate when none was taken
        if got is not None and got not in folds and not _marked_estimate(got, chunks):
            _fail(
                8,
                f"pass {iteration}: ledger entry {got} is no running total of the "
                f"well-formed reports among {_usage_text(reported)}",
            )
    elif exact:
        want = folds[-1] if folds else None
        if got != want:
            _fail(
                8,
                f"pass {iteration}: the provider reported {_usage_text(reports)} "
                f"(total {want}) but the ledger holds {got} (status "
                f"{result.status.value}, reason {result.reason})",
            )
    elif got is not None and got not in folds and not _marked_estimate(got, chunks):
        # (the pass may have ended before its first report: then it is estimated)
        _fail(
            8,
            f"pass {iteration}: ledger entry {got} is no running total of the scripted "
            f"reports {_usage_text(reports)}",
        )


# how a pass can end once its stream ended normally: every chunk it streamed was taken
_STREAM_ENDINGS = frozenset({"completed", "function_call", "empty_response"})


def _check_estimate(
    iteration: int,
    chunks: Sequence[object],
    got: tuple[int, int, bool] | None,
    result: GenerationTurnResult,
    *,
    exact: bool,
) -> None:
    """A pass the provider reported no usage for: when it was answered (any chunk), its
    entry is a marked estimate whose output is at most the estimate (`estimate_tokens`) of
    what it streamed — text, thoughts and every call of its batch (name and compact JSON
    arguments) — and exactly that when every chunk streamed was taken; never answered, it
    has no entry."""
    bound = tokens_of_weight(_written_weight(chunks))
    if got is not None:
        if not got[2]:
            _fail(
                8,
                f"pass {iteration}: the provider reported no usage, but the ledger holds "
                f"{got} without marking it estimated",
            )
        if got[1] > bound:
            _fail(
                8,
                f"pass {iteration}: the estimated output {got[1]} exceeds the {bound} "
                "tokens estimated of what the pass streamed",
            )
    if not exact:
        return
    ended = [r.outcome for r in result.stream_results if r.iteration == iteration]
    if not (chunks and ended and ended[0] in _STREAM_ENDINGS):
        return
    if got is None:
        _fail(
            8,
            f"pass {iteration}: the provider answered without a usage report, but the "
            "ledger holds no estimate for it",
        )
    elif got[1] != bound:
        _fail(
            8,
            f"pass {iteration}: the estimated output is {got[1]} tokens, but what the "
            f"pass streamed is estimated at {bound} tokens",
        )


def _marked_estimate(got: tuple[int, int, bool], chunks: Sequence[object]) -> bool:
    return got[2] and got[1] <= tokens_of_weight(_written_weight(chunks))


def _written_weight(chunks: Sequence[object]) -> int:
    written = 0
    for chunk in chunks:
        if isinstance(chunk, TextDelta | ThoughtDelta) and isinstance(chunk.text, str):
            written += token_weight(chunk.text)
        elif isinstance(chunk, FunctionCall):
            try:
                arguments = json.dumps(
                    chunk.arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False
                )
            except (TypeError, ValueError):
                arguments = repr(chunk.arguments)
            written += token_weight(f"{chunk.name}:{arguments}")
    return written


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _usage_folds(reports: Sequence[UsageReport]) -> list[tuple[int, int, bool]]:
    """The pass's running usage after each report: a cumulative report replaces the running
    figure, an incremental one adds to it."""
    folds: list[tuple[int, int, bool]] = []
    current: tuple[int, int, bool] | None = None
    for report in reports:
        if report.cumulative or current is None:
            current = (report.input_tokens, report.output_tokens, report.estimated)
        else:
            current = (
                current[0] + report.input_tokens,
                current[1] + report.output_tokens,
                current[2] or report.estimated,
            )
        folds.append(current)
    return folds


def _usage_text(reports: Sequence[UsageReport]) -> str:
    if not reports:
        return "nothing"
    return ", ".join(
        f"{r.input_tokens}/{r.output_tokens}{'' if r.cumulative else '+'}" for r in reports
    )


# --------------------------------------------------------------------------- 11
#: The steps that deliver the held draft: completing a reply without a review, or a review
#: that ended (a verdict, or the review timeout).
_DELIVERING = frozenset(
    {
        ("completing_response", "advance"),
        ("reviewing_draft", "review_returned"),
        ("reviewing_draft", "review_deadline"),
    }
)
_SCENE_BLOCK = "\n\n[Scene Metadata]\n"


def _answers_after(step: TraceStep) -> bool:
    """The step by which a turn that would have ended goes on to answer held messages."""
    return step.state == "building_result" and step.guard == "held_messages_wait_for_answer"


def _check_held_until_reviewed(
    result: GenerationTurnResult,
    policy: LoopPolicy,
    channel: RecordingChannel | None,
    reviews_asked: Sequence[ReviewAsked] | None,
) -> None:
    """Drafting: the turn's prose and expressions are held and reach the channel only as
    the held draft, delivered once the reviewer passed it, could give no verdict, or the
    budget was spent — never before the reviewer was asked for the last time, never after a
    stop or a follow-up; what is delivered after a review is what the reviewer saw; and it
    fits the held-prose ceiling."""
    delivered = [(d.text, d.expression) for d in result.delivered]
    if channel is not None:
        delivered = delivered or [(d.text, d.expression) for d in channel.delivered]
    ending = f"status {result.status.value}, reason {result.reason}"
    steps = [
        step
        for step in _loop_trace(result)
        if (step.state, step.event) in _DELIVERING and step.next_state == "building_result"
    ]
    if result.taken_messages and any(_answers_after(step) for step in _loop_trace(result)):
        # it delivered a reply, then answered messages held meanwhile (§8.5 rule 3) with
        # another, reviewed on its own: these checks read a turn of one reply
        return
    _check_nothing_shown_unreviewed(result, delivered, steps, reviews_asked, ending)
    texts = "".join(text for text, _ in delivered if text is not None)
    replies = [a for a in reviews_asked or () if a.kind is ReviewKind.RESPONSE]
    after_review = bool(steps) and steps[-1].state == "reviewing_draft"
    if after_review and replies and not replies[-1].candidate.startswith(texts):
        _fail(
            11,
            f"the reviewer last saw {replies[-1].candidate!r}, but {texts!r} was delivered "
            f"({ending})",
        )
    _check_held_prose_ceiling(policy, delivered, replies, texts, after_review, ending)
    if steps and result.status is TurnStatus.COMPLETED and channel is not None:
        _check_final_text_is_draft(result, channel)


def _check_nothing_shown_unreviewed(
    result: GenerationTurnResult,
    delivered: Sequence[tuple[str | None, object]],
    steps: Sequence[TraceStep],
    reviews_asked: Sequence[ReviewAsked] | None,
    ending: str,
) -> None:
    """Deliveries only as the held draft (``steps``: the loop's delivering steps), never
    after a stop or a follow-up, and nothing on the channel before a review is asked."""
    if delivered and not steps:
        _fail(
            11,
            f"{len(delivered)} deliveries reached the channel, but the turn never delivered "
            f"its held draft ({ending}): drafting holds everything until it is reviewed",
        )
    if delivered and result.status in (TurnStatus.STOPPED_BY_USER, TurnStatus.FOLLOW_UP_INTERRUPT):
        _fail(
            11,
            f"{len(delivered)} held deliveries reached the channel although the turn "
            f"ended {result.status.value}",
        )
    for asked in reviews_asked or ():
        if asked.delivered_before or asked.sends_before:
            _fail(
                11,
                f"the reviewer was asked about a {asked.kind.value} at t={asked.at:g} after "
                f"the channel had confirmed {asked.delivered_before} and begun "
                f"{asked.sends_before} deliveries: something held was shown before its review",
            )


def _check_held_prose_ceiling(
    policy: LoopPolicy,
    delivered: Sequence[tuple[str | None, object]],
    replies: Sequence[ReviewAsked],
    texts: str,
    after_review: bool,
    ending: str,
) -> None:
    """The drafts the reviewer saw and the one delivered fit the held-prose ceiling, in
    bytes and in segments."""
    limit = policy.held_prose_max_bytes
    if policy.send_message_limit is not None:
        limit = min(limit, policy.send_message_limit)
    held = sum(len(a.candidate.encode("utf-8")) for a in replies)
    if not after_review:
        held += len(texts.encode("utf-8"))
    if held > limit:
        _fail(
            2,
            f"{held} bytes of prose were held in the turn (the drafts the reviewer saw and "
            f"the one delivered), above the held-prose ceiling of {limit} bytes ({ending})",
        )
    if len(delivered) > policy.held_prose_max_segments:
        _fail(
            2,
            f"{len(delivered)} held segments delivered, above held_prose_max_segments="
            f"{policy.held_prose_max_segments}",
        )


def _check_final_text_is_draft(result: GenerationTurnResult, channel: RecordingChannel) -> None:
    """A completed drafted turn's final text is the draft it delivered."""
    final = result.final_text.partition(_SCENE_BLOCK)[0]
    shown = channel.delivered_text + (result.undelivered_text or "")
    if final != shown:
        _fail(
            11,
            f"a completed drafted turn's final text is {final!r}, but the draft it "
            f"delivered is {shown!r} (confirmed, then still in flight)",
        )


# --------------------------------------------------------------------------- 9
def _check_secrecy(
    result: GenerationTurnResult,
    channel: RecordingChannel | None,
    keys: Collection[str],
    log_text: str,
) -> None:
    try:
        as_json = result_to_json(result)
    except (TypeError, ValueError) as err:
        as_json = f"(not serialisable: {err})"
    notices: list[object] = [*result.notices, result.held_notice]
    places: dict[str, str] = {}
    if channel is not None:
        notices += channel.notices
        places["the channel's deliveries"] = repr(channel.delivered)
    places |= {
        "result_to_json(result)": as_json,
        "repr(result)": repr(result),
        "the traces": repr(result.trace) + repr([a.trace for a in result.attempts]),
        "the notices": repr(notices),
        "the error message": result.error_message or "",
        "the log records": log_text,
    }
    if result.exception is not None:
        places["the result's exception"] = f"{result.exception!r} {result.exception}"
    found = leaked_runs(keys, places)
    if found:
        # the message never quotes the key: it would leak from the test report itself
        _fail(
            9,
            f"an API key, or an 8-character run of one, appears in {', '.join(found)} "
            f"(status {result.status.value}, reason {result.reason})",
        )
