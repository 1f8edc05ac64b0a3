"""HTTP plumbing shared by the adapters: the streamed POST, and every failure as `ProviderError`.

Owns three things:

* `post_stream` — POST a JSON body and yield the response body as bytes, on a shared
  ``httpx.AsyncClient`` or on one it creates and closes itself. The response is closed (and
  its connection given back) as soon as the generator is closed or the task reading it is
  cancelled; the decoding loop wraps it in ``contextlib.aclosing`` so that closing happens at
  a known point, not whenever the garbage collector finalises an abandoned generator. On a
  shared client the send itself is guarded (`_Opening`): a pass given up while its request
  waits for one of the pool's connections must not cost the pool that connection for good,
  as httpcore's pool lets it (encode/httpcore#1093).
* What a response that is not a stream becomes: an error status, a 2xx body that is a
  document (JSON, HTML) rather than the stream asked for, and an empty 2xx body. Of an error
  body or a document at most `BODY_READ_LIMIT` (64 KiB) is read — the response is then closed,
  and with it the connection — so a huge or endless body costs neither memory nor the pass's
  deadlines.
* Classification, in one place for every adapter: an HTTP error response
  (`error_from_response`), a document in place of a stream (`error_from_document`), an error
  object inside a 200 stream (`error_from_payload`), an empty body (`empty_body_error`) and a
  transport failure (`error_from_transport`) become one `ProviderError` with a ``kind``,
  ``retryable`` and ``retry_after`` (seconds, from ``retry-after-ms``, ``retry-after`` as
  seconds or HTTP date, or Gemini's ``RetryInfo.retryDelay``; always within
  `bounded_retry_after`).

Every text quoted into a message goes through `_secrecy.quote` (redacted, then cut); API keys
travel only in headers.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import AsyncGenerator
from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Mapping
from contextlib import aclosing
from contextlib import asynccontextmanager
from typing import Any
from typing import Literal
from typing import cast

import httpx

from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import bounded_retry_after
from toolloop_fsm.providers._secrecy import quote

# LLM streams are long-lived; the pump's own deadlines (first token, inactivity) bound the
# waits that matter, so the read timeout only catches a dead connection.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)

BODY_READ_LIMIT = 64 * 1024
"""The most bytes read of an error body, or of a 2xx body that is not a stream."""
# How much of a provider's error text or an unreadable body a message quotes, in characters.
_DETAIL_LIMIT = 500

Framing = Literal["sse", "ndjson"]
# The first byte of a 2xx body (after whitespace) that says it is a document, not the stream:
# an SSE stream starts with a field or a comment, an NDJSON stream with an object.
_DOCUMENT_STARTS: Mapping[Framing, bytes] = {"sse": b"{[<", "ndjson": b"[<"}

_RETRYABLE_STATUS = frozenset({408, 409, 429, 529})

# Error `type` / `code` / `status` words seen in provider bodies and in-stream error events,
# mapped to (kind, retryable). Checked before numeric codes: they are more specific.
_ERROR_WORDS: Mapping[str, tuple[str, bool]] = {
    # rate limits and quotas: another key or model may succeed
    "rate_limit_error": ("rate_limit", True),
    "rate_limit_exceeded": ("rate_limit", True),
    "rate_limited": ("rate_limit", True),
    "resource_exhausted": ("rate_limit", True),
    "insufficient_quota": ("rate_limit", True),
    "too_many_requests": ("rate_limit", True),
    "throttling_error": ("rate_limit", True),
    "throttlingexception": ("rate_limit", True),  # AWS (Bedrock) behind a gateway
    "throttled": ("rate_limit", True),
    # the request itself is wrong: repeating it cannot help
    "tool_use_failed": ("bad_request", False),
    "invalid_request_error": ("bad_request", False),
    "invalid_request": ("bad_request", False),
    "invalid_argument": ("bad_request", False),
    "failed_precondition": ("bad_request", False),
    "context_length_exceeded": ("bad_request", False),
    "request_too_large": ("bad_request", False),
    "authentication_error": ("auth", False),
    "permission_error": ("auth", False),
    "permission_denied": ("auth", False),
    "unauthenticated": ("auth", False),
    "invalid_api_key": ("auth", False),
    "billing_error": ("auth", False),
    "not_found_error": ("not_found", False),
    "not_found": ("not_found", False),
    "model_not_found": ("not_found", False),
    # the provider's side failed
    "overloaded_error": ("server", True),
    "overloaded": ("server", True),
    "api_error": ("server", True),
    "server_error": ("server", True),
    "internal_error": ("server", True),
    "internal": ("server", True),
    "unavailable": ("server", True),
    "service_unavailable": ("server", True),
    "timeout_error": ("server", True),
    "deadline_exceeded": ("server", True),
}


# --------------------------------------------------------------------------- classification
def kind_for_status(status: int) -> tuple[str, bool]:
    """(kind, retryable) for an HTTP status code."""
    if status == 429:
        return "rate_limit", True
    if status in (401, 403):
        return "auth", False
    if status == 404:
        return "not_found", False
    if status in (400, 413, 422):
        return "bad_request", False
    if status >= 500 or status in _RETRYABLE_STATUS:
        return "server", True
    return "provider_error", False


def parse_retry_after(
    headers: Mapping[str, str] | httpx.Headers, *, now: float | None = None
) -> float | None:
    """The server's wait hint in seconds: ``retry-after-ms``, then ``retry-after``.

    ``retry-after`` may be seconds (fractions accepted) or an HTTP date (taken relative to
    ``now``, default the wall clock). Unparseable values are ignored, and so is a NaN (the
    next header is tried); the rest is `bounded_retry_after`: a negative wait is none, and
    anything past a day (``inf`` included) is a day.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms is not None:
        seconds = bounded_retry_after(_seconds(raw_ms, scale=0.001))
        if seconds is not None:
            return seconds
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    seconds = _seconds(raw)
    if seconds is not None:
        return bounded_retry_after(seconds)
    try:
        when = email.utils.parsedate_to_datetime(raw.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    reference = time.time() if now is None else now
    return bounded_retry_after(when.timestamp() - reference)


def _seconds(text: str, *, scale: float = 1.0) -> float | None:
    """A decimal number of seconds (NaN and infinities included), or None."""
    try:
        return float(text.strip()) * scale
    except ValueError:
        return None


def _retry_delay_from_body(error: Mapping[str, Any]) -> float | None:
    """Gemini's ``details[{"@type": …RetryInfo, "retryDelay": "34.4s"}]``, bounded."""
    details = error.get("details")
    if not isinstance(details, list):
        return None
    for detail in details:
        if not isinstance(detail, Mapping):
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, str) and delay.endswith("s"):
            seconds = bounded_retry_after(_seconds(delay[:-1]))
            if seconds is not None:
                return seconds
    return None


