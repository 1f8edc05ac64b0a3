"""`ToolLoopMachine`: the inner tool loop, declared once (`DECLARATION`).

This module is the one place to read the whole loop: the states of each stage, every
transition, the ending each exit leads to, and — by their order in `TRANSITIONS` — the order
in which guards are tried (docs/behaviour.md §2.4 and §4). Behaviour lives in `states/`,
decisions in `guards/`; every ending first passes the settle step (`building_result`,
`settling`), which waits for deliveries in flight and then takes the terminal state the
ending names.

Stream chunks are events of the streaming states, declared as internal transitions so the
diagram shows them, but run through a handler table derived from the same declaration (the
fast path) instead of a full trigger. One rule lives beside the table, in one function:
`expired_deadline` names the trigger of an expired deadline (the pass's one stream deadline
expires as the budget that ran out).

`feed` checks every event before it is taken: its fields against their declared types (a
text that is ``None``, a deadline kind given as a string), then its identity (a dispatch,
deadline token or delivery that is not the current one). A malformed or stale event, like
one the state cannot take, raises `InvalidEvent` naming the state and the event, and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from toolloop_fsm.budgets import AttemptBudget
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.declaration import State
from toolloop_fsm.declaration import Transition as _t
from toolloop_fsm.effects import Effect
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.event_checks import event_shapes
from toolloop_fsm.event_checks import malformation
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import MessageHeld
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import UsageReport
from toolloop_fsm.guards.ceilings import answers_at_iteration_ceiling
from toolloop_fsm.guards.ceilings import answers_at_tool_call_limit
from toolloop_fsm.guards.ceilings import calls_after_tool_call_limit
from toolloop_fsm.guards.ceilings import calls_at_iteration_ceiling
from toolloop_fsm.guards.ceilings import consecutive_error_ceiling_reached
from toolloop_fsm.guards.ceilings import continuation_retries_exhausted
from toolloop_fsm.guards.ceilings import cost_budget_reached
from toolloop_fsm.guards.ceilings import final_answer_pass_due
from toolloop_fsm.guards.ceilings import held_messages_wait_for_answer
from toolloop_fsm.guards.ceilings import iteration_ceiling_reached
from toolloop_fsm.guards.ceilings import pass_cut_at_cost_budget
from toolloop_fsm.guards.ceilings import pass_cut_at_token_budget
from toolloop_fsm.guards.ceilings import token_budget_reached
from toolloop_fsm.guards.deliveries import all_deliveries_recorded
from toolloop_fsm.guards.deliveries import delivery_timed_out
from toolloop_fsm.guards.deliveries import must_settle_deliveries
from toolloop_fsm.guards.drafting import call_needs_checkpoint
from toolloop_fsm.guards.drafting import call_rejected_before
from toolloop_fsm.guards.drafting import completes_held_draft
from toolloop_fsm.guards.drafting import correction_cannot_be_approved
from toolloop_fsm.guards.drafting import draft_cut_at_length_limit
from toolloop_fsm.guards.drafting import no_pending_prose
from toolloop_fsm.guards.drafting import reviewer_unavailable
from toolloop_fsm.guards.drafting import reviewing_correction
from toolloop_fsm.guards.drafting import reviews_exhausted
from toolloop_fsm.guards.drafting import revision_left
from toolloop_fsm.guards.drafting import tool_round_completes_held_draft
from toolloop_fsm.guards.drafting import verdict_passes
from toolloop_fsm.guards.drafting import verdict_revises
from toolloop_fsm.guards.drafting import verdict_unavailable
from toolloop_fsm.guards.exit_policy import is_settled_after_tool
from toolloop_fsm.guards.exit_policy import pass_has_text
from toolloop_fsm.guards.exit_policy import should_end_after_pre_tool_text
from toolloop_fsm.guards.exit_policy import tool_asked_to_end_turn
from toolloop_fsm.guards.exit_policy import tool_requested_context_restart
from toolloop_fsm.guards.outcome import outcome_is_stalled_stream
from toolloop_fsm.guards.outcome import to_decided_terminal
from toolloop_fsm.guards.tool_gate import batch_finishes
from toolloop_fsm.guards.tool_gate import batch_finishes_awaiting_approval
from toolloop_fsm.guards.tool_gate import batch_has_nameless_call
from toolloop_fsm.guards.tool_gate import call_already_recorded
from toolloop_fsm.guards.tool_gate import call_arguments_not_object
from toolloop_fsm.guards.tool_gate import call_arguments_truncated
from toolloop_fsm.guards.tool_gate import call_arguments_unparseable
from toolloop_fsm.guards.tool_gate import call_needs_approval
from toolloop_fsm.guards.tool_gate import call_outside_allowlist
from toolloop_fsm.guards.tool_gate import call_over_tool_call_limit
from toolloop_fsm.guards.tool_gate import call_pending
from toolloop_fsm.guards.tool_gate import call_repeats_too_often
from toolloop_fsm.guards.tool_gate import calls_admitted
from toolloop_fsm.guards.tool_gate import calls_await_approval
from toolloop_fsm.guards.tool_gate import calls_left_at_gate
from toolloop_fsm.guards.tool_gate import cut_off_call_is_settled
from toolloop_fsm.guards.tool_gate import resumes_paused_batch
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.ledger import LedgerEntry
from toolloop_fsm.pass_rules import STREAM_BUDGETS
from toolloop_fsm.pass_rules import phase_budget
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.runner import CompiledRunner
from toolloop_fsm.runner import DeclaredMachine
from toolloop_fsm.snapshot import LoopSnapshot
from toolloop_fsm.snapshot_capture import restore_loop
from toolloop_fsm.states.build_result import abandon_in_flight
from toolloop_fsm.states.build_result import begin_settling
from toolloop_fsm.states.build_result import build_result
from toolloop_fsm.states.build_result import complete_after_pre_tool_text
from toolloop_fsm.states.build_result import complete_end_turn
from toolloop_fsm.states.build_result import complete_retry_exhausted
from toolloop_fsm.states.build_result import end_iteration_ceiling
from toolloop_fsm.states.build_result import end_tool_error_loop
from toolloop_fsm.states.build_result import fail_delivery_during_tool
from toolloop_fsm.states.build_result import fail_delivery_while_settling
from toolloop_fsm.states.build_result import fail_delivery_while_streaming
from toolloop_fsm.states.build_result import ignore_follow_up_while_settling
from toolloop_fsm.states.build_result import kill_while_settling
from toolloop_fsm.states.build_result import settle_delivery
from toolloop_fsm.states.context_restart import apply_context_restart
from toolloop_fsm.states.delivery import armed_tokens
from toolloop_fsm.states.delivery import record_delivery
from toolloop_fsm.states.drafting import begin_revision
from toolloop_fsm.states.drafting import close_cut_pass
from toolloop_fsm.states.drafting import close_pass_for_review
from toolloop_fsm.states.drafting import deliver_held_draft
from toolloop_fsm.states.drafting import fail_delivery_during_review
from toolloop_fsm.states.drafting import interrupt_review
from toolloop_fsm.states.drafting import note_tool_round_trigger
from toolloop_fsm.states.drafting import refuse_correction
from toolloop_fsm.states.drafting import refuse_unapproved_correction
from toolloop_fsm.states.drafting import reject_call
from toolloop_fsm.states.drafting import repeat_rejection
from toolloop_fsm.states.drafting import request_call_review
from toolloop_fsm.states.drafting import request_draft_review
from toolloop_fsm.states.drafting import run_approved_call
from toolloop_fsm.states.drafting import run_unreviewed_call
from toolloop_fsm.states.drafting import stop_during_review
from toolloop_fsm.states.drafting import take_review_timeout
from toolloop_fsm.states.held_messages import answer_held_messages
from toolloop_fsm.states.held_messages import hold_message
from toolloop_fsm.states.stable_points import offer_snapshot
from toolloop_fsm.states.stable_points import resend_in_flight
from toolloop_fsm.states.stream_once import CHUNK_HANDLERS
from toolloop_fsm.states.stream_once import begin_final_answer_pass
from toolloop_fsm.states.stream_once import begin_pass
from toolloop_fsm.states.stream_once import complete_settled_after_tool
from toolloop_fsm.states.stream_once import complete_with_text
from toolloop_fsm.states.stream_once import end_at_budget
from toolloop_fsm.states.stream_once import end_calls_after_tool_call_limit
from toolloop_fsm.states.stream_once import end_calls_at_iteration_ceiling
from toolloop_fsm.states.stream_once import end_empty_response
from toolloop_fsm.states.stream_once import end_malformed_call
from toolloop_fsm.states.stream_once import end_pass_cut_at_budget
from toolloop_fsm.states.stream_once import end_stream
from toolloop_fsm.states.stream_once import fail_stream
from toolloop_fsm.states.stream_once import interrupt_for_follow_up
from toolloop_fsm.states.stream_once import stop_stream
from toolloop_fsm.states.stream_once import take_first_chunk
from toolloop_fsm.states.stream_once import time_out_stream
from toolloop_fsm.states.tool_dispatch import admit_call
from toolloop_fsm.states.tool_dispatch import announce_tool_outcome
from toolloop_fsm.states.tool_dispatch import clear_stale_follow_up
from toolloop_fsm.states.tool_dispatch import cut_off_tool
from toolloop_fsm.states.tool_dispatch import dispatch_batch
from toolloop_fsm.states.tool_dispatch import gate_next_call
from toolloop_fsm.states.tool_dispatch import hold_for_approval
from toolloop_fsm.states.tool_dispatch import open_batch
from toolloop_fsm.states.tool_dispatch import record_tool_outcome
from toolloop_fsm.states.tool_dispatch import refuse_call_over_limit
from toolloop_fsm.states.tool_dispatch import refuse_non_object_arguments
from toolloop_fsm.states.tool_dispatch import refuse_outside_allowlist
from toolloop_fsm.states.tool_dispatch import refuse_repeated_call
from toolloop_fsm.states.tool_dispatch import refuse_truncated_call
from toolloop_fsm.states.tool_dispatch import refuse_unparseable_call
from toolloop_fsm.states.tool_dispatch import reuse_recorded_outcome
from toolloop_fsm.states.tool_dispatch import running_call
from toolloop_fsm.states.tool_dispatch import stop_during_tool
from toolloop_fsm.states.tool_dispatch import take_tool_outcome
from toolloop_fsm.states.tool_dispatch import time_out_tool
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import TurnState

# --------------------------------------------------------------------------- states
#: the terminal states, one per turn status but ``skipped`` (only the outer tier skips)
FINAL_STATES: tuple[str, ...] = tuple(s.value for s in TurnStatus if s is not TurnStatus.SKIPPED)
STATES: tuple[State, ...] = (
    State("ready"),
    # the stable point: before each pass, a machine asked for snapshots offers one
    State("starting_pass", (offer_snapshot,), transient=True),
    State("awaiting_first_token"),
    State("streaming"),
    State("ending_pass", transient=True),
    # the tool batch: each call at the gate in turn, then the admitted calls run
    State("gating_call", transient=True),
    State("next_call", transient=True),
    State("executing_tool"),
    State("checking_tool_outcome", (announce_tool_outcome,), transient=True),
    State("restarting_context", (apply_context_restart,), transient=True),
    State("recording_tool_outcome", (record_tool_outcome,), transient=True),
    # drafting (`LoopPolicy.drafting`): held prose is reviewed, revised once, then delivered
    State("completing_response", transient=True),
    State("reviewing_draft"),
    State("revising", transient=True),
    # the tool checkpoint (`LoopPolicy.review_tool_calls`): a new call waits for the reviewer
    State("reviewing_call"),
    # the shared settle step: every ending waits here (bounded) for deliveries in flight
    State("settling", settle=True),
    State("building_result", transient=True, settle=True),
    *(State(name, final=True) for name in FINAL_STATES),
)

STREAM_STATES = ("awaiting_first_token", "streaming")
#: the states that wait for an event, where a steered or queued message may arrive
HOLDING_STATES = (*STREAM_STATES, "executing_tool", "reviewing_draft", "reviewing_call", "settling")
REVIEW_STATES = ("reviewing_draft", "reviewing_call")
CHUNK_TRIGGERS: dict[type, str] = {
    TextDelta: "text_delta",
    ThoughtDelta: "thought_delta",
    UsageReport: "usage_report",
    FunctionCall: "function_call",
    FinishReason: "finish_reason",
    SceneMetadata: "scene_metadata",
}

# fmt: off
TRANSITIONS: list[_t] = [
    _t("start", "ready", "starting_pass"),
    # durable turns: a fresh machine continues a snapshot's turn before its next pass, sending
    # again what was in flight (under the same sequence numbers)
    _t("resume", "ready", "next_call", when=resumes_paused_batch, do=resend_in_flight),
    _t("resume", "ready", "starting_pass", do=resend_in_flight),
    # ---- stream once: the ceiling is checked before every pass (docs/behaviour.md §2.1)
    _t("advance", "starting_pass", "building_result", when=iteration_ceiling_reached,
       do=end_iteration_ceiling, ends=("timeout", "iteration_ceiling")),
    # the budgets (§2.8): a pass that would break a token or cost ceiling does not start
    _t("advance", "starting_pass", "building_result", when=token_budget_reached,
       do=end_at_budget, ends=("timeout", "token_budget")),
    _t("advance", "starting_pass", "building_result", when=cost_budget_reached,
       do=end_at_budget, ends=("timeout", "cost_budget")),
    # the final answer pass (§3.12; §2.1 with `at_ceiling="answer"`): offered no tools
    _t("advance", "starting_pass", "awaiting_first_token", when=final_answer_pass_due,
       do=begin_final_answer_pass),
    _t("advance", "starting_pass", "awaiting_first_token", do=begin_pass),
    # the first chunk of any kind swaps the first-token budget for the inactivity budget
    *(_t(trigger, "awaiting_first_token", "streaming", do=take_first_chunk)
      for trigger in CHUNK_TRIGGERS.values()),
    # chunks while streaming: internal transitions, run by the fast path
    *(_t(trigger, "streaming", None, do=CHUNK_HANDLERS[chunk])
      for chunk, trigger in CHUNK_TRIGGERS.items()),
    # ---- the pass ends; which way is decided at `ending_pass`: the gate (docs/behaviour.md
    # §2.4 rules 1–6), the ledger, then dispatch; without a call, the text and empty-response
    # rules
    _t("stream_ended", STREAM_STATES, "ending_pass", do=end_stream),
    # a pass cut as its output reached a ceiling (§2.8): the turn ends there, its calls unrun
    _t("advance", "ending_pass", "building_result", when=pass_cut_at_token_budget,
       do=end_pass_cut_at_budget, ends=("timeout", "token_budget")),
    _t("advance", "ending_pass", "building_result", when=pass_cut_at_cost_budget,
       do=end_pass_cut_at_budget, ends=("timeout", "cost_budget")),
    # drafting: a pass cut at the held-prose ceiling completes the response as cut
    _t("advance", "ending_pass", "completing_response", when=draft_cut_at_length_limit,
       do=close_cut_pass),
    _t("advance", "ending_pass", "building_result", when=batch_has_nameless_call,
       do=end_malformed_call, ends=("error", "malformed_call")),
    # the final answer pass, offered no tools (§3.12, §2.1 `at_ceiling="answer"`): a call
    # it makes anyway runs not, and ends the turn at the ceiling that withdrew the tools
    _t("advance", "ending_pass", "building_result", when=calls_after_tool_call_limit,
       do=end_calls_after_tool_call_limit, ends=("timeout", "tool_call_limit")),
    _t("advance", "ending_pass", "building_result", when=calls_at_iteration_ceiling,
       do=end_calls_at_iteration_ceiling, ends=("timeout", "iteration_ceiling")),
    _t("advance", "ending_pass", "gating_call", when=call_pending, do=open_batch),
    # drafting: a pass without a call completes the held response
    _t("advance", "ending_pass", "completing_response",
       when=completes_held_draft, do=close_pass_for_review),
    # the final answer pass answered: completed, saying the tools were withdrawn
    _t("advance", "ending_pass", "building_result", when=answers_at_tool_call_limit,
       do=complete_with_text, ends=("completed", "answered_at_tool_call_limit")),
    _t("advance", "ending_pass", "building_result", when=answers_at_iteration_ceiling,
       do=complete_with_text, ends=("completed", "answered_at_iteration_ceiling")),
    _t("advance", "ending_pass", "building_result", when=pass_has_text,
       do=complete_with_text, ends=("completed", None)),
    _t("advance", "ending_pass", "building_result", when=is_settled_after_tool,
       do=complete_settled_after_tool, ends=("completed", "settled_after_tool")),
    _t("advance", "ending_pass", "building_result",
       do=end_empty_response, ends=("empty_response", None)),
    # ---- the pass is cut short
    _t("stream_failed", STREAM_STATES, "building_result",
       do=fail_stream, ends=("error", "provider_error")),
    # the pass's one stream deadline expires as the budget that ran out (`expired_deadline`)
    _t("first_token_deadline", "awaiting_first_token", "building_result",
       do=time_out_stream, ends=("timeout", "first_token_timeout")),
    _t("inactivity_deadline", "streaming", "building_result",
       do=time_out_stream, ends=("timeout", "inactivity_timeout")),
    _t("pass_duration_deadline", STREAM_STATES, "building_result",
       do=time_out_stream, ends=("timeout", "pass_duration_timeout")),
    _t("stop_requested", STREAM_STATES, "building_result",
       do=stop_stream, ends=("stopped_by_user", None)),
    _t("follow_up_arrived", STREAM_STATES, "building_result",
       do=interrupt_for_follow_up, ends=("follow_up_interrupt", None)),
    _t("delivery_recorded", [*STREAM_STATES, "executing_tool"], None, do=record_delivery),
    # the host's channel raised, or did not return: the turn ends `error`, no fallback
    # (docs/behaviour.md §7.3), and what is running is cancelled
    _t("delivery_failed", STREAM_STATES, "building_result", when=delivery_timed_out,
       do=fail_delivery_while_streaming, ends=("error", "host_timeout")),
    _t("delivery_failed", STREAM_STATES, "building_result",
       do=fail_delivery_while_streaming, ends=("error", "host_error")),
    # ---- the tool batch (docs/behaviour.md §3.10): each call of the pass passes the gate on
    # its own, in emitted order (§3.1–§3.5; the tool checkpoint, §14.6: a rejected call stays
    # rejected, a correction needs an approval, a new call is reviewed while reviews are
    # left); a refusal is that call's outcome and the next call goes to the gate
    _t("advance", "gating_call", "next_call",
       when=call_arguments_not_object, do=refuse_non_object_arguments),
    _t("advance", "gating_call", "next_call",
       when=call_arguments_truncated, do=refuse_truncated_call),
    _t("advance", "gating_call", "next_call",
       when=call_arguments_unparseable, do=refuse_unparseable_call),
    _t("advance", "gating_call", "next_call",
       when=call_outside_allowlist, do=refuse_outside_allowlist),
    _t("advance", "gating_call", "next_call",
       when=call_already_recorded, do=reuse_recorded_outcome),
    _t("advance", "gating_call", "next_call",
       when=call_rejected_before, do=repeat_rejection),
    _t("advance", "gating_call", "next_call",
       when=correction_cannot_be_approved, do=refuse_correction),
    # the repeated-call guard (§3.11): after the replay (a replay is no repeat) and the
    # checkpoint's standing rejections, before a review (no reviewer is asked about a call
    # that will not run)
    _t("advance", "gating_call", "next_call",
       when=call_repeats_too_often, do=refuse_repeated_call),
    # the tool-call limit (§3.12): after every refusal a call earns on its own (a refused or
    # replayed call is no new call, and a repeat is told of its earlier result), before a
    # review (no reviewer is asked about a call that will not run)
    _t("advance", "gating_call", "next_call",
       when=call_over_tool_call_limit, do=refuse_call_over_limit),
    # approval by a person (§3.13): after every refusal (no one is asked about a call that
    # would not run), before the checkpoint's review (a person's decision stands above it)
    _t("advance", "gating_call", "next_call",
       when=call_needs_approval, do=hold_for_approval),
    _t("advance", "gating_call", "reviewing_call",
       when=call_needs_checkpoint, do=request_call_review),
    _t("advance", "gating_call", "next_call", do=admit_call),
    # the whole batch is gated before any call runs; then the admitted calls run
    _t("advance", "next_call", "gating_call", when=calls_left_at_gate, do=gate_next_call),
    _t("advance", "next_call", "executing_tool", when=calls_admitted, do=dispatch_batch),
    # the calls that need no approval have run (or none ran): the turn pauses for the
    # decisions, its batch kept in the result's snapshot (§3.13)
    _t("advance", "next_call", "building_result", when=calls_await_approval,
       ends=("awaiting_approval", None)),
    _t("advance", "next_call", "checking_tool_outcome"),
    # ---- execute the batch (§3.6, §3.10 rule 2): each call under its own deadline; the
    # batch's last outcome goes on to the checks after it, the others start calls waiting
    _t("tool_finished", "executing_tool", "building_result",
       when=batch_finishes_awaiting_approval, do=take_tool_outcome,
       ends=("awaiting_approval", None)),
    _t("tool_finished", "executing_tool", "checking_tool_outcome", when=batch_finishes,
       do=take_tool_outcome),
    _t("tool_finished", "executing_tool", None, do=take_tool_outcome),
    # a tool with a reconcile hook is waited for past its deadline: its outcome is settled
    # (docs/behaviour.md §3.9)
    _t("tool_deadline", "executing_tool", None, when=cut_off_call_is_settled, do=cut_off_tool),
    _t("tool_deadline", "executing_tool", "building_result",
       when=batch_finishes_awaiting_approval, do=time_out_tool,
       ends=("awaiting_approval", None)),
    _t("tool_deadline", "executing_tool", "checking_tool_outcome", when=batch_finishes,
       do=time_out_tool),
    _t("tool_deadline", "executing_tool", None, do=time_out_tool),
    _t("stop_requested", "executing_tool", "building_result",
       do=stop_during_tool, ends=("stopped_by_user", "stopped_during_tool")),
    _t("follow_up_arrived", "executing_tool", None, do=clear_stale_follow_up),
    _t("delivery_failed", "executing_tool", "building_result", when=delivery_timed_out,
       do=fail_delivery_during_tool, ends=("error", "host_timeout")),
    _t("delivery_failed", "executing_tool", "building_result",
       do=fail_delivery_during_tool, ends=("error", "host_error")),
    # ---- after a tool call, in docs/behaviour.md §4 order (an abort arrives as stop_requested
    # above)
    _t("advance", "checking_tool_outcome", "restarting_context",
       when=tool_requested_context_restart),
    _t("advance", "checking_tool_outcome", "recording_tool_outcome"),
    _t("advance", "restarting_context", "starting_pass"),
    _t("advance", "recording_tool_outcome", "building_result",
       when=consecutive_error_ceiling_reached, do=end_tool_error_loop,
       ends=("error", "consecutive_tool_errors")),
    # drafting: a round that would end the turn completes the held response instead
    _t("advance", "recording_tool_outcome", "completing_response",
       when=tool_round_completes_held_draft, do=note_tool_round_trigger),
    _t("advance", "recording_tool_outcome", "building_result",
       when=tool_asked_to_end_turn, do=complete_end_turn, ends=("completed", "end_turn")),
    _t("advance", "recording_tool_outcome", "building_result",
       when=continuation_retries_exhausted, do=complete_retry_exhausted,
       ends=("completed", "continuation_retries_exhausted")),
    _t("advance", "recording_tool_outcome", "building_result",
       when=should_end_after_pre_tool_text, do=complete_after_pre_tool_text,
       ends=("completed", "pre_tool_text_suffices")),
    _t("advance", "recording_tool_outcome", "starting_pass"),
    # ---- completing a drafted response (docs/behaviour.md §14.3): no prose, no review; a
    # reviewer already unavailable or the reviews spent, delivered as it is; else reviewed
    _t("advance", "completing_response", "building_result", when=no_pending_prose,
       do=deliver_held_draft, ends=("completed", "no_pending_prose")),
    _t("advance", "completing_response", "building_result", when=reviewer_unavailable,
       do=deliver_held_draft, ends=("completed", "draft_unreviewed")),
    _t("advance", "completing_response", "building_result", when=reviews_exhausted,
       do=deliver_held_draft, ends=("completed", "reviews_exhausted")),
    _t("advance", "completing_response", "reviewing_draft", do=request_draft_review),
    # a cut candidate is delivered as cut, whatever the verdict (no room is left to revise)
    _t("review_returned", "reviewing_draft", "building_result", when=draft_cut_at_length_limit,
       do=deliver_held_draft, ends=("completed", "cut_at_length_limit")),
    _t("review_returned", "reviewing_draft", "building_result", when=verdict_passes,
       do=deliver_held_draft, ends=("completed", "draft_passed")),
    _t("review_returned", "reviewing_draft", "building_result", when=verdict_unavailable,
       do=deliver_held_draft, ends=("completed", "draft_unreviewed")),
    _t("review_returned", "reviewing_draft", "revising", when=revision_left,
       do=begin_revision),
    _t("review_returned", "reviewing_draft", "building_result",
       do=deliver_held_draft, ends=("completed", "revisions_exhausted")),
    _t("review_deadline", "reviewing_draft", "building_result",
       do=take_review_timeout, ends=("completed", "review_timeout")),
    _t("advance", "revising", "starting_pass"),
    # ---- the tool checkpoint's verdict (docs/behaviour.md §14.6): the call is admitted or
    # rejected, and the gate goes on with the batch's next call
    _t("review_returned", "reviewing_call", "next_call", when=verdict_passes,
       do=run_approved_call),
    _t("review_returned", "reviewing_call", "next_call", when=verdict_revises,
       do=reject_call),
    _t("review_returned", "reviewing_call", "next_call", when=reviewing_correction,
       do=refuse_unapproved_correction),
    _t("review_returned", "reviewing_call", "next_call", do=run_unreviewed_call),
    _t("review_deadline", "reviewing_call", "next_call", when=reviewing_correction,
       do=refuse_unapproved_correction),
    _t("review_deadline", "reviewing_call", "next_call", do=run_unreviewed_call),
    # ---- while a reviewer is asked: a stop ends the turn and nothing held is sent; a
    # follow-up interrupts a drafted reply and waits during a tool chain
    _t("stop_requested", REVIEW_STATES, "building_result", do=stop_during_review,
       ends=("stopped_by_user", "stopped_during_review")),
    _t("follow_up_arrived", "reviewing_draft", "building_result", do=interrupt_review,
       ends=("follow_up_interrupt", None)),
    _t("follow_up_arrived", "reviewing_call", None, do=clear_stale_follow_up),
    # a call under review may have deliveries in flight (without drafting, its narration was
    # just handed over), and so may a reply under review that answers messages held while
    # the reply before it was delivered (§8.5 rule 3; drafting sends nothing before a review)
    _t("delivery_recorded", REVIEW_STATES, None, do=record_delivery),
    _t("delivery_failed", REVIEW_STATES, "building_result", when=delivery_timed_out,
       do=fail_delivery_during_review, ends=("error", "host_timeout")),
    _t("delivery_failed", REVIEW_STATES, "building_result",
       do=fail_delivery_during_review, ends=("error", "host_error")),
    # ---- messages that arrive while the turn runs (docs/behaviour.md §8.5): a steered or
    # queued one is held whatever the turn is doing; a turn that would end completed holding
    # some answers them in one more pass, when its ceilings leave one
    _t("message_held", HOLDING_STATES, None, do=hold_message),
    _t("advance", "building_result", "starting_pass", when=held_messages_wait_for_answer,
       do=answer_held_messages),
    # ---- the settle step: wait (bounded) for deliveries in flight (docs/behaviour.md §6.1),
    # then the terminal state the decided ending names
    _t("advance", "building_result", "settling", when=must_settle_deliveries, do=begin_settling),
    *to_decided_terminal("building_result", (
        "completed", "stopped_by_user", "follow_up_interrupt", "timeout", "error",
        "awaiting_approval", "empty_response",
    )),
    _t("delivery_recorded", "settling", "building_result",
       when=all_deliveries_recorded, do=settle_delivery),
    _t("delivery_recorded", "settling", None, do=settle_delivery),
    _t("settle_deadline", "settling", "building_result", do=abandon_in_flight),
    # a stop ends the wait; it re-decides only a stalled stream's timeout
    _t("stop_requested", "settling", "building_result", when=outcome_is_stalled_stream,
       do=kill_while_settling, ends=("stopped_by_user", "stopped_while_settling")),
    _t("stop_requested", "settling", "building_result", do=kill_while_settling),
    _t("follow_up_arrived", "settling", None, do=ignore_follow_up_while_settling),
    _t("delivery_failed", "settling", "building_result", when=delivery_timed_out,
       do=fail_delivery_while_settling, ends=("error", "host_timeout")),
    _t("delivery_failed", "settling", "building_result",
       do=fail_delivery_while_settling, ends=("error", "host_error")),
]
# fmt: on

DECLARATION = MachineDeclaration(
    name="ToolLoopMachine",
    title="ToolLoopMachine (inner tier)",
    states=STATES,
    transitions=TRANSITIONS,
    initial="ready",
    source_module=__name__,
    chunks=CHUNK_TRIGGERS,
)

_SIGNAL_TRIGGERS: dict[type, str] = {
    StreamEnded: "stream_ended",
    StreamFailed: "stream_failed",
    ToolFinished: "tool_finished",
    StopRequested: "stop_requested",
    FollowUpArrived: "follow_up_arrived",
    MessageHeld: "message_held",
    DeliveryRecorded: "delivery_recorded",
    DeliveryFailed: "delivery_failed",
    ReviewReturned: "review_returned",
}


def trigger_for(event: object) -> str:
    """The declared trigger an event other than an expired deadline fires."""
    trigger = CHUNK_TRIGGERS.get(type(event)) or _SIGNAL_TRIGGERS.get(type(event))
    if trigger is not None:
        return trigger
    raise TypeError(f"{type(event).__name__} is not an event of the tool loop")


def expired_deadline(event: DeadlineExpired, state: str) -> tuple[str, DeadlineKind]:
    """The trigger an expired deadline fires in ``state``, and the armed deadline whose token
    it must carry. A pass arms one ``STREAM`` deadline; it expires as the budget that ran out
    (first token, inactivity or the pass's duration), and a shell that reports it as
    ``STREAM`` leaves the machine to tell: the first-token budget before the first chunk, the
    inactivity budget after it."""
    kind = event.kind
    if kind is DeadlineKind.STREAM:
        kind = phase_budget(answered=state != "awaiting_first_token")
    armed = DeadlineKind.STREAM if kind in STREAM_BUDGETS else kind
    return f"{kind.value}_deadline", armed


#: The fields of each event, checked before the event is taken (chunks too).
_SHAPES = event_shapes((*CHUNK_TRIGGERS, *_SIGNAL_TRIGGERS, DeadlineExpired))

DEFAULT_POLICY = LoopPolicy()


class ToolLoopMachine(DeclaredMachine[TurnState]):
    """The inner tool loop as a sans-IO machine: `start` it, `feed` it events, carry out the
    effects it returns. One instance runs one turn (one attempt).

    ``reference=True`` runs every step on `transitions` (`toolloop_fsm.reference`: slower,
    for debugging a turn; the compiled runner must agree with it).
    """

    __slots__ = ("policy", "snapshots", "tools")
    name = "ToolLoopMachine"

    def __init__(
        self,
        policy: LoopPolicy | None = None,
        *,
        tools: ToolRegistry | Iterable[Tool] = (),
        reference: bool = False,
        on_step: Callable[[TraceStep], None] | None = None,
        snapshots: bool = False,
    ) -> None:
        self.policy = policy if policy is not None else DEFAULT_POLICY
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        #: offer an `OfferSnapshot` effect at each stable point (entering ``starting_pass``)
        self.snapshots = snapshots
        super().__init__(DECLARATION, reference=reference, on_step=on_step)

    # ------------------------------------------------------------------ public surface
    def interrupted_result(self, status: TurnStatus, reason: str) -> GenerationTurnResult:
        """The turn as far as it got, for a run stopped from outside the machine (the outer
        tier cancelling an attempt): what was delivered and recorded, with ``status``."""
        if self._result is not None:
            return self._result
        return build_result(self.turn, status=status, reason=reason)

    @property
    def turn(self) -> TurnState:
        """The live iteration state (read-only by convention; for hosts' inspection and tests)."""
        return self._started()

    def start(
        self,
        request: TurnRequest,
        *,
        continuation_style: bool = False,
        hold_timeout_notice: bool = False,
        ledger: Mapping[str, LedgerEntry] | None = None,
        expression_delivered: bool = False,
        draft: DraftState | None = None,
        attempt_budget: AttemptBudget | None = None,
        now: float | None = None,
    ) -> list[Effect]:
        """Begin the turn: returns the effects that open the first pass.

        ``ledger`` and ``expression_delivered`` carry a previous attempt's completed tool
        calls and delivered expression into this one (the outer tier uses them). ``now`` is
        the turn's clock time, stamped on the trace steps it takes (``None``: unstamped).
        ``draft`` carries a previous attempt's review state (budgets, rejections) when
        drafting or the tool checkpoint is on. ``attempt_budget`` is the model's price and the
        chain's budget with what earlier attempts spent of it (docs/behaviour.md §2.8).
        """
        self._refuse_restart("start")
        turn = TurnState(
            policy=self.policy,
            registry=self.tools,
            request=request,
            continuation_style=continuation_style,
            hold_timeout_notice=hold_timeout_notice,
        )
        turn.flush_chars = self.policy.delivery_flush_chars
        turn.context.extend(request.context)
        turn.prefill = request.prefill
        if ledger:
            turn.ledger.update(ledger)
        turn.expression_delivered = expression_delivered
        turn.attempt_budget = attempt_budget
        if self.policy.drafting or self.policy.review_tool_calls:
            turn.draft = draft if draft is not None else DraftState()
            if turn.draft.expression_held:
                # a carried draft holds the one expression, shown with the reply: it counts
                # as delivered although no earlier attempt delivered one
                turn.expression_delivered = True
            if turn.draft.history and self.policy.drafting:
                # an earlier attempt's function history: the model sees its tool rounds
                turn.history = list(turn.draft.history)
                turn.draft.history = []
        turn.snapshots = self.snapshots
        self._model = turn
        return self._fire("start", None, now)

    def resume(self, snapshot: LoopSnapshot, *, now: float | None = None) -> list[Effect]:
        """Continue the turn ``snapshot`` was taken of, before its next pass: returns the
        effects that send again the deliveries it had in flight and open that pass. The
        policy and tools are this machine's; a snapshot naming a tool they lack raises
        `toolloop_fsm.snapshot.SnapshotError`."""
        self._refuse_restart("resume")
        turn = restore_loop(snapshot, self.policy, self.tools)
        turn.snapshots = self.snapshots
        self._model = turn
        return self._fire("resume", None, now)

    def feed(self, event: Any, *, now: float | None = None) -> list[Effect]:
        """Take one event; return the effects to carry out, in order. ``now`` is the turn's
        clock time, stamped on the trace steps the event leads to (a chunk taken by the fast
        path takes no step)."""
        handler = self._runner.fast.get(event.__class__)
        if handler is not None:
            turn = self._model
            assert turn is not None
            problem = malformation(_SHAPES, event)
            if problem is not None:
                raise InvalidEvent(self.name, turn.state, event, problem)
            handler(turn, event)
            effects = turn.effects
            if effects:
                turn.effects = []
                return effects
            return []
        if event.__class__ is DeliveryRecorded:
            return self._confirm_delivery(event, now)
        return self._feed_trigger(event, now)

    @property
    def chunk_handlers(self) -> Mapping[type, Callable[[TurnState, Any], None]]:
        """The current state's chunk handlers (the fast path), kept up to date in place: a
        stream reader may hold this mapping and call a handler directly with `turn`, then
        collect `take_effects()` — what `feed` does for a chunk, without its check of the
        chunk's fields (the reader vouches for its chunks)."""
        return self._runner.fast

    def take_effects(self) -> list[Effect]:
        """The effects a directly called chunk handler left on the turn."""
        turn = self.turn
        effects = turn.effects
        turn.effects = []
        return effects

    # ------------------------------------------------------------------ internals
    def _fresh(self) -> ToolLoopMachine:
        return ToolLoopMachine(
            self.policy,
            tools=self.tools,
            reference=not isinstance(self._runner, CompiledRunner),
            on_step=self._runner.on_step,
            snapshots=self.snapshots,
        )

    def _confirm_delivery(self, event: DeliveryRecorded, now: float | None) -> list[Effect]:
        """A delivery confirmed where it is only recorded (streaming, running a tool): one
        plain step, checked as every event is, without the general trigger's loop. Anywhere
        else — settling, a finished turn, a malformed or unknown confirmation — the general
        path takes it (and refuses what it refuses)."""
        turn = self._model
        if (
            turn is None
            or self._result is not None
            or malformation(_SHAPES, event) is not None
            or (event.seq is not None and event.seq not in turn.deliveries.in_flight)
        ):
            return self._feed_trigger(event, now)
        previous = turn.step_time
        turn.step_time = now
        if not self._runner.take_plain(turn, turn.state, "delivery_recorded", event):
            turn.step_time = previous
            return self._feed_trigger(event, now)
        effects = turn.effects
        if effects:
            turn.effects = []
            return effects
        return []

    def _feed_trigger(self, event: Any, now: float | None) -> list[Effect]:
        turn = self._model
        if turn is None:
            raise InvalidEvent(self.name, "ready", event, "call start() first")
        problem = malformation(_SHAPES, event)
        if problem is not None:
            raise InvalidEvent(self.name, turn.state, event, problem)
        if isinstance(event, DeadlineExpired):
            trigger, armed = expired_deadline(event, turn.state)
            tokens = armed_tokens(turn, armed)
            if event.token not in tokens:
                raise InvalidEvent(
                    self.name,
                    turn.state,
                    event,
                    f"deadline token {event.token} is not armed (armed: {list(tokens)})",
                )
            return self._fire(trigger, event, now)
        try:
            trigger = trigger_for(event)
        except TypeError as err:
            raise InvalidEvent(self.name, turn.state, event, str(err)) from None
        self._check_current(turn, event)
        return self._fire(trigger, event, now)

    def _check_current(self, turn: TurnState, event: object) -> None:
        """Outcomes that belong to something already cancelled are a shell bug, not data."""
        if isinstance(event, ToolFinished) and running_call(turn, event.dispatch) is None:
            running = [c.dispatch for c in turn.tool_round.calls if c.running]
            raise InvalidEvent(
                self.name,
                turn.state,
                event,
                f"dispatch {event.dispatch} is not a running one (running: {running})",
            )
        elif isinstance(event, ReviewReturned) and (
            turn.draft is None or event.review != turn.draft.review_seq
        ):
            current = turn.draft.review_seq if turn.draft is not None else None
            detail = f"review {event.review} is not the one asked for ({current})"
            raise InvalidEvent(self.name, turn.state, event, detail)
        elif (
            isinstance(event, DeliveryRecorded | DeliveryFailed)
            and event.seq is not None
            and event.seq not in turn.deliveries.in_flight
        ):
            detail = f"delivery {event.seq} is not in flight"
            raise InvalidEvent(self.name, turn.state, event, detail)

    def _build_result(self, model: TurnState) -> GenerationTurnResult:
        return build_result(model)
