"""HTTP plumbing shared by the adapters: the streamed POST, and every failure as `ProviderError`.

Owns three things:

* `post_stream` — POST a JSON body and yield the response body as bytes, on a shared
  ``httpx.AsyncClient`` or on one it creates and closes itself. The request runs inside
  ``async with client.stream(...)`` in the generator, so the response (and its connection) is
  closed as soon as the generator is closed or the task reading it is cancelled. Adapters
  wrap it in ``contextlib.aclosing`` so that closing happens at a known point, not whenever
  the garbage collector finalises an abandoned generator.
* Classification: an HTTP error response (`error_from_response`), an error object inside a
  200 stream (`error_from_payload`) and a transport failure (`error_from_transport`) become
  one `ProviderError` with a ``kind``, ``retryable`` and ``retry_after`` (seconds, from
  ``retry-after-ms``, ``retry-after`` as seconds or HTTP date, or Gemini's
  ``RetryInfo.retryDelay``).
* Secrecy: API keys travel only in headers. Every message built here passes through `redact`,
  which removes the given secrets and any ``key=`` query value, and transport errors are
  re-raised without their httpx cause (whose request object carries the headers).
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

import httpx

from toolloop_fsm.providers.base import ProviderError

# LLM streams are long-lived; the pump's own deadlines (first token, inactivity) bound the
# waits that matter, so the read timeout only catches a dead connection.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)

REDACTED = "[REDACTED]"
_KEY_IN_QUERY = re.compile(r"((?:[?&;]|\b)(?:key|api[_-]?key)=)[^&\s\"'#]+", re.IGNORECASE)
# How much of an unreadable error body a message quotes.
_BODY_QUOTE_LIMIT = 500

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


# --------------------------------------------------------------------------- secrecy
def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with every secret and every ``key=…`` query value replaced by a marker."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _KEY_IN_QUERY.sub(r"\1" + REDACTED, text)


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
    ``now``, default the wall clock, and never negative). Unparseable values are ignored.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(float(raw_ms) / 1000.0, 0.0)
        except ValueError:
            pass
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    reference = time.time() if now is None else now
    return max(when.timestamp() - reference, 0.0)


def _retry_delay_from_body(error: Mapping[str, Any]) -> float | None:
    """Gemini's ``details[{"@type": …RetryInfo, "retryDelay": "34.4s"}]``."""
    details = error.get("details")
    if not isinstance(details, list):
        return None
    for detail in details:
        if not isinstance(detail, Mapping):
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, str) and delay.endswith("s"):
            try:
                return max(float(delay[:-1]), 0.0)
            except ValueError:
                continue
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


def _classify(error: Mapping[str, Any]) -> tuple[str, bool] | None:
    for key in ("code", "type", "status"):
        value = error.get(key)
        if isinstance(value, str):
            found = _ERROR_WORDS.get(value.lower())
            if found is not None:
                return found
    for key in ("code", "status_code", "status"):
        value = error.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 400 <= value < 600:
            return kind_for_status(value)
    return None


def error_from_payload(
    payload: Any,
    *,
    provider: str,
    status_code: int | None = None,
    secrets: Iterable[str | None] = (),
) -> ProviderError:
    """A `ProviderError` for an error object met inside a 200 stream.

    ``payload`` is the decoded event (``{"error": {…}}``, ``{"type": "error", "error": {…}}``,
    a top-level ``code``/``message``, or Ollama's ``{"error": "…"}``). The kind comes from the
    error's ``code``/``type``/``status`` words, then from a numeric code; an unknown error is
    ``provider_error`` and retryable, since the stream, not the request, failed.
    """
    error = _error_object(payload) or {}
    kind, retryable = _classify(error) or ("provider_error", True)
    retry_after = _retry_delay_from_body(error)
    message = redact(f"{provider} stream error: {error_message(error)}", secrets)
    return ProviderError(
        message,
        kind=kind,
        retryable=retryable,
        status_code=status_code,
        retry_after=retry_after,
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
    try:
        decoded: Any = json.loads(body) if body.strip() else None
    except ValueError:
        decoded = None
    error = _error_object(decoded)
    if error is not None:
        detail = error_message(error)
        if retry_after is None:
            retry_after = _retry_delay_from_body(error)
    else:
        text = body.decode("utf-8", "replace").strip()
        if len(text) > _BODY_QUOTE_LIMIT:
            text = text[:_BODY_QUOTE_LIMIT] + "…"
        detail = text or httpx.codes.get_reason_phrase(status) or "no body"
    return ProviderError(
        redact(f"{provider} HTTP {status}: {detail}", secrets),
        kind=kind,
        retryable=retryable,
        status_code=status,
        retry_after=retry_after,
    )


def error_from_transport(
    exc: BaseException, *, provider: str, secrets: Iterable[str | None] = ()
) -> ProviderError:
    """A retryable ``connection`` error for a failed connect, read, timeout or dropped body."""
    detail = str(exc) or type(exc).__name__
    return ProviderError(
        redact(f"{provider} connection failed ({type(exc).__name__}): {detail}", secrets),
        kind="connection",
        retryable=True,
    )


# --------------------------------------------------------------------------- the request
async def post_stream(
    url: str,
    body: Mapping[str, Any],
    *,
    provider: str,
    headers: Mapping[str, str] | None = None,
    client: httpx.AsyncClient | None = None,
    secrets: Iterable[str | None] = (),
    timeout: httpx.Timeout | None = None,
) -> AsyncGenerator[bytes, None]:
    """POST ``body`` as JSON and yield the response body bytes as they arrive.

    An error status raises `error_from_response` (after reading the error body); a
    transport failure at any point raises `error_from_transport`. Without ``client`` a
    private ``httpx.AsyncClient`` is created and closed when the generator finishes. Wrap
    the generator in ``contextlib.aclosing`` so an abandoned stream is closed at once.
    """
    secret_list = tuple(s for s in secrets if s)
    own_client = client is None
    active = httpx.AsyncClient(timeout=timeout or DEFAULT_TIMEOUT) if client is None else client
    content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    request_headers = {"content-type": "application/json", **(headers or {})}
    extra: dict[str, Any] = {}
    if timeout is not None and not own_client:
        extra["timeout"] = timeout
    try:
        try:
            async with active.stream(
                "POST", url, content=content, headers=request_headers, **extra
            ) as response:
                if not response.is_success:
                    error_body = await response.aread()
                    raise error_from_response(
                        response.status_code,
                        response.headers,
                        error_body,
                        provider=provider,
                        secrets=secret_list,
                    )
                async for chunk in response.aiter_bytes():
                    yield chunk
        except httpx.TransportError as exc:
            # Not chained: the httpx exception holds the request, headers and key included.
            raise error_from_transport(exc, provider=provider, secrets=secret_list) from None
    finally:
        if own_client:
            await active.aclose()


__all__ = [
    "DEFAULT_TIMEOUT",
    "REDACTED",
    "error_from_payload",
    "error_from_response",
    "error_from_transport",
    "error_message",
    "kind_for_status",
    "parse_retry_after",
    "post_stream",
    "redact",
]
