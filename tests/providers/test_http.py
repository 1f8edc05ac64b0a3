"""HTTP plumbing: error bodies of every provider, retry hints and their bounds, status and
error kinds, what a response that is not a stream becomes, bounded reads of error bodies."""

from __future__ import annotations

import email.utils
import json
import math

import httpx
import pytest

from tests.providers.replay import ADAPTERS
from tests.providers.replay import REQUEST
from tests.providers.replay import adapter
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.provider import MAX_RETRY_AFTER
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers._http import error_from_payload
from toolloop_fsm.providers._http import error_from_response
from toolloop_fsm.providers._http import error_from_transport
from toolloop_fsm.providers._http import kind_for_status
from toolloop_fsm.providers._http import parse_retry_after
from toolloop_fsm.providers._http import post_stream
from toolloop_fsm.providers._secrecy import REDACTED
from toolloop_fsm.providers._secrecy import redact

NOW = 1_700_000_000.0
DAY = 24 * 60 * 60.0
KEY = "sk-bounds-0123456789abcdef"


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
        # bounded to [0, a day]; NaN is no hint at all
        ({"retry-after": "nan"}, None),
        ({"retry-after": "NaN"}, None),
        ({"retry-after": "inf"}, DAY),
        ({"retry-after": "-Infinity"}, 0.0),
        ({"retry-after": "-5"}, 0.0),
        ({"retry-after": "1e400"}, DAY),
        ({"retry-after": "99999999"}, DAY),
        ({"retry-after": email.utils.formatdate(NOW + 10 * DAY, usegmt=True)}, DAY),
        ({"retry-after-ms": "inf"}, DAY),
        ({"retry-after-ms": "nan", "retry-after": "4"}, 4.0),
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


@pytest.mark.parametrize(
    ("delays", "expected"),
    [(["infs"], DAY), (["nans", "5s"], 5.0), (["-3s"], 0.0), (["1e9s"], DAY), (["nans"], None)],
)
def test_retry_delay_in_a_body_is_bounded(delays: list[str], expected: float | None) -> None:
    details = [
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": d} for d in delays
    ]
    body = json.dumps({"error": {"code": 429, "message": "slow down", "details": details}})
    assert error_from_response(429, {}, body.encode(), provider="p").retry_after == expected
    assert error_from_payload(json.loads(body), provider="p").retry_after == expected


@pytest.mark.parametrize(
    ("given_", "held"),
    [
        (None, None),
        (3, 3.0),
        (2.5, 2.5),
        (math.nan, None),
        (math.inf, DAY),
        (-math.inf, 0.0),
        (-4, 0.0),
        (10**400, DAY),
        (DAY + 1, DAY),
    ],
)
def test_a_provider_error_only_ever_holds_a_usable_retry_after(
    given_: float | None, held: float | None
) -> None:
    error = ProviderError("m", kind="rate_limit", retryable=True, retry_after=given_)
    assert error.retry_after == held
    error.retry_after = given_
    assert error.retry_after == held
    assert MAX_RETRY_AFTER == DAY


def test_a_retry_after_that_is_not_a_number_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="retry_after"):
        ProviderError("m", kind="rate_limit", retryable=True, retry_after="7")  # type: ignore[arg-type]


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
        # LiteLLM sends the status as a string of digits
        ({"error": {"message": "m", "type": None, "code": "429"}}, "rate_limit", True),
        ({"error": {"message": "m", "type": None, "code": "500"}}, "server", True),
        ({"error": {"message": "m", "code": "503"}}, "server", True),
        ({"error": {"message": "m", "code": "400"}}, "bad_request", False),
        ({"error": {"message": "m", "status_code": "401"}}, "auth", False),
        ({"error": {"message": "m", "code": "1234"}}, "provider_error", True),
        (
            {"error": {"message": "Too many requests", "type": "throttling_error"}},
            "rate_limit",
            True,
        ),
        ({"error": {"message": "m", "type": "ThrottlingException"}}, "rate_limit", True),
        ({"type": "error", "code": "429", "message": "Rate limit reached"}, "rate_limit", True),
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


