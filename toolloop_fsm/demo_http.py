"""The demo server's HTTP layer: HTTP/1.1 on loopback over h11, bounded in every dimension.

`ServeLimits` holds every bound in one place. `BoundedHttpServer` owns the connections: it
parses with h11 (which owns the protocol — framing, keep-alive, chunked bodies, the header
size limit), reads one whole request under its limits, asks a synchronous ``answer`` for a
`Reply`, writes it, and keeps the connection for the next request. What it keeps between
requests is the connection and nothing else: a body is dropped once answered.

The bounds and what a client sees when it crosses one:

- more than ``max_connections`` connections at once: ``503`` and the connection is closed
  (and once as many refusals are lingering, a reset without an answer);
- a request head larger than ``max_header_bytes``: ``431``; a head h11 cannot parse: ``400``;
- a body larger than ``max_body_bytes`` (declared, or counted as a chunked body arrives):
  ``413``, without ``100 Continue`` when the client waits for one;
- a request not whole ``request_timeout`` seconds after its first byte (a slow client):
  ``408``;
- no request ``idle_timeout`` seconds after the previous one (or after connecting): closed;
- a client that does not read what is sent for ``write_timeout`` seconds: aborted.

After an error the server says ``connection: close``, stops writing, and reads and drops what
the client still sends for at most ``linger_timeout`` seconds, so the client reads the answer
rather than a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import attrs
import h11
from attrs import field
from attrs import frozen
from attrs import validators

_log = logging.getLogger(__name__)

#: How much one read of the socket asks for.
_READ_SIZE = 64 * 1024

_positive = validators.gt(0)
_positive_seconds = validators.gt(0.0)


@frozen
class ServeLimits:
    """Every bound of the demo server; tests pass tiny ones."""

    max_body_bytes: int = field(default=8 * 1024 * 1024, validator=_positive)
    max_header_bytes: int = field(default=16 * 1024, validator=_positive)
    #: above the 200 concurrent turns the Temporal benchmark runs against the server
    max_connections: int = field(default=512, validator=_positive)
    #: longer than httpx's 5 s keep-alive expiry, so a pooled client drops an idle
    #: connection before the server does (no request races a close)
    idle_timeout: float = field(default=15.0, validator=_positive_seconds)
    request_timeout: float = field(default=30.0, validator=_positive_seconds)
    write_timeout: float = field(default=30.0, validator=_positive_seconds)
    linger_timeout: float = field(default=2.0, validator=_positive_seconds)


@frozen
class HttpRequest:
    """One whole request as the server read it."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def path(self) -> str:
        """The target without its query."""
        return self.target.partition("?")[0]


@frozen
class Reply:
    """What an answer sends back: a body in parts. A ``streamed`` reply is sent part by part
    as it is (server-sent events, chunked); any other is sent with its length."""

    status: int
    content_type: str
    parts: tuple[bytes, ...]
    headers: tuple[tuple[str, str], ...] = ()
    streamed: bool = False


def json_reply(status: int, body: Any, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, "application/json", (json.dumps(body).encode(),), headers)


def api_error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> Reply:
    """An error in the OpenAI API's shape (``{"error": {message, type, param, code}}``)."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json_reply(status, {"error": error}, headers)


def event_stream(frames: list[bytes]) -> Reply:
    return Reply(
        200,
        "text/event-stream; charset=utf-8",
        tuple(frames),
        (("cache-control", "no-cache"),),
        streamed=True,
    )


class _Refused(Exception):
    """The request cannot be answered; the connection closes after ``reply``."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


def _refusal(status: int, message: str, code: str) -> _Refused:
    return _Refused(api_error(status, message, code=code))


