"""How the turn's tool history is shown to a model: one rule for every adapter.

Owns `tool_response_payload` — what a model is shown for one tool response, below — and hands
the adapters `tool_batches` (`toolloop_fsm.conversation`): the history as its tool batches
(docs/behaviour.md §3.10 rule 3), each one assistant turn with every call, then one response
per call, in emitted order, its pre-tool text its first entry's, shown once.

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
from typing import Any

from toolloop_fsm.conversation import ToolBatch
from toolloop_fsm.conversation import tool_batches
from toolloop_fsm.result import REVIEW_REJECTED_STATUS
from toolloop_fsm.result import ToolResponseRecord

FAILED_STATUS = "tool_execution_failed"
"""The status a failed call's response is shown with."""


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
    "tool_response_json",
    "tool_response_payload",
]
