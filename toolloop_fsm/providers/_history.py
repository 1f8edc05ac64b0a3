"""How the turn's tool history is shown to a model: one rule for every adapter.

Owns two things:

* `tool_batches` — the history as its tool batches (docs/behaviour.md §3.10 rule 3): an entry
  at ``position`` 0 opens a batch, and each entry after it with a higher position belongs to
  that batch. A batch is one assistant turn with every call, then one response per call, in
  emitted order; its pre-tool text is its first entry's, shown once.
* `tool_response_payload` — what a model is shown for one tool response, below.

A success is shown as ``{"success": true, "data": …, "message": …}``: the tool's message beside
its data. A failure as ``{"success": false, "status": "tool_execution_failed", "reason": …,
"tool_name": …}``; a failure recorded without a status (a host can write history by hand) is
still shown with that status, the one a failed call has. Whatever the record leaves unset is
left out, and nothing else on it is shown: a success's tool name, a failure's data or message —
except that a call the tool checkpoint rejected (status ``review_rejected``) also shows the
reviewer's ``findings`` and ``"action_executed": false``.

``success`` is part of it because most wire formats carry no error flag of their own beside a
tool's result (only Anthropic's ``is_error`` does), so the payload is where a model reads
whether the call worked, even when a success has neither data nor a message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from toolloop_fsm.result import REVIEW_REJECTED_STATUS
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

FAILED_STATUS = "tool_execution_failed"
"""The status a failed call's response is shown with."""


@frozen
class ToolBatch:
    """The calls of one pass as the history holds them: ``entries`` in emitted order, the
    first of them at index ``start`` of the history."""

    start: int
    entries: tuple[ToolHistoryEntry, ...]

    @property
    def pre_tool_text(self) -> str | None:
        """The visible text streamed before the batch: its first entry's (the machine records
        it there only, so a text on a later entry is not the batch's)."""
        return self.entries[0].pre_tool_text

    def numbered(self) -> Iterator[tuple[int, ToolHistoryEntry]]:
        """Each call with its index in the whole history, which the adapters' fallback ids
        are made from: unique per call, in a batch as across batches, and the same on every
        pass (the history only grows)."""
        return enumerate(self.entries, self.start)


def tool_batches(history: Sequence[ToolHistoryEntry]) -> list[ToolBatch]:
    """``history`` as its tool batches, in order (module docstring). An entry with a
    position above 0 and no batch before it opens one: nothing else could hold it."""
    batches: list[ToolBatch] = []
    opened: list[ToolHistoryEntry] = []
    start = 0
    for index, entry in enumerate(history):
        if entry.position > 0 and opened:
            opened.append(entry)
            continue
        if opened:
            batches.append(ToolBatch(start, tuple(opened)))
        opened = [entry]
        start = index
    if opened:
        batches.append(ToolBatch(start, tuple(opened)))
    return batches


def tool_response_payload(response: ToolResponseRecord) -> dict[str, Any]:
    """The JSON object a model is shown for one tool response (see the module docstring)."""
    if response.success:
        shown: dict[str, Any] = {
            "success": True,
            "data": response.data,
            "message": response.message,
        }
    else:
        shown = {
            "success": False,
            "status": response.status or FAILED_STATUS,
            "reason": response.reason,
            "tool_name": response.tool_name,
        }
        if response.status == REVIEW_REJECTED_STATUS and isinstance(response.data, dict):
            # a call the tool checkpoint rejected: the reviewer's findings, and that it never ran
            shown["findings"] = response.data.get("findings")
            shown["action_executed"] = False
    return {key: value for key, value in shown.items() if value is not None}


def tool_response_from_payload(payload: Mapping[str, Any]) -> ToolResponseRecord:
    """The response a payload of `tool_response_payload` was made from, as far as it shows it:
    the payload made of it again is the same (a context's tool responses are read this way)."""
    if payload.get("success") is True:
        return ToolResponseRecord(True, data=payload.get("data"), message=payload.get("message"))
    status = payload.get("status")
    findings = payload.get("findings")
    return ToolResponseRecord(
        False,
        data={"findings": findings} if status == REVIEW_REJECTED_STATUS else None,
        status=status,
        reason=payload.get("reason"),
        tool_name=payload.get("tool_name"),
    )


def tool_response_json(response: ToolResponseRecord) -> str:
    """`tool_response_payload` as JSON text: non-ASCII characters kept as they are, and a value
    JSON cannot hold (a date, a set) written as its ``str``."""
    return dump_json(tool_response_payload(response))


def dump_json(value: Any) -> str:
    """``value`` as JSON text the way every request body quotes JSON inside a string."""
    return json.dumps(value, ensure_ascii=False, default=str)


__all__ = [
    "FAILED_STATUS",
    "ToolBatch",
    "dump_json",
    "tool_batches",
    "tool_response_from_payload",
    "tool_response_json",
    "tool_response_payload",
]
