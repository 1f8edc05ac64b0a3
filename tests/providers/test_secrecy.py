"""No API key, nor any piece of 8 or more of its characters, leaves an adapter: not in an
error's message, its repr or args, an exception chained to it, nor the provider's repr —
whatever the server echoes, wherever a message cuts it, and for every adapter."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers.replay import ADAPTERS
from tests.providers.replay import REQUEST
from tests.providers.replay import adapter
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers._http import error_from_response
from toolloop_fsm.providers._secrecy import FRAGMENT
from toolloop_fsm.providers._secrecy import REDACTED
from toolloop_fsm.providers._secrecy import header_secrets
from toolloop_fsm.providers._secrecy import quote
from toolloop_fsm.providers._secrecy import redact

KEY = "sk-live-0123456789abcdefGHIJKLMNOPqrstuv"
SSE = (("content-type", "text/event-stream"),)
NDJSON = (("content-type", "application/x-ndjson"),)
STREAM_HEADERS = {kind: NDJSON if kind == "ollama" else SSE for kind in ADAPTERS}


def pieces_of_key(text: str, key: str = KEY) -> list[str]:
    """Every run of `FRAGMENT` characters of ``key`` that ``text`` still holds."""
    return [
        key[i : i + FRAGMENT]
        for i in range(len(key) - FRAGMENT + 1)
        if key[i : i + FRAGMENT] in text
    ]


def every_text_of(error: BaseException) -> str:
    """All a log or a traceback could show of ``error``."""
    return "\n".join([str(error), repr(error), *map(repr, error.args)])


async def failure_of(source: Provider) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        _ = [chunk async for chunk in source.stream(REQUEST)]
    return caught.value


def assert_no_key_in(error: ProviderError) -> None:
    assert pieces_of_key(every_text_of(error)) == []
    assert error.__cause__ is None and error.__context__ is None


# --------------------------------------------------------------------------- the rule
def test_every_eight_character_run_of_a_key_is_redacted() -> None:
    text = f"head {KEY[:8]} middle {KEY[5:19]} tail {KEY[-9:]} whole {KEY} end"
    redacted = redact(text, [KEY])
    assert pieces_of_key(redacted) == []
    assert redacted == (f"head {REDACTED} middle {REDACTED} tail {REDACTED} whole {REDACTED} end")


def test_seven_characters_of_a_key_are_ordinary_text() -> None:
    # Shorter runs would redact ordinary words ("sk-live" starts many keys).
    assert redact(f"see {KEY[:7]}", [KEY]) == f"see {KEY[:7]}"


def test_a_key_shorter_than_eight_characters_is_redacted_only_whole() -> None:
    assert redact("pin 12345 and 1234", ["12345"]) == f"pin {REDACTED} and 1234"


def test_credentials_in_urls_and_query_strings_are_redacted() -> None:
    text = "GET https://bob:hunter2@proxy.example/v1?alt=sse&key=AIzaQUERY failed"
    assert redact(text) == (
        f"GET https://{REDACTED}@proxy.example/v1?alt=sse&key={REDACTED} failed"
    )


def test_credential_headers_and_their_bare_credentials_are_secrets() -> None:
    headers = {
        "Authorization": f"Bearer {KEY}",
        "x-goog-api-key": "AIza-direct",
        "Proxy-Authorization": "Basic Ym9iOmh1bnRlcjI=",
        "accept": "text/event-stream",
        "anthropic-version": "2023-06-01",
    }
    assert header_secrets(headers) == (
        f"Bearer {KEY}",
        KEY,
        "AIza-direct",
        "Basic Ym9iOmh1bnRlcjI=",
        "Ym9iOmh1bnRlcjI=",
    )


_KEYS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEF0123456789-_", min_size=8, max_size=64)
_FILLER = st.text(alphabet=" .:=\"'xyzXYZ{}[]()/é—", max_size=40)


@settings(max_examples=150)
@given(data=st.data(), key=_KEYS)
def test_no_piece_of_a_key_survives_redaction_then_any_cut(data: st.DataObject, key: str) -> None:
    slices = st.tuples(st.integers(0, len(key)), st.integers(0, len(key))).map(
        lambda bounds: key[min(bounds) : max(bounds)]
    )
    parts = data.draw(st.lists(st.one_of(_FILLER, slices, st.just(key)), max_size=12))
    text = "".join(parts)
    limit = data.draw(st.integers(0, len(text) + 1), label="cut")
    for shown in (redact(text, [key]), quote(text, [key], limit)):
        assert pieces_of_key(shown, key) == []


def test_a_key_crossing_the_quote_cut_of_an_error_body_leaves_no_piece() -> None:
    # The body is quoted to 500 characters; the key starts 10 characters before that cut.
    body = ("x" * 490 + KEY + " and more").encode()
    error = error_from_response(502, {}, body, provider="p", secrets=[KEY])
    assert pieces_of_key(error.message) == []
    assert REDACTED in error.message


# --------------------------------------------------------------------------- over the wire
def _echo_page(kind: str) -> bytes:
    """A proxy's page that shows the request headers, the secret among them."""
    return (
        "<html><body><h1>Request rejected</h1><pre>\n"
        "accept: text/event-stream\n"
        f"x-api-key: {KEY}\n"
        f"authorization: Bearer {KEY}\n"
        f"({kind})</pre></body></html>\n"
    ).encode()