def _error_object(body: Any) -> Mapping[str, Any] | None:
    """The provider's error object inside a decoded body, whatever its shape."""
    if isinstance(body, list) and body and isinstance(body[0], Mapping):
        body = body[0]  # Gemini (non-SSE) answers errors inside a one-element array
    if not isinstance(body, Mapping):
        return None
    error = body.get("error")
    if isinstance(error, Mapping):
        return error
    if isinstance(error, str):
        return {"message": error}
    if "message" in body or "code" in body:
        return body  # the Responses API's typed error event: code/message at the top level
    return None


def error_message(error: Mapping[str, Any]) -> str:
    """A readable one-line message from a provider error object."""
    message = error.get("message")
    text = message if isinstance(message, str) and message else "error without a message"
    metadata = error.get("metadata")
    if isinstance(metadata, Mapping):
        raw = metadata.get("raw")
        if isinstance(raw, str) and raw and raw not in text:
            provider = metadata.get("provider_name")
            text = f"{text}: {raw}" if not provider else f"{text} ({provider}): {raw}"
    labels = [
        str(value)
        for value in (error.get("type"), error.get("code"), error.get("status"))
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value)
    ]
    unique = list(dict.fromkeys(labels))
    return f"{text} [{', '.join(unique)}]" if unique else text


def classify(error: Mapping[str, Any]) -> tuple[str, bool] | None:
    """(kind, retryable) for a provider error object, or None when nothing in it is known.

    The ``code``/``type``/``status`` words come first (they are more specific), then an HTTP
    status in ``code``/``status_code``/``status`` — an integer, or a string of digits as
    LiteLLM sends (``"429"``, ``"500"``).
    """
    for key in ("code", "type", "status"):
        value = error.get(key)
        if isinstance(value, str):
            found = _ERROR_WORDS.get(value.strip().lower())
            if found is not None:
                return found
    for key in ("code", "status_code", "status"):
        status = _status_number(error.get(key))
        if status is not None and 400 <= status < 600:
            return kind_for_status(status)
    return None


