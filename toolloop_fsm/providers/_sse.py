"""Byte-stream framing for the adapters: server-sent events and NDJSON lines.

`aiter_sse` decodes a ``text/event-stream`` body incrementally, following the WHATWG
event-stream algorithm (the one openai-python's ``SSEDecoder`` implements):

* lines end with CR, LF or CRLF — a CRLF split across two byte chunks counts once;
* a line starting with ``:`` is a comment; ``field:value`` loses one leading space of the
  value; a line without ``:`` is a field with an empty value;
* ``data`` lines are joined with ``"\\n"``; ``event`` names the event (``"message"`` when
  absent); ``id`` persists across events and is ignored when it contains NUL; ``retry`` is
  kept when it is all ASCII digits; other fields are ignored;
* an empty line dispatches the pending event, but only if it had at least one ``data`` field.

**Decision — a line that is no SSE field is a protocol error** (``strict=True``, the default).
WHATWG ignores unknown field names, but no provider sends any, while real failures do put
non-SSE text in a 200 body: an HTML error page from a proxy, or (reported for Gemini) a bare
JSON error object appended after the events. Ignoring those lines would turn the failure
into a silently empty or truncated stream, so `aiter_sse` raises `ProviderError`
(``kind="protocol"``) quoting the offending text instead. ``strict=False`` restores the
WHATWG behaviour. What the message quotes does not depend on how the body was split into
reads: the offending line and what follows it, up to a fixed number of bytes (or the end of
the body), redacted and then cut; the error is raised once that much has arrived.

Byte chunks may be split anywhere, including inside a UTF-8 character: lines are cut on the
byte values of CR and LF (which never occur inside a multi-byte UTF-8 sequence) and each
complete line is decoded on its own, with replacement of invalid bytes as the standard says.

**Decision — the undelimited last event is flushed at EOF.** WHATWG drops an event that is
not followed by a blank line when the stream ends. Real fixtures (anthropic-sdk-python's
``tests/lib/streaming/fixtures/*.txt``) end right after the last ``data:`` line, and a cleanly
closed body has delivered every byte the server meant to send, so dropping it would lose the
terminal event (``message_stop``). A body cut by a dropped connection never reaches this
flush: httpx raises on an incomplete chunked or length-delimited body first.

**Why not httpx-sse.** Two reasons, measured on the same bytes (``benchmarks/bench_providers.py``,
process CPU time, 10,000-event OpenAI stream):

* it does not handle every recorded stream: it drops the undelimited last event described
  above (Anthropic's ``message_stop`` in the fixture captures), and refuses a response whose
  content type is not ``text/event-stream`` instead of letting us report a protocol error;
* it is not faster. httpx-sse goes through ``Response.aiter_lines`` (a text decoder plus a
  line splitter) and then its own per-line decoder; this module cuts bytes once with
  ``bytes.splitlines`` and has a fast path for ``data: …`` lines. Framing alone, `aiter_sse`
  took 0.85x httpx-sse's time with one read per event and 1.05x with 64 KiB reads; the
  adapters use `SSEDecoder.feed_raw`, which skips building a value per event, and the whole
  OpenAI adapter (framing, JSON, chunk events, tool-call assembly) ran in 0.8x-1.0x the time
  of httpx-sse + ``json.loads`` alone.

So the adapters use this decoder; httpx-sse stays the reference in tests and the benchmark.

`NDJSONDecoder` cuts an NDJSON body the same way, with the same raw interface (`EventFramer`):
it splits on LF (tolerating CRLF), skips blank lines and hands each line on as the data of an
event named ``"message"``; an unterminated last line comes out at EOF. `aiter_ndjson` decodes
each line as a JSON object. `decode_json_object` is that rule for any one event's text, shared
by every adapter: a bad event is a protocol error quoting it. Running the events through a
provider's decoder is `toolloop_fsm.providers._stream`'s.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from collections.abc import Iterable
from typing import Any
from typing import Protocol

from attrs import frozen

from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers._secrecy import quote

_BOM = b"\xef\xbb\xbf"
# How much of a bad line an error message quotes, in characters.
_QUOTE_LIMIT = 300
# How many bytes of non-SSE text are gathered for the quote: enough for _QUOTE_LIMIT
# characters of up to four bytes each, and for the redaction of a key that crosses the cut.
_BAD_TEXT_BYTES = 4 * _QUOTE_LIMIT + 256


RawEvent = tuple[str, str, str, int | None]
"""An event as ``(event, data, id, retry)``, without the cost of building a value."""


@frozen
class ServerSentEvent:
    """One dispatched event: its name, data (lines joined by LF), last event id and retry."""

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


class _NotAnEventStream(Exception):
    """Internal: the decoder met a line that is no SSE field (strict mode)."""


def _not_sse(text: bytes, secrets: Iterable[str | None]) -> ProviderError:
    return ProviderError(
        f"response body is not a server-sent event stream: {_quote(text.strip(), secrets)}",
        kind="protocol",
        retryable=True,
    )


def _quote(line: bytes | str, secrets: Iterable[str | None]) -> str:
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    return repr(quote(text, secrets, _QUOTE_LIMIT))


def decode_json_object(
    data: str | bytes, *, what: str, secrets: Iterable[str | None] = ()
) -> dict[str, Any]:
    """``data`` decoded as a JSON object, or a protocol `ProviderError` saying that ``what``
    (``"Gemini stream event"``, ``"stream line"``, …) is not one, quoting it redacted.

    The error is raised outside the ``except``: the JSON error it replaces holds the raw text
    in its ``doc`` and must not travel chained to it.
    """
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        problem = f"not JSON ({exc})"
    else:
        if isinstance(value, dict):
            return value
        problem = "not a JSON object"
    raise ProviderError(
        f"{what} is {problem}: {_quote(data, secrets)}", kind="protocol", retryable=True
    )


class SSEDecoder:
    """Incremental WHATWG event-stream decoder over byte chunks (sans-IO).

    ``feed(chunk)`` returns the events completed by that chunk; ``finish()`` returns the
    undelimited last event, if any (see the module docstring for why it is flushed). Once a
    line that is no SSE field arrives (strict mode), the events before that line are still
    returned, nothing after it is decoded, and ``error`` holds the protocol error as soon as
    its quote is complete: `_BAD_TEXT_BYTES` from that line on, or the end of the body. The
    quote is redacted of ``secrets``.
    """

    __slots__ = (
        "_bad",
        "_data",
        "_error",
        "_event",
        "_id",
        "_pending",
        "_retry",
        "_secrets",
        "_skip_lf",
        "_started",
        "_strict",
    )

    def __init__(self, *, strict: bool = True, secrets: Iterable[str | None] = ()) -> None:
        self._strict = strict
        self._secrets = tuple(secrets)
        self._bad: bytearray | None = None
        self._error: ProviderError | None = None
        self._pending = b""
        self._skip_lf = False
        self._started = False
        self._data: list[str] = []
        self._event = ""
        self._id = ""
        self._retry: int | None = None

    @property
    def error(self) -> ProviderError | None:
        return self._error

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """The events completed by ``chunk``."""
        return [ServerSentEvent(*fields) for fields in self.feed_raw(chunk)]

    def finish(self) -> list[ServerSentEvent]:
        """The undelimited last event, if the stream ended inside one."""
        return [ServerSentEvent(*fields) for fields in self.finish_raw()]

    def feed_raw(self, chunk: bytes) -> list[RawEvent]:
        """`feed` as ``(event, data, id, retry)`` tuples: the adapters' per-chunk hot path."""
        if not chunk or self._error is not None:
            return []
        if self._bad is not None:
            self._gather_bad(chunk)
            return []
        if self._skip_lf:
            chunk = self._past_crlf(chunk)
            if not chunk:
                return []
        buffer = self._pending + chunk if self._pending else chunk
        if not self._started:
            buffer = self._past_bom(buffer)
            if not self._started:
                return []
        lines = buffer.splitlines(keepends=True)
        if not lines:
            self._pending = b""
            return []
        last = lines[-1]
        if last[-1:] in (b"\n", b"\r"):
            self._pending = b""
            self._skip_lf = last[-1:] == b"\r"
        else:
            self._pending = last  # an unterminated line: the next read completes it
            lines.pop()
        return self._events_of(lines)

    def _past_crlf(self, chunk: bytes) -> bytes:
        """The previous chunk ended in CR; an LF starting this one belongs to that CRLF."""
        self._skip_lf = False
        return chunk[1:] if chunk[:1] == b"\n" else chunk

    def _past_bom(self, buffer: bytes) -> bytes:
        """The stream's first bytes without their BOM; while they may still be the start of
        one, they are kept back (and the stream is not started yet)."""
        if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
            self._pending = buffer
            return b""
        self._started = True
        return buffer[len(_BOM) :] if buffer.startswith(_BOM) else buffer

    def _events_of(self, lines: list[bytes]) -> list[RawEvent]:
        """The events that ``lines`` complete (the one still open gathers their data); at a
        line that is no SSE field, the rest is kept for the error's quote."""
        events: list[RawEvent] = []
        data = self._data
        for index, raw in enumerate(lines):
            line = raw.rstrip(b"\r\n")
            if not line:
                if data:
                    text = data[0] if len(data) == 1 else "\n".join(data)
                    events.append((self._event or "message", text, self._id, self._retry))
                    data = self._data = []
                self._event = ""
            elif line.startswith(b"data: "):
                # The overwhelmingly common line: no partition, no field dispatch.
                data.append(line[6:].decode("utf-8", "replace"))
            else:
                try:
                    self._field(line)
                except _NotAnEventStream:
                    self._bad = bytearray()
                    self._gather_bad(b"".join(lines[index:]) + self._pending)
                    self._pending = b""
                    break
        return events

    def _gather_bad(self, text: bytes) -> None:
        """Keep the non-SSE text for the error's quote; the error is due once there is enough."""
        bad = self._bad
        assert bad is not None
        bad += text[: _BAD_TEXT_BYTES - len(bad)]
        if len(bad) >= _BAD_TEXT_BYTES:
            self._error = _not_sse(bytes(bad), self._secrets)

    def finish_raw(self) -> list[RawEvent]:
        """`finish` as ``(event, data, id, retry)`` tuples."""
        if self._error is not None:
            return []
        if self._bad is not None:
            self._error = _not_sse(bytes(self._bad), self._secrets)
            return []
        if self._pending:
            line, self._pending = self._pending, b""
            if line.startswith(b"data: "):
                self._data.append(line[6:].decode("utf-8", "replace"))
            else:
                try:
                    self._field(line)
                except _NotAnEventStream:
                    self._error = _not_sse(line, self._secrets)
                    return []
        if not self._data:
            return []
        data = self._data
        self._data = []
        text = data[0] if len(data) == 1 else "\n".join(data)
        event = (self._event or "message", text, self._id, self._retry)
        self._event = ""
        return [event]

    def _field(self, line: bytes) -> None:
        if line[:1] == b":":
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        elif name == b"id":
            if b"\x00" not in value:
                self._id = value.decode("utf-8", "replace")
        elif name == b"retry":
            if value.isdigit():
                self._retry = int(value)
        elif self._strict:
            raise _NotAnEventStream


