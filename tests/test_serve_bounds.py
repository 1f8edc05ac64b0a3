"""`toolloop-fsm serve`'s HTTP layer under attack: garbage, huge heads and bodies, slow and
idle clients, too many connections, clients that never read. Every bound is injected tiny
(`ServeLimits`), and a test waits for what the client sees (an answer, then end of file),
never for a span of the real clock."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import socket
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm.demo import ANSWERING_MODEL
from toolloop_fsm.demo import DemoServer
from toolloop_fsm.demo_http import BoundedHttpServer
from toolloop_fsm.demo_http import HttpRequest
from toolloop_fsm.demo_http import Reply
from toolloop_fsm.demo_http import ServeLimits

#: Generous bounds but one, so a test meets only the bound it is about.
ROOMY = ServeLimits(idle_timeout=600, request_timeout=600, write_timeout=600, linger_timeout=600)

MODELS = b"GET /v1/models HTTP/1.1\r\nhost: demo\r\n\r\n"


def completion(**extra: Any) -> dict[str, Any]:
    return {
        "model": ANSWERING_MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "What's the weather like in Paris today?"}],
        **extra,
    }


def post_head(length: int, *extra: str) -> bytes:
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "host: demo",
        "content-type: application/json",
        f"content-length: {length}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Wire:
    """A raw TCP client: exactly the bytes a test writes, and whatever comes back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def to(cls, server: DemoServer, receive_buffer: int | None = None) -> Wire:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # before connecting, so the window starts small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
        return cls(*await asyncio.open_connection(sock=sock))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_closed(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        try:
            return await self.reader.read()
        except ConnectionResetError:
            return b""

    async def response(self) -> tuple[int, bytes]:
        """The next whole response of known length: its status and body."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        found = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
        body = await self.reader.readexactly(int(found.group(1))) if found else b""
        return status, body

    def close(self) -> None:
        self.writer.transport.abort()


def status_of(answer: bytes) -> int:
    found = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert found is not None, answer[:200]
    return int(found.group(1))


def error_of(answer: bytes) -> dict[str, Any]:
    """The OpenAI-shaped error an answer carries, checked for its four keys."""
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.fixture
async def unhandled(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """What escaped the server: exceptions the loop saw and errors it logged (both must stay
    empty: a bad client gets an answer, never a traceback)."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: seen.append(context))
    caplog.set_level(logging.WARNING)
    return seen


async def serving(limits: ServeLimits) -> AsyncIterator[DemoServer]:
    async with DemoServer(limits=limits) as server:
        yield server


@pytest.fixture
async def roomy() -> AsyncIterator[DemoServer]:
    async for server in serving(ROOMY):
        yield server


def assert_nothing_escaped(
    unhandled: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    assert unhandled == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def assert_still_answers(server: DemoServer) -> None:
    wire = await Wire.to(server)
    await wire.send(MODELS)
    status, body = await wire.response()
    wire.close()
    assert status == 200 and json.loads(body)["object"] == "list"


# --------------------------------------------------------------------------- garbage
GARBAGE = {
    "binary": b"\x00\x01\x02\xff\xfe\r\n\r\n",
    "no target": b"GET\r\n\r\n",
    "no host": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "a length that is not a number": post_head(0).replace(
        b"content-length: 0", b"content-length: x"
    ),
    "two lengths": post_head(2, "content-length: 3") + b"{}",
    "a header without a colon": b"GET /v1/models HTTP/1.1\r\nhost: demo\r\nnonsense\r\n\r\n",
    "a bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nhost: demo\r\n"
    b"transfer-encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
async def test_garbage_gets_an_openai_shaped_400_and_the_server_serves_on(
    roomy: DemoServer,
    garbage: bytes,
    unhandled: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    wire = await Wire.to(roomy)
    await wire.send(garbage)
    answer = await wire.until_closed()
    assert status_of(answer) == 400
    assert error_of(answer)["code"] == "bad_http_request"
    assert b"connection: close" in answer.lower()
    await assert_still_answers(roomy)
    assert_nothing_escaped(unhandled, caplog)


async def test_a_client_that_hangs_up_mid_request_costs_nothing(
    roomy: DemoServer, unhandled: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    wire = await Wire.to(roomy)
    await wire.send(post_head(100) + b'{"model": ')
    wire.writer.write_eof()
    await wire.until_closed()
    assert roomy.open_connections == 0
    await assert_still_answers(roomy)
    assert_nothing_escaped(unhandled, caplog)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=300))
async def test_any_bytes_then_a_hang_up_get_an_http_answer_or_a_close(
    roomy: DemoServer, garbage: bytes, unhandled: list[dict[str, Any]]
) -> None:
    wire = await Wire.to(roomy)
    await wire.send(garbage)
    wire.writer.write_eof()
    answer = await wire.until_closed()
    if answer:
        assert status_of(answer) in (400, 404, 405, 413, 431)
    assert unhandled == []


# --------------------------------------------------------------------------- heads and bodies
async def test_a_head_over_the_header_limit_gets_431() -> None:
    async for server in serving(ServeLimits(max_header_bytes=1024, linger_timeout=600)):
        wire = await Wire.to(server)
        await wire.send(b"GET /v1/models HTTP/1.1\r\nhost: demo\r\nx-pad: " + b"a" * 4096)
        wire.writer.write_eof()
        answer = await wire.until_closed()
        assert status_of(answer) == 431
        assert error_of(answer)["code"] == "request_header_fields_too_large"


async def test_a_declared_body_over_the_limit_gets_413_before_any_of_it_is_read() -> None:
    async for server in serving(ServeLimits(max_body_bytes=1024, linger_timeout=600)):
        wire = await Wire.to(server)
        await wire.send(post_head(10 * 1024 * 1024))  # and not one byte of the body
        status, body = await wire.response()
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
        wire.close()


async def test_a_client_waiting_for_100_continue_with_too_large_a_body_gets_413_not_100() -> None:
    async for server in serving(ServeLimits(max_body_bytes=1024, linger_timeout=600)):
        wire = await Wire.to(server)
        await wire.send(post_head(4096, "expect: 100-continue"))
        wire.writer.write_eof()
        answer = await wire.until_closed()
        assert status_of(answer) == 413
        assert b"100 Continue" not in answer


async def test_a_chunked_body_that_grows_past_the_limit_gets_413() -> None:
    async for server in serving(ServeLimits(max_body_bytes=1024, linger_timeout=600)):
        wire = await Wire.to(server)
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: demo\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunk = b"200\r\n" + b" " * 0x200 + b"\r\n"
        await wire.send(head + chunk * 3)  # 1536 bytes, no size declared up front
        wire.writer.write_eof()
        answer = await wire.until_closed()
        assert status_of(answer) == 413


async def test_httpx_posting_too_large_a_body_reads_the_413() -> None:
    async for server in serving(ServeLimits(max_body_bytes=1024)):
        async with httpx.AsyncClient() as client:
            huge = completion(messages=[{"role": "user", "content": "x" * 4096}])
            response = await client.post(f"{server.base_url}/chat/completions", json=huge)
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "invalid_request_error"


async def test_a_client_waiting_for_100_continue_gets_it_then_its_answer(
    roomy: DemoServer,
) -> None:
    body = json.dumps(completion()).encode()
    wire = await Wire.to(roomy)
    await wire.send(post_head(len(body), "expect: 100-continue"))
    assert await wire.reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    await wire.send(body)
    head = await wire.reader.readuntil(b"\r\n\r\n")
    assert status_of(head) == 200 and b"text/event-stream" in head
    wire.close()


async def test_many_large_bodies_leave_nothing_behind() -> None:
    body = completion(messages=[{"role": "user", "content": "Paris? " + "x" * 2_000_000}])
    async with DemoServer() as server, httpx.AsyncClient() as client:
        url = f"{server.base_url}/chat/completions"
        await client.post(url, json=body)  # the first one warms every cache
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(20):  # 40 MB through the server
                response = await client.post(url, json=body)
                assert response.status_code == 200 and b"[DONE]" in response.content
            del response
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert server.requests == []
    assert kept < 2_000_000, f"{kept} bytes kept after 20 bodies of 2 MB"


# --------------------------------------------------------------------------- slow and idle
async def test_an_idle_connection_is_closed() -> None:
    async for server in serving(ServeLimits(idle_timeout=0.01)):
        wire = await Wire.to(server)
        assert await wire.until_closed() == b""


async def test_a_kept_alive_connection_is_closed_once_idle() -> None:
    async for server in serving(ServeLimits(idle_timeout=0.01)):
        wire = await Wire.to(server)
        await wire.send(MODELS)
        status, _body = await wire.response()
        assert status == 200
        assert await wire.until_closed() == b""  # no second request: closed, quietly


async def test_a_request_that_stalls_halfway_gets_408() -> None:
    async for server in serving(ServeLimits(request_timeout=0.01, linger_timeout=600)):
        wire = await Wire.to(server)
        await wire.send(post_head(100) + b'{"model": "ste')
        answer = await wire.until_closed()
        assert status_of(answer) == 408
        assert error_of(answer)["code"] == "request_timeout"


async def test_a_client_trickling_its_body_forever_gets_408() -> None:
    limits = ServeLimits(max_body_bytes=10**9, request_timeout=0.05, linger_timeout=0.05)
    async for server in serving(limits):
        wire = await Wire.to(server)
        await wire.send(post_head(10**9))
        answered = asyncio.ensure_future(wire.reader.readuntil(b"\r\n\r\n"))
        while not answered.done():  # a byte at a time, never idle, never done
            await wire.send(b" ")
            await asyncio.sleep(0)
        assert status_of(answered.result()) == 408
        wire.close()


async def test_a_client_that_never_reads_its_answers_is_dropped() -> None:
    body = json.dumps(completion()).encode()
    async for server in serving(ServeLimits(write_timeout=0.01, idle_timeout=600)):
        wire = await Wire.to(server, receive_buffer=4096)
        # pipelined streams, megabytes of answers, and not one byte of them read
        wire.writer.write((post_head(len(body)) + body) * 2000)
        while not server.open_connections:  # accepted...
            await asyncio.sleep(0)
        while server.open_connections:  # ...and dropped, its writes stuck for write_timeout
            await asyncio.sleep(0)
        await wire.until_closed()  # what was sent before the drop, then the end
        wire.close()


# --------------------------------------------------------------------------- connections
async def test_a_connection_over_the_limit_gets_503_and_the_held_ones_are_served() -> None:
    async for server in serving(ServeLimits(max_connections=2, idle_timeout=600)):
        held = [await Wire.to(server) for _ in range(2)]
        for wire in held:  # answered once each: the server holds both
            await wire.send(MODELS)
            assert (await wire.response())[0] == 200
        extra = await Wire.to(server)
        await extra.send(MODELS)
        answer = await extra.until_closed()
        assert status_of(answer) == 503
        assert error_of(answer) == {
            "message": "the server holds 2 connections already; try again later",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
        await held[0].send(MODELS)  # the held ones are still served
        assert (await held[0].response())[0] == 200
        held[1].close()
        while server.open_connections > 1:
            await asyncio.sleep(0)
        await assert_still_answers(server)  # a place freed is a place given
        held[0].close()


async def test_closing_the_server_ends_its_idle_connections() -> None:
    server = DemoServer(limits=ROOMY)
    async with server:
        wire = await Wire.to(server)
        await wire.send(MODELS)
        assert (await wire.response())[0] == 200
    assert await wire.until_closed() == b""
    assert server.open_connections == 0


def test_limits_that_are_not_positive_are_refused_naming_the_bound() -> None:
    with pytest.raises(ValueError, match="idle_timeout"):
        ServeLimits(idle_timeout=0)
    with pytest.raises(ValueError, match="max_connections"):
        ServeLimits(max_connections=-1)


def test_the_default_connection_limit_holds_the_benchmarks_200_concurrent_turns() -> None:
    assert ServeLimits().max_connections > 200
    assert ServeLimits().max_body_bytes == 8 * 1024 * 1024


async def test_250_concurrent_streams_are_all_served_under_the_default_limits() -> None:
    body = completion(tools=[{"type": "function", "function": {"name": "get_weather"}}])
    pool = httpx.Limits(max_connections=250, max_keepalive_connections=250)
    async with DemoServer() as server, httpx.AsyncClient(limits=pool, timeout=None) as client:
        url = f"{server.base_url}/chat/completions"
        responses = await asyncio.gather(*(client.post(url, json=body) for _ in range(250)))
    assert [r.status_code for r in responses] == [200] * 250
    assert all(r.text.endswith("data: [DONE]\n\n") for r in responses)


async def test_a_fault_of_the_servers_own_is_a_500_and_a_logged_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def failing(request: HttpRequest) -> Reply:
        raise RuntimeError(f"no answer for {request.path}")

    server = BoundedHttpServer(failing, ROOMY)
    await server.start()
    try:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://{server.host}:{server.port}/v1/models")
    finally:
        await server.close()
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    (record,) = [r for r in caplog.records if r.name == "toolloop_fsm.demo_http"]
    assert record.exc_info is not None and "no answer for /v1/models" in str(record.exc_info[1])


async def test_refusals_are_bounded_too_past_them_a_connection_is_reset_unanswered() -> None:
    async for server in serving(
        ServeLimits(max_connections=1, idle_timeout=600, linger_timeout=600)
    ):
        held = await Wire.to(server)
        await held.send(MODELS)
        assert (await held.response())[0] == 200
        refused = await Wire.to(server)
        await refused.send(MODELS)
        assert (await refused.response())[0] == 503  # and left open: the refusal lingers
        reset = await Wire.to(server)
        await reset.send(MODELS)
        assert await reset.until_closed() == b""
        for wire in (held, refused, reset):
            wire.close()