@attrs.define
class BoundedHttpServer:
    """Serves ``answer`` on ``host:port`` within ``limits`` until closed."""

    answer: Callable[[HttpRequest], Reply]
    limits: ServeLimits = attrs.Factory(ServeLimits)
    host: str = "127.0.0.1"
    port: int = 0
    _server: asyncio.Server | None = attrs.field(default=None, repr=False)
    _connections: dict[asyncio.Task[None], asyncio.StreamWriter] = attrs.field(
        factory=dict, repr=False
    )
    _refusing: set[asyncio.StreamWriter] = attrs.field(factory=set, repr=False)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connected, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end every connection (an idle keep-alive one included)."""
        if self._server is not None:
            self._server.close()
        # a reset connection ends its handler as a client hanging up does (reads end, writes
        # fail), where cancelling it would leave 3.11's start_server logging the cancellation
        for writer in (*self._connections.values(), *self._refusing):
            writer.transport.abort()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        task = asyncio.current_task()
        assert task is not None
        try:
            if len(self._connections) >= self.limits.max_connections:
                if len(self._refusing) >= self.limits.max_connections:
                    return  # as many refusals lingering as connections held: reset at once
                busy = api_error(
                    503,
                    f"the server holds {self.limits.max_connections} connections already; "
                    "try again later",
                    kind="server_error",
                    code="too_many_connections",
                )
                self._refusing.add(writer)
                try:
                    await self._refuse(conn, reader, writer, busy)
                finally:
                    self._refusing.discard(writer)
                return
            self._connections[task] = writer
            await self._converse(conn, reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or would not read what it was sent
        except asyncio.CancelledError:
            if sys.version_info >= (3, 12):
                raise
            # 3.11's start_server callback asks a cancelled handler for its exception and
            # logs the CancelledError as a traceback (fixed in 3.12): end quietly instead
        finally:
            self._connections.pop(task, None)
            writer.transport.abort()

    async def _converse(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await self._serve_one(conn, reader, writer):
            conn.start_next_cycle()

    async def _serve_one(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Read one request and answer it; whether the connection can carry another. (A
        method of its own so that nothing of the request outlives its answer while the
        connection waits for the next.)"""
        try:
            request = await self._read_request(conn, reader, writer)
        except _Refused as refused:
            await self._refuse(conn, reader, writer, refused.reply)
            return False
        if request is None:
            return False
        await self._send(conn, writer, self._answer(request))
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    def _answer(self, request: HttpRequest) -> Reply:
        try:
            return self.answer(request)
        except Exception:
            # a fault of the server's own: the client gets an answer, the log the traceback
            _log.exception("the demo server failed to answer %s %s", request.method, request.path)
            return api_error(500, "the server failed to answer", kind="server_error")

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> HttpRequest | None:
        """The next whole request, or None when the client closed or stayed idle."""
        if not self._has_pending_bytes(conn):
            try:
                async with asyncio.timeout(self.limits.idle_timeout):
                    data = await reader.read(_READ_SIZE)
            except TimeoutError:
                return None
            if not data:
                return None
            conn.receive_data(data)
        try:
            async with asyncio.timeout(self.limits.request_timeout) as deadline:
                return await self._rest_of_request(conn, reader, writer)
        except TimeoutError:
            if not deadline.expired():
                raise  # the write of ``100 Continue`` timed out: the client reads nothing
            raise _refusal(
                408,
                f"the request did not arrive whole within {self.limits.request_timeout} s",
                "request_timeout",
            ) from None

    @staticmethod
    def _has_pending_bytes(conn: h11.Connection) -> bool:
        """Whether the next request has begun arriving (a pipelined one is already here)."""
        return bool(conn.trailing_data[0])

    async def _rest_of_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> HttpRequest | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as err:
                status = err.error_status_hint
                code = "request_header_fields_too_large" if status == 431 else "bad_http_request"
                raise _refusal(status, f"bad HTTP request: {err}", code) from None
            if event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    go_on = conn.send(
                        h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                    )
                    await self._write(writer, go_on)
                conn.receive_data(await reader.read(_READ_SIZE))
            elif isinstance(event, h11.Request):
                head = event
                self._check_declared_length(event)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.limits.max_body_bytes:
                    raise self._too_large()
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers)
                return HttpRequest(
                    head.method.decode("ascii"),
                    head.target.decode("latin-1"),
                    headers,
                    bytes(body),
                )
            elif isinstance(event, h11.ConnectionClosed):
                return None
            # h11.PAUSED cannot come before EndOfMessage; nothing else is a client event

    def _check_declared_length(self, head: h11.Request) -> None:
        for name, value in head.headers:
            # h11 has checked the value is digits and one length only
            if name == b"content-length" and int(value) > self.limits.max_body_bytes:
                raise self._too_large()

    def _too_large(self) -> _Refused:
        return _refusal(
            413,
            f"the request body is larger than {self.limits.max_body_bytes} bytes",
            "request_too_large",
        )

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, reply: Reply) -> None:
        headers = [("content-type", reply.content_type), *reply.headers]
        if not reply.streamed:
            headers.append(("content-length", str(sum(len(part) for part in reply.parts))))
        await self._write(
            writer, conn.send(h11.Response(status_code=reply.status, headers=headers))
        )
        for part in reply.parts:
            await self._write(writer, conn.send(h11.Data(data=part)))
        await self._write(writer, conn.send(h11.EndOfMessage()))

    async def _refuse(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        reply: Reply,
    ) -> None:
        """Answer with ``reply`` and close, letting the client read it first."""
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            closing = attrs.evolve(reply, headers=(*reply.headers, ("connection", "close")))
            await self._send(conn, writer, closing)
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.limits.linger_timeout):
                while await reader.read(_READ_SIZE):
                    pass  # dropped: closing with unread bytes would reset the answer away

    async def _write(self, writer: asyncio.StreamWriter, data: bytes | None) -> None:
        if data:
            writer.write(data)
            async with asyncio.timeout(self.limits.write_timeout):
                await writer.drain()
