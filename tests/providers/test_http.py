"""HTTP plumbing: error bodies of every provider, retry hints, status kinds, key redaction."""

from __future__ import annotations

import email.utils
import json

import httpx
import pytest

from tests.providers.wire_server import Scripted, WireServer
from toolloop_fsm.providers._http import (
    REDACTED,
    error_from_payload,
    error_from_response,
    error_from_transport,
    kind_for_status,
    parse_retry_after,
    post_stream,
    redact,
)
from toolloop_fsm.providers.base import ProviderError

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500"}, 1.5),
        ({"Retry-After-Ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"retry-after": email.utils.formatdate(NOW + 42, usegmt=True)}, 42.0),
        ({"retry-after": email.utils.formatdate(NOW - 42, usegmt=True)}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after-ms": "x"}, None),
        ({}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers, now=NOW) == expected


@pytest.mark.parametrize(
    ("body", "status", "message", "kind", "retry_after"),
    [
        (  # OpenAI
            {
                "error": {
                    "message": "Invalid value",
                    "type": "invalid_request_error",
                    "param": "t",
                    "code": "decimal_below_min_value",
                }
            },
            400,
            "Invalid value [invalid_request_error, decimal_below_min_value]",
            "bad_request",
            None,
        ),
        (  # OpenRouter: integer code, the useful text in metadata.raw
            {
                "error": {
                    "code": 429,
                    "message": "Provider returned error",
                    "metadata": {"provider_name": "Google", "raw": "rate-limited upstream"},
                }
            },
            429,
            "Provider returned error (Google): rate-limited upstream [429]",
            "rate_limit",
            None,
        ),
        (  # Gemini, with RetryInfo
            {
                "error": {
                    "code": 429,
                    "message": "Quota exceeded",
                    "status": "RESOURCE_EXHAUSTED",
                    "details": [
                        {"@type": "type.googleapis.com/google.rpc.QuotaFailure"},
                        {
                            "@type": "type.googleapis.com/google.rpc.RetryInfo",
                            "retryDelay": "34.4s",
                        },
                    ],
                }
            },
            429,
            "Quota exceeded [429, RESOURCE_EXHAUSTED]",
            "rate_limit",
            34.4,
        ),
        (  # Gemini 503
            {
                "error": {
                    "code": 503,
                    "message": "The model is overloaded. Please try again later.",
                    "status": "UNAVAILABLE",
                }
            },
            503,
            "The model is overloaded. Please try again later. [503, UNAVAILABLE]",
            "server",
            None,
        ),
        (  # Anthropic
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
                "request_id": "req_1",
            },
            529,
            "Overloaded [overloaded_error]",
            "server",
            None,
        ),
        ({"error": "model 'x' not found"}, 404, "model 'x' not found", "not_found", None),  # Ollama
    ],
)
def test_error_bodies_of_every_provider(
    body: object, status: int, message: str, kind: str, retry_after: float | None
) -> None:
    error = error_from_response(status, {}, json.dumps(body).encode(), provider="p")
    assert error.message == f"p HTTP {status}: {message}"
    assert (error.kind, error.status_code, error.retry_after) == (kind, status, retry_after)


def test_header_retry_hint_wins_over_body() -> None:
    body = b'{"error": {"message": "m", "details": [{"retryDelay": "34s"}]}}'
    assert error_from_response(429, {"retry-after": "3"}, body, provider="p").retry_after == 3.0


def test_unreadable_body_is_quoted_and_cut() -> None:
    error = error_from_response(502, {}, b"<html>" + b"x" * 2000, provider="p")
    assert error.message.startswith("p HTTP 502: <html>xxx") and len(error.message) < 600
    assert (
        error_from_response(503, {}, b"", provider="p").message == "p HTTP 503: Service Unavailable"
    )


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (429, ("rate_limit", True)),
        (500, ("server", True)),
        (503, ("server", True)),
        (529, ("server", True)),
        (408, ("server", True)),
        (409, ("server", True)),
        (400, ("bad_request", False)),
        (422, ("bad_request", False)),
        (404, ("not_found", False)),
        (401, ("auth", False)),
        (403, ("auth", False)),
        (402, ("provider_error", False)),
    ],
)
def test_kind_for_status(status: int, expected: tuple[str, bool]) -> None:
    assert kind_for_status(status) == expected


@pytest.mark.parametrize(
    ("payload", "kind", "retryable"),
    [
        (
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
            "server",
            True,
        ),
        ({"error": {"type": "rate_limit_error", "message": "slow"}}, "rate_limit", True),
        (
            {"error": {"type": "invalid_request_error", "code": "tool_use_failed", "message": "m"}},
            "bad_request",
            False,
        ),
        ({"type": "error", "code": "server_error", "message": "m"}, "server", True),
        ({"error": "an error was encountered while running the model"}, "provider_error", True),
        ({"error": {"code": 400, "message": "Token limit reached"}}, "bad_request", False),
    ],
)
def test_in_stream_error_payloads(payload: object, kind: str, retryable: bool) -> None:
    error = error_from_payload(payload, provider="p")
    assert (error.kind, error.retryable) == (kind, retryable)


def test_redact_removes_keys_and_query_keys() -> None:
    text = "POST https://x/v1beta/models/m:stream?alt=sse&key=AIzaSECRET failed for sk-live-1"
    assert redact(text, ["sk-live-1", None, ""]) == (
        f"POST https://x/v1beta/models/m:stream?alt=sse&key={REDACTED} failed for {REDACTED}"
    )


def test_transport_error_is_connection_and_redacted() -> None:
    error = error_from_transport(
        httpx.ConnectError("refused for key=abc and sk-9"), provider="p", secrets=["sk-9"]
    )
    assert (error.kind, error.retryable) == ("connection", True)
    assert "abc" not in error.message and "sk-9" not in error.message


async def test_post_stream_sends_json_and_headers(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(chunks=(b"one", b"two"), headers=(("content-type", "text/plain"),)))
    got = [
        c
        async for c in post_stream(
            wire_server.url + "/p", {"é": 1}, provider="p", headers={"x-api-key": "k"}
        )
    ]
    assert b"".join(got) == b"onetwo"
    [sent] = wire_server.requests
    assert json.loads(sent.body) == {"é": 1}
    assert sent.header("content-type") == "application/json" and sent.header("x-api-key") == "k"


async def test_post_stream_error_status_reads_the_body(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(status=500, headers=(), chunks=(b'{"error": {"message": "boom"}}',)))
    with pytest.raises(ProviderError, match="boom") as caught:
        _ = [c async for c in post_stream(wire_server.url, {}, provider="p")]
    assert (caught.value.kind, caught.value.status_code) == ("server", 500)
