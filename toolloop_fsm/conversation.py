"""The conversation between turns: what a turn added to it, in the provider-neutral form a
`TurnRequest`'s ``context`` takes, and how that form is read back.

Owns the neutral form of tool calls and their responses, both ways:

* `turn_messages` — what a turn added, so that the next turn's context is the old context +
  these + the new user message. Per provider pass, in order: one assistant message with the
  text the user read from that pass (the deliveries the channel confirmed: text only buffered,
  dropped or suppressed is not in it), carrying the pass's tool calls when it ended in a tool
  batch, then one ``tool`` message per call with the response the model was shown;
* `context_items` — a context as its plain messages and its tool batches, in order, which
  every adapter renders in its own wire format the way it renders the turn's own history;
* `check_context` — a context refused, with a message naming the message and what is wrong,
  when a tool message does not fit that form (`TurnRequest` checks every context with it).

The form, as `turn_messages` writes it::

    {"role": "assistant", "content": "Let me check. ",
     "tool_calls": [{"id": "call_0", "name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather",
     "content": {"success": True, "data": {"city": "Paris", "temp_c": 21}, "message": "live"}}

A call's ``id`` is left out when the provider gave none (Gemini, older Ollama), and so is the
response's ``tool_call_id``; the ``tool`` messages right after an assistant message with
``tool_calls`` answer its calls in their order, one each. A call may carry ``provider_data``
(Anthropic's thinking blocks, Gemini's thought signature, the Responses API's reasoning items),
which its adapter sends back with it. A response's ``content`` holds the fields of the
response record the turn kept (``success``, and whichever of ``data``, ``message``,
``status``, ``reason``, ``tool_name`` are set), so it reads back as that record and every
adapter shows it to the model exactly as it showed it during the turn.

It also owns `tool_batches`, the turn's history as its tool batches (docs/behaviour.md §3.10
rule 3): an entry at ``position`` 0 opens a batch, and each entry after it with a higher
position belongs to that batch.

With fallback attempts (`run_generation_turn`), the passes of the attempts are matched by their
number: a later attempt replays the earlier one's calls from the ledger and continues the text
it delivered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attrs import fields
from attrs import frozen

from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

#: The message keys of the neutral form
TOOL_CALLS = "tool_calls"
TOOL_ROLE = "tool"
#: What a response's ``content`` may hold: the fields of the record it was made from
_RESPONSE_FIELDS = tuple(f.name for f in fields(ToolResponseRecord))


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


def turn_messages(result: GenerationTurnResult) -> tuple[dict[str, Any], ...]:
    """What ``result``'s turn added to the conversation, in the neutral form (module
    docstring): the assistant's delivered text and each tool call with its response, per
    provider pass, in order, and after a pass the user messages the turn took in after it
    (steered or queued, docs/behaviour.md §8.5). Nothing the user did not read is in it."""
    texts: dict[int, list[str]] = {}
    for delivered in result.delivered:
        if delivered.text:
            texts.setdefault(delivered.iteration, []).append(delivered.text)
    batches: dict[int, list[ToolBatch]] = {}
    for batch in tool_batches(result.history):
        batches.setdefault(batch.entries[0].iteration, []).append(batch)
    messages: list[dict[str, Any]] = []
    taken_after = {taken.iteration for taken in result.taken_messages}
    for iteration in sorted(texts.keys() | batches.keys() | taken_after):
        text = "".join(texts.get(iteration, ()))
        pass_batches = batches.get(iteration, [])
        if not pass_batches:
            _add_text(messages, text)
        for number, batch in enumerate(pass_batches):
            shown = text if number == 0 else ""
            messages.append(
                {
                    "role": "assistant",
                    "content": shown,
                    TOOL_CALLS: [_call(entry) for entry in batch.entries],
                }
            )
            messages.extend(_response(entry) for entry in batch.entries)
        messages.extend(
            {"role": "user", "content": taken.text}
            for taken in result.taken_messages
            if taken.iteration == iteration
        )
    return tuple(messages)


def history_messages(history: Sequence[ToolHistoryEntry]) -> list[dict[str, Any]]:
    """``history``'s tool batches in the neutral form, as the model was shown them: per batch
    one assistant message with its pre-tool text and calls, then one ``tool`` message per
    call (a turn moves its history into its context so, before a user message that arrived
    while it ran: docs/behaviour.md §8.5)."""
    messages: list[dict[str, Any]] = []
    for batch in tool_batches(history):
        text = batch.entries[0].pre_tool_text or ""
        messages.append(
            {"role": "assistant", "content": text, TOOL_CALLS: [_call(e) for e in batch.entries]}
        )
        messages.extend(_response(entry) for entry in batch.entries)
    return messages


def _add_text(messages: list[dict[str, Any]], text: str) -> None:
    """An assistant text, joined to the assistant text before it (the passes between were
    refused calls the model never saw answered)."""
    if not text:
        return
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and TOOL_CALLS not in last:
        last["content"] += text
    else:
        messages.append({"role": "assistant", "content": text})


def _json_values(value: Any) -> Any:
    """``value`` as the JSON values its JSON text holds, written as the adapters write a
    request body (a value JSON cannot hold, a date or a set, as its ``str``): a copy the host
    can store as it is, which every adapter shows as it showed the original."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