_NOT_A_STREAM = {
    # an HTML page in place of the stream
    "html-page": lambda kind: Scripted(
        headers=(("content-type", "text/html"),), chunks=(_echo_page(kind),)
    ),
    # plain text where the stream's first line should be, under the stream's own content type
    "text-line": lambda kind: Scripted(
        headers=STREAM_HEADERS[kind],
        chunks=(f"Bad request. Your headers: authorization: Bearer {KEY}\n".encode(),),
    ),
    # a JSON document that echoes the request, under a JSON content type
    "json-document": lambda kind: Scripted(
        headers=(("content-type", "application/json"),),
        chunks=(json.dumps({"echo": {"headers": {"x-api-key": KEY}}}).encode(),),
    ),
}


@pytest.mark.parametrize("shape", sorted(_NOT_A_STREAM))
@pytest.mark.parametrize("kind", ADAPTERS)
async def test_key_echoed_in_a_200_body_that_is_not_a_stream_is_redacted(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str, shape: str
) -> None:
    wire_server.serve(_NOT_A_STREAM[shape](kind))
    error = await failure_of(adapter(kind, wire_server.url, KEY, client))
    # To Ollama a JSON object is a line of its stream, one that never says it is done.
    # (Ollama reads a JSON document as one NDJSON line without done: a cut, also protocol)
    assert error.kind == "protocol"
    assert_no_key_in(error)


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_a_key_crossing_the_cut_of_an_error_body_leaves_no_piece_in_any_adapter(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    # The body is quoted to 500 characters; the key starts 10 characters before that cut.
    body = ("upstream said: " + "x" * 475 + f"{KEY} was refused").encode()
    wire_server.serve(
        Scripted(status=502, headers=(("content-type", "text/plain"),), chunks=(body,))
    )
    error = await failure_of(adapter(kind, wire_server.url, KEY, client))
    assert (error.kind, error.status_code) == ("server", 502)
    assert_no_key_in(error)


def _in_stream_error(kind: str, message: str) -> bytes:
    """An error met inside a 200 stream, in the adapter's own framing."""
    if kind == "ollama":
        return json.dumps({"error": message}).encode() + b"\n"
    if kind == "anthropic":
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
    if kind == "openai-responses":
        payload = {"type": "error", "code": "server_error", "message": message}
        return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
    return b"data: " + json.dumps({"error": {"message": message, "code": 500}}).encode() + b"\n\n"


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_a_partly_masked_key_in_an_in_stream_error_leaves_no_piece(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    # A server that masks the middle of the key it quotes still shows its head and tail.
    masked = f"invalid key {KEY[:10]}****{KEY[-12:]} for this model"
    wire_server.serve(
        Scripted(headers=STREAM_HEADERS[kind], chunks=(_in_stream_error(kind, masked),))
    )
    error = await failure_of(adapter(kind, wire_server.url, KEY, client))
    assert "for this model" in error.message
    assert_no_key_in(error)


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_a_connection_failure_carries_no_httpx_exception(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    # An httpx exception holds the request, and the request holds the headers.
    url = wire_server.url
    await wire_server.close()
    error = await failure_of(adapter(kind, url, KEY, client))
    assert (error.kind, error.retryable) == ("connection", True)
    assert_no_key_in(error)


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_a_stream_event_that_is_not_json_carries_no_json_error(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    # A JSON error holds the whole bad text in its `doc`, key and all.
    bad = f'{{"echo": "authorization: Bearer {KEY}", oops'.encode()
    body = bad + b"\n" if kind == "ollama" else b"data: " + bad + b"\n\n"
    wire_server.serve(Scripted(headers=STREAM_HEADERS[kind], chunks=(body,)))
    error = await failure_of(adapter(kind, wire_server.url, KEY, client))
    assert error.kind == "protocol"
    assert_no_key_in(error)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_provider_repr_holds_no_key_even_in_its_base_url(kind: str) -> None:
    source = adapter(kind, f"https://user:{KEY}@api.example.test?key={KEY}", KEY)
    assert pieces_of_key(repr(source)) == []
    assert "api.example.test" in repr(source)