# ----------------------------------------------------------------------------- not a stream
def _stream_headers(kind: str) -> tuple[tuple[str, str], ...]:
    ndjson = kind == "ollama"
    return (("content-type", "application/x-ndjson" if ndjson else "text/event-stream"),)


async def _failure(source: Provider) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        _ = [chunk async for chunk in source.stream(REQUEST)]
    return caught.value


@pytest.mark.parametrize("body", [(), (b"",), (b"\n\n", b"  \r\n")], ids=["none", "empty", "blank"])
@pytest.mark.parametrize("kind", ADAPTERS)
async def test_an_empty_200_body_is_a_protocol_error_not_worth_repeating(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str, body: tuple[bytes, ...]
) -> None:
    wire_server.serve(Scripted(headers=_stream_headers(kind), chunks=body))
    error = await _failure(adapter(kind, wire_server.url, KEY, client))
    assert (error.kind, error.retryable, error.status_code) == ("protocol", False, 200)
    assert "empty body" in error.message


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_an_error_object_answered_with_200_instead_of_a_stream_is_classified(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    # Some gateways answer a failure with 200 and a JSON error (a list of one, for Gemini).
    error_object = {"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}
    document = [error_object] if kind == "gemini" else error_object
    wire_server.serve(
        Scripted(
            headers=(("content-type", "application/json"), ("retry-after", "12")),
            chunks=(json.dumps(document).encode(),),
        )
    )
    error = await _failure(adapter(kind, wire_server.url, KEY, client))
    if kind == "ollama":
        # Ollama's own stream reports errors as {"error": …} lines: this is one.
        assert (error.kind, error.retryable) == ("rate_limit", True)
    else:
        assert (error.kind, error.retryable, error.retry_after) == ("rate_limit", True, 12.0)
    assert "Rate limit reached" in error.message


@pytest.mark.parametrize("kind", [k for k in ADAPTERS if k != "ollama"])
async def test_a_non_streamed_json_reply_is_a_protocol_error_quoting_it(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    # A server that ignored "stream": true and answered the whole reply at once.
    reply = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0}]}
    wire_server.serve(
        Scripted(
            headers=(("content-type", "application/json"),), chunks=(json.dumps(reply).encode(),)
        )
    )
    error = await _failure(adapter(kind, wire_server.url, KEY, client))
    assert (error.kind, error.retryable) == ("protocol", False)
    assert "instead of a stream" in error.message and "chat.completion" in error.message


# ----------------------------------------------------------------------------- bounded reads
HUGE = 32 * 1024 * 1024
_PIECE = b"x" * 65536


@pytest.mark.parametrize(
    ("status", "content_type", "first"),
    [(500, "text/plain", b"<"), (200, "text/html", b"<"), (200, "application/json", b"[")],
    ids=["error-status", "html-page", "json-document"],
)
@pytest.mark.parametrize("kind", ADAPTERS)
async def test_a_huge_body_that_is_not_a_stream_is_read_only_to_64_kib_then_dropped(
    wire_server: WireServer,
    client: httpx.AsyncClient,
    kind: str,
    status: int,
    content_type: str,
    first: bytes,
) -> None:
    # 32 MB that the adapter must not read: it takes 64 KiB, closes, and reports.
    chunks = (first + _PIECE[1:], *(_PIECE,) * (HUGE // len(_PIECE) - 1))
    wire_server.serve(
        Scripted(status=status, headers=(("content-type", content_type),), chunks=chunks)
    )
    error = await _failure(adapter(kind, wire_server.url, KEY, client))
    assert error.status_code == status and len(error.message) < 700
    # the server sees the client go long before the body is out: what it managed to write
    # is what the socket buffers took, not the 32 MB
    await wire_server.client_gone.wait()
    assert wire_server.body_bytes_sent < HUGE // 4