def _call(entry: ToolHistoryEntry) -> dict[str, Any]:
    call: dict[str, Any] = {
        "name": entry.call.name,
        "arguments": _json_values(dict(entry.call.arguments)),
    }
    if entry.call.call_id:
        call = {"id": entry.call.call_id, **call}
    if entry.call.provider_data:
        call["provider_data"] = _json_values(dict(entry.call.provider_data))
    return call


def _response(entry: ToolHistoryEntry) -> dict[str, Any]:
    message: dict[str, Any] = {"role": TOOL_ROLE}
    if entry.call.call_id:
        message["tool_call_id"] = entry.call.call_id
    message["name"] = entry.call.name
    message["content"] = _json_values(
        {
            name: value
            for name in _RESPONSE_FIELDS
            if (value := getattr(entry.response, name)) is not None
        }
    )
    return message


# --------------------------------------------------------------------------- reading it back
def context_items(context: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any] | ToolBatch]:
    """``context`` as its plain messages and its tool batches, in order; raises `ValueError`
    naming the message when a tool message does not fit the neutral form.

    A batch's calls are numbered back from the turn's own history (its ``start`` is below
    zero), so an id an adapter makes up for a call without one never meets the id of a call
    made this turn."""
    calls = sum(len(m.get(TOOL_CALLS) or ()) for m in context if _has_calls(m))
    start = -calls
    position = 0
    while position < len(context):
        message = context[position]
        if message.get("role") == TOOL_ROLE:
            raise ValueError(
                f"context message {position} is a tool response that follows no assistant "
                "message with tool_calls: each answers a call of the message before it"
            )
        if not _has_calls(message):
            yield message
            position += 1
            continue
        entries = _batch_entries(context, position)
        yield ToolBatch(start, entries)
        start += len(entries)
        position += 1 + len(entries)


def check_context(context: Sequence[Mapping[str, Any]]) -> None:
    """Raise `ValueError` when ``context`` does not fit the neutral form (`context_items`)."""
    for _ in context_items(context):
        pass


def _has_calls(message: Mapping[str, Any]) -> bool:
    return message.get("role") == "assistant" and TOOL_CALLS in message


def _batch_entries(
    context: Sequence[Mapping[str, Any]], position: int
) -> tuple[ToolHistoryEntry, ...]:
    message = context[position]
    calls = message[TOOL_CALLS]
    if isinstance(calls, str | Mapping) or not isinstance(calls, Sequence) or not calls:
        raise ValueError(f"context message {position}: tool_calls must be a non-empty list")
    responses = context[position + 1 : position + 1 + len(calls)]
    if len(responses) < len(calls) or any(r.get("role") != TOOL_ROLE for r in responses):
        raise ValueError(
            f"context message {position} has {len(calls)} tool call(s): the next "
            f"{len(calls)} message(s) must be their tool responses, one per call, in order"
        )
    content = message.get("content")
    pre_tool_text = content if isinstance(content, str) and content else None
    entries = []
    for number, (call, response) in enumerate(zip(calls, responses, strict=True)):
        where = f"context message {position}, tool call {number}"
        record = _call_record(call, where)
        answer = f"context message {position + 1 + number}"
        entries.append(
            ToolHistoryEntry(
                call=record,
                response=_response_record(response, record, answer),
                pre_tool_text=pre_tool_text if number == 0 else None,
                position=number,
            )
        )
    return tuple(entries)


def _call_record(call: Any, where: str) -> ToolCallRecord:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where} must be an object, got {type(call).__name__}")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} needs a name (a non-empty string)")
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where}: arguments must be an object, got {type(arguments).__name__}")
    call_id, provider_data = call.get("id"), call.get("provider_data")
    if call_id is not None and not isinstance(call_id, str):
        raise ValueError(f"{where}: id must be a string, got {type(call_id).__name__}")
    if provider_data is not None and not isinstance(provider_data, Mapping):
        raise ValueError(f"{where}: provider_data must be an object")
    return ToolCallRecord(name, dict(arguments), call_id or None, provider_data)


def _response_record(
    response: Mapping[str, Any], call: ToolCallRecord, where: str
) -> ToolResponseRecord:
    answered = response.get("tool_call_id")
    if answered is not None and call.call_id is not None and answered != call.call_id:
        raise ValueError(
            f"{where} answers call {answered!r}, but the call in its place is {call.call_id!r}: "
            "tool responses follow their calls in order"
        )
    content = response.get("content")
    if not isinstance(content, Mapping) or not isinstance(content.get("success"), bool):
        raise ValueError(
            f"{where}: a tool response's content must be an object with a boolean "
            '"success" (as turn_messages writes it)'
        )
    unknown = sorted(str(key) for key in content if key not in _RESPONSE_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: a tool response's content holds {', '.join(_RESPONSE_FIELDS)}, "
            f"not {', '.join(unknown)}"
        )
    return ToolResponseRecord(**{str(key): value for key, value in content.items()})


__all__ = ["ToolBatch", "check_context", "context_items", "tool_batches", "turn_messages"]