async def aiter_sse(
    byte_iter: AsyncIterator[bytes], *, strict: bool = True, secrets: Iterable[str | None] = ()
) -> AsyncIterator[ServerSentEvent]:
    """Yield the server-sent events of a byte stream, chunked anyhow.

    Raises `ProviderError` (``kind="protocol"``) on a line that is no SSE field (``strict``),
    its quote redacted of ``secrets``.
    """
    decoder = SSEDecoder(strict=strict, secrets=secrets)
    async for chunk in byte_iter:
        for event in decoder.feed(chunk):
            yield event
        if decoder.error is not None:
            raise decoder.error
    for event in decoder.finish():
        yield event
    if decoder.error is not None:
        raise decoder.error


class NDJSONDecoder:
    """Incremental NDJSON line splitter over byte chunks (sans-IO), with `SSEDecoder`'s raw
    interface: each non-blank line is an event named ``"message"`` whose data is the line.

    Lines end with LF; a CR before it is left to JSON, which reads it as whitespace. Each
    complete line is decoded on its own, with replacement of invalid bytes as for SSE. An
    unterminated last line is an event at `finish_raw`. Splitting never fails: whether a line
    is a JSON object is the provider's decoder's question (`decode_json_object`).
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    @property
    def error(self) -> ProviderError | None:
        return None

    def feed_raw(self, chunk: bytes) -> list[RawEvent]:
        """The lines completed by ``chunk``, as ``(event, data, id, retry)`` tuples."""
        if not chunk:
            return []
        lines = (self._pending + chunk if self._pending else chunk).split(b"\n")
        self._pending = lines.pop()
        return [_line_event(line) for line in lines if line.strip()]

    def finish_raw(self) -> list[RawEvent]:
        """The unterminated last line, if it holds anything."""
        line, self._pending = self._pending, b""
        return [_line_event(line)] if line.strip() else []


def _line_event(line: bytes) -> RawEvent:
    return ("message", line.decode("utf-8", "replace"), "", None)


class EventFramer(Protocol):
    """What cuts a body into events: `SSEDecoder` or `NDJSONDecoder`."""

    @property
    def error(self) -> ProviderError | None: ...

    def feed_raw(self, chunk: bytes) -> list[RawEvent]: ...

    def finish_raw(self) -> list[RawEvent]: ...


async def aiter_ndjson(
    byte_iter: AsyncIterator[bytes], *, secrets: Iterable[str | None] = ()
) -> AsyncIterator[dict[str, Any]]:
    """Yield one decoded JSON object per non-blank line of a byte stream; raise
    `ProviderError` (``kind="protocol"``) quoting a line that is not one."""
    lines = NDJSONDecoder()
    async for chunk in byte_iter:
        for _name, data, _id, _retry in lines.feed_raw(chunk):
            yield decode_json_object(data, what="stream line", secrets=secrets)
    for _name, data, _id, _retry in lines.finish_raw():
        yield decode_json_object(data, what="stream line", secrets=secrets)


__all__ = [
    "EventFramer",
    "NDJSONDecoder",
    "RawEvent",
    "SSEDecoder",
    "ServerSentEvent",
    "aiter_ndjson",
    "aiter_sse",
    "decode_json_object",
]
