"""The chain invariant checker: `check_chain_invariants(run)` raises `ChainInvariantViolation`
naming what broke."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from collections.abc import Collection

from toolloop_fsm.generation import FINAL_STATES
from toolloop_fsm.result import AttemptRecord
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import result_to_json
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.testing.chains.harness import ChainRun
from toolloop_fsm.testing.chains.script import chain_budget
from toolloop_fsm.testing.invariants import call_identity

# --------------------------------------------------------------------------- the checker
#: The names `check_chain_invariants` reports (and accepts in ``skip``), in check order.
CHAIN_INVARIANTS: tuple[str, ...] = (
    "terminal",
    "key_secrecy",
    "attempt_budget",
    "tool_once",
    "delivered",
    "retry_only_after_failure",
    "no_fallback_notice_while_pending",
    "failures_listed",
    "continuation",
    "unreachable_skips",
    "stop_message_queued",
    "review_budgets",
    "held_until_reviewed",
)
#: The chain invariants of drafting and the tool checkpoint (no-ops for a policy with
#: neither on).
REVIEW_CHAIN_INVARIANTS: tuple[str, ...] = ("review_budgets", "held_until_reviewed")


class ChainInvariantViolation(AssertionError):
    """A generation turn broke a chain invariant; ``invariant`` is its name (one of
    `CHAIN_INVARIANTS`) and the message says what was seen."""

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"chain invariant {invariant!r}: {message}")


def _fail(invariant: str, message: str) -> None:
    raise ChainInvariantViolation(invariant, message)


def _masked(key: str) -> str:
    return key[:11] + "…"


def check_chain_invariants(run: ChainRun, *, skip: Collection[str] = ()) -> None:
    """Check one finished chain run; raises `ChainInvariantViolation` for the first broken
    invariant (see `CHAIN_INVARIANTS`; names in ``skip`` are not checked).

    * ``terminal``: the turn returned a result; the outer trace starts in ``ready``, is
      contiguous, reaches exactly one final state (`FINAL_STATES`), last, and the status
      is that state.
    * ``key_secrecy``: no key in what the channel was delivered, the JSON result,
      ``repr(result)``, the notices, the outer
      and inner traces, the error message, the attached exception, anything raised, the
      admission requests, the superseded marks or the library's log records.
    * ``attempt_budget``: attempts ≤ `chain_budget`; per model at most
      ``min(keys, max_key_attempts_per_model)`` keys are used, each at most once, never one
      that was cooling or retired in the key book.
    * ``tool_once``: no tool call (canonical key) executes twice in the turn.
    * ``delivered``: what the channel recorded is exactly ``result.delivered``, in order
      (texts and expressions), and at most one expression was delivered.
    * ``retry_only_after_failure``: only ``error`` / ``timeout`` attempts are followed by
      another; a final status is the turn's status.
    * ``no_fallback_notice_while_pending``: no ``fallback_used`` notice after a stop or a
      follow-up arrived, at most one per turn, and one exactly when a completed turn
      followed failures with no signal pending.
    * ``failures_listed``: ``attempt_failures`` lists every superseded attempt and, when the
      chain was exhausted, every failed attempt.
    * ``continuation``: each attempt's first request carries what the channel had been
      delivered so far as its prefill, and the verbatim scaffolding exactly when its model
      writes tool calls in text.
    * ``unreachable_skips``: an unreachable report or delivery ends the turn ``skipped``,
      and no attempt asks its provider after the report.
    * ``stop_message_queued``: a turn stopped by a stop that carried a message queues that
      message at the front of the channel, once, and keeps it in ``stop_message``.
    * ``review_budgets`` (drafting, the tool checkpoint): the review budgets are the turn's,
      shared by its attempts — at most ``max_reviews`` reviews of a reply, ``max_revisions``
      revisions, ``max_tool_reviews`` reviews of a call and ``max_tool_corrections``
      corrections in the whole turn, and each packet tells the reviewer how many reviews
      of a reply the turn (not the attempt) has had.
    * ``held_until_reviewed`` (drafting): nothing an attempt held is delivered unless that
      attempt delivered its held draft: an attempt that failed delivered nothing, the
      reviewer is never asked after anything reached the channel, and a stopped or
      interrupted turn delivered nothing.
    """
    unknown = set(skip) - set(CHAIN_INVARIANTS)
    if unknown:
        raise ValueError(f"unknown chain invariants in skip: {sorted(unknown)}")
    if "key_secrecy" not in skip:
        _check_key_secrecy(run)
    result = run.result
    if result is None:
        if "terminal" not in skip:
            _fail("terminal", f"the turn raised instead of returning a result: {run.raised!r}")
        return
    for name, check in _CHECKS:
        if name not in skip:
            check(run, result)


def _records(result: GenerationTurnResult) -> tuple[AttemptRecord, ...]:
    return result.attempts


def _check_terminal(run: ChainRun, result: GenerationTurnResult) -> None:
    if not isinstance(result.status, TurnStatus):
        _fail("terminal", f"status {result.status!r} is not a TurnStatus")
    trace = result.trace
    if not trace or trace[0].state != "ready":
        _fail("terminal", f"the outer trace does not start in 'ready': {trace[:1]}")
    for index in range(1, len(trace)):
        if trace[index].state != trace[index - 1].next_state:
            _fail(
                "terminal",
                f"the outer trace jumps at step {index}: {trace[index - 1]} then {trace[index]}",
            )
    finals = [i for i, step in enumerate(trace) if step.next_state in FINAL_STATES]
    if finals != [len(trace) - 1]:
        _fail(
            "terminal",
            f"expected exactly one final step, the last of {len(trace)}; final steps at {finals}",
        )
    if trace[-1].next_state != result.status.value:
        _fail(
            "terminal",
            f"the outer trace ends in {trace[-1].next_state!r} but the status "
            f"is {result.status.value!r}",
        )
    machine_steps = tuple(s for s in trace if s.event != "attempt_superseded")
    if machine_steps != run.outer_steps:
        _fail("terminal", "the result's trace differs from the steps reported to on_step")


def _check_key_secrecy(run: ChainRun) -> None:
    result = run.result
    places: dict[str, str] = {
        "the channel's deliveries": repr(run.channel.delivered),
        "the notices": repr(run.channel.notices),
        "the superseded marks": repr(run.channel.superseded),
        "the admission requests": repr(run.admission_requests),
        "the log records": run.log_text,
    }
    if run.raised is not None:
        places["the raised exception"] = f"{run.raised!r} {run.raised}"
    if result is not None:
        places["result_to_json(result)"] = result_to_json(result)
        places["repr(result)"] = repr(result)
        places["the trace"] = repr(result.trace) + repr([a.trace for a in result.attempts])
        places["the error message"] = result.error_message or ""
        if result.exception is not None:
            places["the result's exception"] = f"{result.exception!r} {result.exception}"
    for key in run.script.keys:
        found = [where for where, text in places.items() if key in text]
        if found:
            _fail("key_secrecy", f"key {_masked(key)} appears in {', '.join(found)}")


def _check_attempt_budget(run: ChainRun, result: GenerationTurnResult) -> None:
    script = run.script
    budget = chain_budget(script, run.policy)
    started = sum(1 for step in result.trace if step.next_state == "attempting")
    if started > budget:
        _fail("attempt_budget", f"{started} attempts for a chain budget of {budget}")
    if len(result.attempts) > started:
        _fail(
            "attempt_budget",
            f"{len(result.attempts)} attempt records but only {started} attempts started",
        )
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    per_model = run.policy.max_key_attempts_per_model
    for index, model in enumerate(models):
        used = [use.key_index for use in run.key_uses if use.model == index]
        limit = min(len(model.keys), per_model)
        if len(used) > limit:
            _fail(
                "attempt_budget",
                f"model {model.label} used {len(used)} keys {used}, above "
                f"min(keys={len(model.keys)}, max_key_attempts={per_model})",
            )
        if len(set(used)) != len(used):
            _fail("attempt_budget", f"model {model.label} used a key twice: {used}")
        for key_index in used:
            health = run.key_book_before.get((model.label, key_index))
            if health is not None and not health.usable_at(0.0):
                _fail(
                    "attempt_budget",
                    f"model {model.label} used key #{key_index}, which was "
                    f"{'retired' if health.retired else 'cooling'}",
                )


def _check_tool_once(run: ChainRun, result: GenerationTurnResult) -> None:
    """No call runs twice because the turn replayed it: the n-th identical call of an
    attempt reuses the n-th one an earlier attempt completed; a deliberate repeat inside one
    attempt (an occurrence no earlier attempt reached) runs."""
    models = {m.label: m for m in run.script.models}
    if run.script.shared is not None:
        models.update({m.label: m for m in run.script.shared.models})
    recorded: dict[str, int] = {}  # occurrences completed by earlier attempts
    for record in result.attempts:
        model = models.get(record.label)
        if model is None:
            continue
        steps = [
            call_identity(s.tool, s.arguments)
            for s in model.attempt_for(record.key_index).tool_steps
        ]
        reached = 0
        for execution in (e for e in run.executions if e.attempt == record.index):
            occurrence = steps[: execution.iteration].count(execution.key)
            if occurrence <= recorded.get(execution.key, 0):
                _fail(
                    "tool_once",
                    f"{execution.name}({json.dumps(execution.arguments, sort_keys=True)}) "
                    f"ran again at t={execution.at:g} "
                    f"in attempt {execution.attempt} (pass {execution.iteration}); occurrence "
                    f"{occurrence} of it was already completed by an earlier attempt",
                )
            if execution.finished:
                reached = max(reached, execution.iteration)
        for key in set(steps[:reached]):
            recorded[key] = max(recorded.get(key, 0), steps[:reached].count(key))


def _check_delivered(run: ChainRun, result: GenerationTurnResult) -> None:
    seen = [(d.text, d.expression) for d in run.channel.delivered]
    kept = [(d.text, d.expression) for d in result.delivered]
    if seen != kept:
        _fail(
            "delivered",
            f"the channel recorded {seen!r} but the result keeps {kept!r} "
            f"(status {result.status.value}, reason {result.reason})",
        )
    if result.delivered_text != run.channel.delivered_text:
        _fail(
            "delivered",
            f"delivered_text {result.delivered_text!r} != the channel's "
            f"{run.channel.delivered_text!r}",
        )
    expressions = run.channel.expressions
    if len(expressions) > 1:
        _fail("delivered", f"{len(expressions)} expressions delivered in one turn: {expressions}")


_RETRYABLE_STATUSES = (TurnStatus.ERROR, TurnStatus.TIMEOUT)


def _check_retries(run: ChainRun, result: GenerationTurnResult) -> None:
    records = _records(result)
    for record, following in itertools.pairwise(records):
        if record.status not in _RETRYABLE_STATUSES:
            _fail(
                "retry_only_after_failure",
                f"attempt {record.index} ({record.label}) ended {record.status.value} and "
                f"attempt {following.index} ({following.label}) followed it",
            )
    for record in records:
        if record.superseded and record.status not in _RETRYABLE_STATUSES:
            _fail(
                "retry_only_after_failure",
                f"attempt {record.index} ended {record.status.value} but was superseded",
            )
    if records and records[-1].status not in _RETRYABLE_STATUSES:
        last = records[-1]
        if result.status is not last.status and result.status is not TurnStatus.SKIPPED:
            _fail(
                "retry_only_after_failure",
                f"the last attempt ended {last.status.value} (final) but the turn ended "
                f"{result.status.value}",
            )


def _check_fallback_notice(run: ChainRun, result: GenerationTurnResult) -> None:
    posted = [
        i for i, e in enumerate(run.timeline) if e.kind == "notice" and e.detail == "fallback_used"
    ]
    if len(posted) > 1:
        _fail("no_fallback_notice_while_pending", f"{len(posted)} fallback_used notices")
    signalled = [
        i
        for i, e in enumerate(run.timeline)
        if e.kind == "signal" and e.detail in ("stop", "follow_up")
    ]
    if posted and signalled and signalled[0] < posted[0]:
        entry = run.timeline[signalled[0]]
        _fail(
            "no_fallback_notice_while_pending",
            f"a fallback_used notice was posted after a {entry.detail} arrived at t={entry.at:g}",
        )
    if (
        result.status is TurnStatus.COMPLETED
        and result.attempt_failures
        and not signalled
        and not posted
    ):
        _fail(
            "no_fallback_notice_while_pending",
            f"a completed turn followed {len(result.attempt_failures)} failures with no "
            "signal pending, but no fallback_used notice was posted",
        )


def _check_failures_listed(run: ChainRun, result: GenerationTurnResult) -> None:
    records = _records(result)

    def facts(label: str, status: TurnStatus, reason: str | None, key: int | None) -> str:
        return f"{label}#{key}:{status.value}({reason})"

    expected = [r for r in records if r.superseded]
    exhausted = (
        bool(records)
        and result.status in _RETRYABLE_STATUSES
        and records[-1].status is result.status
        and records[-1].reason != "host_error"
    )
    if exhausted and not records[-1].superseded:
        expected.append(records[-1])
    want = [facts(r.label, r.status, r.reason, r.key_index) for r in expected]
    got = [facts(f.label, f.status, f.reason, f.key_index) for f in result.attempt_failures]
    if got != want:
        _fail(
            "failures_listed",
            f"attempt_failures lists {got} but the failed attempts were "
            f"{want} (status {result.status.value}, reason "
            f"{result.reason}, exhausted={exhausted})",
        )


def _check_continuation(run: ChainRun, _result: GenerationTurnResult) -> None:
    script = run.script
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    verbatim = {m.label for m in models if m.tool_calling == "verbatim"}
    for first in run.first_requests:
        if first.scaffolded != (first.label in verbatim):
            _fail(
                "continuation",
                f"attempt {first.label}#{first.key_index} "
                f"({'verbatim' if first.label in verbatim else 'native'}) was sent "
                f"{'the' if first.scaffolded else 'no'} verbatim scaffolding",
            )
        want = first.delivered_before or None
        if first.prefill != want:
            _fail(
                "continuation",
                f"attempt {first.label}#{first.key_index} started with prefill "
                f"{first.prefill!r}, but the channel had been delivered "
                f"{first.delivered_before!r}",
            )


def _check_unreachable(run: ChainRun, result: GenerationTurnResult) -> None:
    reported = [e for e in run.timeline if e.kind == "signal" and e.detail == "unreachable"]
    if reported and result.status is not TurnStatus.SKIPPED:
        _fail(
            "unreachable_skips",
            f"the host reported the destination unreachable at t={reported[0].at:g}, but "
            f"the turn ended {result.status.value} ({result.reason})",
        )
    if reported:
        first = run.timeline.index(reported[0])
        later = [e for e in run.timeline[first:] if e.kind == "attempt"]
        if later:
            _fail(
                "unreachable_skips",
                f"the host reported the destination unreachable at t={reported[0].at:g}, but "
                f"attempt {later[0].detail} asked its provider afterwards (t={later[0].at:g})",
            )
    if run.channel.unreachable_raised and result.status is not TurnStatus.SKIPPED:
        _fail(
            "unreachable_skips",
            f"a delivery raised DestinationUnreachable but the turn "
            f"ended {result.status.value} ({result.reason})",
        )


def _check_stop_message(run: ChainRun, result: GenerationTurnResult) -> None:
    queued = run.channel.queued_front
    if len(queued) > 1:
        _fail("stop_message_queued", f"{len(queued)} stop messages queued: {queued}")
    if result.status is not TurnStatus.STOPPED_BY_USER:
        return
    # the first stop is the one the turn takes (later ones find it stopping already)
    stops = [e for e in run.timeline if e.kind == "signal" and e.detail == "stop"]
    message = stops[0].message if stops else None
    if message is None:
        return
    if queued != [message] or result.stop_message != message:
        _fail(
            "stop_message_queued",
            f"the turn was stopped ({result.reason}) by a stop carrying a message, but the "
            f"channel's queue front got {queued} and the result keeps {result.stop_message!r}",
        )


def _check_review_budgets(run: ChainRun, result: GenerationTurnResult) -> None:
    loop = run.policy.loop
    if not (loop.drafting or loop.review_tool_calls):
        return
    asked = run.reviews_asked
    replies = [a for a in asked if a.kind is ReviewKind.RESPONSE]
    calls = [a for a in asked if a.kind is ReviewKind.TOOL_CALL]
    traces = [attempt.trace for attempt in result.attempts]
    revisions = sum(1 for trace in traces for step in trace if step.next_state == "revising")
    counts = (
        ("reviews of a reply", len(replies), loop.max_reviews, "max_reviews"),
        ("revisions", revisions, loop.max_revisions, "max_revisions"),
        ("reviews of a call", len(calls), loop.max_tool_reviews, "max_tool_reviews"),
        (
            "corrections",
            sum(1 for a in calls if a.correction),
            loop.max_tool_corrections,
            "max_tool_corrections",
        ),
    )
    spread = sorted({a.attempt for a in asked})
    for what, count, ceiling, name in counts:
        if count > ceiling:
            _fail(
                "review_budgets",
                f"{count} {what} in one turn (attempts {spread}), above {name}={ceiling}: "
                "the budget is the turn's, not each attempt's",
            )
    for index, reply in enumerate(replies):
        if reply.reviews_done != index:
            _fail(
                "review_budgets",
                f"the reviewer was told {reply.reviews_done} reviews of the reply were done "
                f"when attempt {reply.attempt} asked for the turn's review {index + 1}",
            )
    if len(result.reviews) > len(asked):
        _fail(
            "review_budgets",
            f"the result records {len(result.reviews)} reviews, but the reviewer was asked "
            f"{len(asked)} times",
        )


#: The steps of an attempt that deliver its held draft.
_DELIVERING = frozenset(
    {
        ("completing_response", "advance"),
        ("reviewing_draft", "review_returned"),
        ("reviewing_draft", "review_deadline"),
    }
)


def _check_held_until_reviewed(run: ChainRun, result: GenerationTurnResult) -> None:
    if not run.policy.loop.drafting:
        return
    for asked in run.reviews_asked:
        if asked.delivered_before:
            _fail(
                "held_until_reviewed",
                f"attempt {asked.attempt} asked the reviewer at t={asked.at:g} after "
                f"{asked.delivered_before} deliveries had reached the channel",
            )
    delivering = [
        record.index
        for record in result.attempts
        if any(
            (step.state, step.event) in _DELIVERING and step.next_state == "building_result"
            for step in record.trace
        )
    ]
    for record in result.attempts:
        if record.delivered_text and record.index not in delivering:
            _fail(
                "held_until_reviewed",
                f"attempt {record.index} ({record.label}) ended {record.status.value} "
                f"({record.reason}) without delivering its held draft, yet "
                f"{record.delivered_text!r} reached the channel",
            )
    shown = run.channel.delivered
    if shown and not delivering:
        _fail(
            "held_until_reviewed",
            f"{len(shown)} deliveries reached the channel, but no attempt delivered a held "
            f"draft (status {result.status.value}, reason {result.reason})",
        )
    if shown and result.status in (TurnStatus.STOPPED_BY_USER, TurnStatus.FOLLOW_UP_INTERRUPT):
        _fail(
            "held_until_reviewed",
            f"{len(shown)} held deliveries reached the channel although the turn ended "
            f"{result.status.value}",
        )


_CHECKS: tuple[tuple[str, Callable[[ChainRun, GenerationTurnResult], None]], ...] = (
    ("terminal", _check_terminal),
    ("attempt_budget", _check_attempt_budget),
    ("tool_once", _check_tool_once),
    ("delivered", _check_delivered),
    ("retry_only_after_failure", _check_retries),
    ("no_fallback_notice_while_pending", _check_fallback_notice),
    ("failures_listed", _check_failures_listed),
    ("continuation", _check_continuation),
    ("unreachable_skips", _check_unreachable),
    ("stop_message_queued", _check_stop_message),
    ("review_budgets", _check_review_budgets),
    ("held_until_reviewed", _check_held_until_reviewed),
)