def _status_number(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdecimal() and len(value.strip()) == 3:
        return int(value)
    return None


def error_from_payload(
    payload: Any,
    *,
    provider: str,
    status_code: int | None = None,
    secrets: Iterable[str | None] = (),
    unknown: tuple[str, bool] = ("provider_error", True),
) -> ProviderError:
    """A `ProviderError` for an error object met inside a 200 stream.

    ``payload`` is the decoded event (``{"error": {…}}``, ``{"type": "error", "error": {…}}``,
    a top-level ``code``/``message``, or Ollama's ``{"error": "…"}``). The kind comes from
    `classify`; an error it does not know is ``unknown`` — by default ``provider_error`` and
    retryable, since the stream, not the request, failed.
    """
    error = _error_object(payload) or {}
    kind, retryable = classify(error) or unknown
    return ProviderError(
        f"{provider} stream error: {quote(error_message(error), secrets, _DETAIL_LIMIT)}",
        kind=kind,
        retryable=retryable,
        status_code=status_code,
        retry_after=_retry_delay_from_body(error),
    )


def error_from_response(
    status: int,
    headers: Mapping[str, str] | httpx.Headers,
    body: bytes,
    *,
    provider: str,
    secrets: Iterable[str | None] = (),
    now: float | None = None,
) -> ProviderError:
    """A `ProviderError` for an HTTP error response, from its status, headers and body."""
    kind, retryable = kind_for_status(status)
    lowered = {k.lower(): v for k, v in headers.items()}
    should_retry = lowered.get("x-should-retry", "").strip().lower()
    if should_retry in ("true", "false"):
        retryable = should_retry == "true"
    retry_after = parse_retry_after(lowered, now=now)
    error = _error_object(_json_or_none(body))
    if error is not None:
        detail = error_message(error)
        if retry_after is None:
            retry_after = _retry_delay_from_body(error)
    else:
        detail = body.decode("utf-8", "replace").strip()
        detail = detail or httpx.codes.get_reason_phrase(status) or "no body"
    return ProviderError(
        f"{provider} HTTP {status}: {quote(detail, secrets, _DETAIL_LIMIT)}",
        kind=kind,
        retryable=retryable,
        status_code=status,
        retry_after=retry_after,
    )


def error_from_document(
    status: int,
    headers: Mapping[str, str] | httpx.Headers,
    body: bytes,
    *,
    provider: str,
    secrets: Iterable[str | None] = (),
    now: float | None = None,
) -> ProviderError:
    """A `ProviderError` for a 2xx response whose body is a document, not the stream asked for.

    A provider's error object in it (some gateways answer errors with 200) is classified like
    one met in a stream. Anything else — the JSON of a non-streamed reply, a proxy's HTML page
    — is a ``protocol`` error, not retryable: the same request would get the same document.
    """
    error = _error_object(_json_or_none(body))
    if error is not None:
        kind, retryable = classify(error) or ("provider_error", True)
        detail = error_message(error)
        retry_after = parse_retry_after(headers, now=now)
        if retry_after is None:
            retry_after = _retry_delay_from_body(error)
    else:
        kind, retryable, retry_after = "protocol", False, None
        detail = body.decode("utf-8", "replace").strip()
    return ProviderError(
        f"{provider} answered HTTP {status} with a document instead of a stream: "
        f"{quote(detail, secrets, _DETAIL_LIMIT)}",
        kind=kind,
        retryable=retryable,
        status_code=status,
        retry_after=retry_after,
    )


def empty_body_error(provider: str, status: int) -> ProviderError:
    """A 2xx response with nothing in its body (or only whitespace): a ``protocol`` error,
    not retryable — the same request on the same key would get the same nothing."""
    return ProviderError(
        f"{provider} answered HTTP {status} with an empty body",
        kind="protocol",
        retryable=False,
        status_code=status,
    )


def too_large_error(provider: str, max_bytes: int) -> ProviderError:
    """A stream body that ran past the pass's ``max_response_bytes``: ``too_large``, not
    retryable (the same request would get the same flood)."""
    return ProviderError(
        f"{provider} sent more than {max_bytes} bytes: the response was cut there",
        kind="too_large",
        retryable=False,
    )


def error_from_transport(
    exc: BaseException, *, provider: str, secrets: Iterable[str | None] = ()
) -> ProviderError:
    """A retryable ``connection`` error for a failed connect, read, timeout or dropped body;
    a retryable ``protocol`` error for any other httpx failure (a body whose content encoding
    does not decode, too many redirects)."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TransportError):
        what, kind = "connection failed", "connection"
    else:
        what, kind = "response unreadable", "protocol"
    return ProviderError(
        f"{provider} {what} ({type(exc).__name__}): {quote(detail, secrets, _DETAIL_LIMIT)}",
        kind=kind,
        retryable=True,
    )


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        return None


# --------------------------------------------------------------------------- the request
async def post_stream(
    url: str,
    body: Mapping[str, Any],
    *,
    provider: str,
    framing: Framing = "sse",
    headers: Mapping[str, str] | None = None,
    client: httpx.AsyncClient | None = None,
    secrets: Iterable[str | None] = (),
    timeout: httpx.Timeout | None = None,
    max_bytes: int | None = None,
) -> AsyncGenerator[bytes, None]:
    """POST ``body`` as JSON and yield the response body bytes as they arrive.

    An error status raises `error_from_response`; a 2xx body whose first byte (after
    whitespace) cannot start a ``framing`` stream raises `error_from_document`; either reads at
    most `BODY_READ_LIMIT` bytes and closes the response. An empty 2xx body raises
    `empty_body_error`, a transport failure at any point `error_from_transport`. None of these
    has an httpx exception chained to it (its request holds the headers, key included).
    A stream body longer than ``max_bytes`` raises `too_large_error` once that many bytes were
    read (the rest is not). Without ``client`` a private ``httpx.AsyncClient`` is created and
    closed when the generator finishes. Wrap the generator in ``contextlib.aclosing`` so an
    abandoned stream is closed at once.
    """
    secret_list = tuple(s for s in secrets if s)
    own_client = client is None
    active = httpx.AsyncClient(timeout=timeout or DEFAULT_TIMEOUT) if client is None else client
    content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    request_headers = {"content-type": "application/json", **(headers or {})}
    extra: dict[str, Any] = {}
    if timeout is not None and not own_client:
        extra["timeout"] = timeout
    document_starts = _DOCUMENT_STARTS[framing]
    failure: ProviderError | None = None
    try:
        request = active.build_request(
            "POST", url, content=content, headers=request_headers, **extra
        )
        # A private client's pool goes with it: only a shared pool needs the guarded send.
        response = (
            await active.send(request, stream=True)
            if own_client
            else await _send_guarded(active, request)
        )
        async with (
            _closing(response),
            aclosing(cast("AsyncGenerator[bytes, None]", response.aiter_bytes())) as chunks,
        ):
            status = response.status_code
            if not response.is_success:
                failure = error_from_response(
                    status,
                    response.headers,
                    await _read_error_body(chunks, response.headers),
                    provider=provider,
                    secrets=secret_list,
                )
            else:
                # Whitespace before the first meaningful byte is held (not dropped: it is part
                # of the first line) until that byte says whether this is a stream at all.
                held: list[bytes] = []
                started = False
                read = 0
                async for chunk in chunks:
                    if max_bytes is not None:
                        read += len(chunk)
                        if read > max_bytes:
                            failure = too_large_error(provider, max_bytes)
                            break
                    if not started:
                        first = chunk.lstrip()[:1]
                        if not first:
                            held.append(chunk)
                            continue
                        started = True
                        if first in document_starts:
                            document = await _read_capped(chunks, b"".join(held) + chunk)
                            failure = error_from_document(
                                status,
                                response.headers,
                                document,
                                provider=provider,
                                secrets=secret_list,
                            )
                            break
                        for whitespace in held:
                            yield whitespace
                    yield chunk
                if not started:
                    failure = empty_body_error(provider, status)
    except httpx.HTTPError as exc:
        failure = error_from_transport(exc, provider=provider, secrets=secret_list)
    finally:
        if own_client:
            await active.aclose()
    if failure is not None:
        # Raised here, outside the `except`, so that no httpx exception is chained to it.
        raise failure


# --------------------------------------------------------------------------- the pool
# The requests given up while they waited for a connection of a shared pool, until they have
# let go of it (a task nobody references may be collected before it finishes).
_ABANDONED: set[asyncio.Future[Any]] = set()


class _Abandoned(Exception):
    """Internal: a request given up before it left the pool's queue goes no further."""


class _Opening:
    """One request of a shared client on its way to a response, in a task of its own.

    httpcore (1.0.9; encode/httpcore#1093) leaks a connection slot for good when the task
    sending a request is cancelled after the pool assigned it a connection but before the
    request started on it: the connection, never connected, is neither idle nor closed, and
    the pool never reclaims it. A stop, a deadline or a cancelled caller ending a pass while
    its request waits for a connection of a busy pool hits exactly that window, and once every
    slot is lost every later pass on the client waits for a connection until its first-token
    deadline. So the send runs in its own task, which the pass never cancels while the request
    may still be in the pool's queue; the request's first trace event (httpcore's ``trace``
    extension, raised from inside the connection, where cancelling is safe) says it left the
    queue. A pass given up before then marks its opening abandoned and returns at once: the
    request fails at its first trace event, before any byte is sent, and gives the slot back;
    a request given up after then is cancelled, which httpcore handles by closing the
    connection. A response that still arrives is closed.
    """

    __slots__ = ("abandoned", "departed", "task")

    def __init__(self) -> None:
        self.abandoned = False
        self.departed = False
        self.task: asyncio.Task[httpx.Response] | None = None

    async def trace(self, _event: str, _info: Mapping[str, Any]) -> None:
        if not self.departed:
            self.departed = True
            if self.abandoned:
                raise _Abandoned

    async def send(self, client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
        response = await client.send(request, stream=True)
        if self.abandoned:
            await response.aclose()
            raise _Abandoned
        return response

    def abandon(self) -> None:
        task = self.task
        assert task is not None
        self.abandoned = True
        if task.done():
            _settle(task)
            return
        if self.departed:
            task.cancel()
        _ABANDONED.add(task)
        task.add_done_callback(_settle)


def _settle(task: asyncio.Future[Any]) -> None:
    """An abandoned opening finished: its failure is retrieved (nobody waits for it), and a
    response it got before it knew is closed."""
    _ABANDONED.discard(task)
    if task.cancelled() or task.exception() is not None:
        return
    response = task.result()
    if isinstance(response, httpx.Response):
        closing = asyncio.ensure_future(response.aclose())
        _ABANDONED.add(closing)
        closing.add_done_callback(_settle)


async def _send_guarded(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """``request`` sent on a shared ``client`` as a stream, its connection given back to the
    pool however the caller gives it up (`_Opening`)."""
    opening = _Opening()
    request.extensions["trace"] = opening.trace
    task = asyncio.ensure_future(opening.send(client, request))
    opening.task = task
    try:
        return await asyncio.shield(task)
    except BaseException:
        opening.abandon()
        raise


@asynccontextmanager
async def _closing(response: httpx.Response) -> AsyncIterator[httpx.Response]:
    try:
        yield response
    finally:
        await response.aclose()


async def _read_error_body(chunks: AsyncIterator[bytes], headers: httpx.Headers) -> bytes:
    """An error response's body, capped (`_read_capped`); a body that does not decode as its
    content encoding (a corrupt gzip) says so instead: the status and the headers — a 429's
    ``Retry-After`` — still classify the error, which is not a protocol failure."""
    try:
        return await _read_capped(chunks)
    except httpx.DecodingError:
        encoding = headers.get("content-encoding", "")
        return f"(the body did not decode as {encoding!r})".encode()


async def _read_capped(chunks: AsyncIterator[bytes], head: bytes = b"") -> bytes:
    """``head`` and then what ``chunks`` yields, up to `BODY_READ_LIMIT` bytes. Reading stops
    there; the caller closes the response, which drops the connection instead of reading on."""
    parts = [head]
    size = len(head)
    if size < BODY_READ_LIMIT:
        async for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            if size >= BODY_READ_LIMIT:
                break
    return b"".join(parts)[:BODY_READ_LIMIT]


__all__ = [
    "BODY_READ_LIMIT",
    "DEFAULT_TIMEOUT",
    "Framing",
    "classify",
    "empty_body_error",
    "error_from_document",
    "error_from_payload",
    "error_from_response",
    "error_from_transport",
    "error_message",
    "kind_for_status",
    "parse_retry_after",
    "post_stream",
    "too_large_error",
]
