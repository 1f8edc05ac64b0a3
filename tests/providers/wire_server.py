"""A real HTTP/1.1 server on 127.0.0.1 that serves scripted (usually recorded) responses.

Each request takes the next `Scripted` response from the queue (the last one repeats when the
queue runs dry). A response body is a sequence of byte chunks, each written and drained
separately — with a yield to the event loop between them — so the client sees the split. A
response can also drop the connection after some chunks (no chunked-encoding terminator, so
the client sees a truncated body), or stall until the client goes away. The server records
every request, counts the body bytes it wrote (`body_bytes_sent`), and sets `client_gone`
when a client closes a connection while a response was still being sent (or was stalled) —
what a cancellation test waits for; `stalled` is set once a response has stopped to stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence

from attrs import field
from attrs import frozen

from tests.providers.wire import RecordedResponse

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@frozen
class Scripted:
    """One response to serve.

    ``chunks`` are written one by one. ``drop_after=k`` closes the socket abruptly after
    ``k`` chunks; ``stall_after=k`` stops after ``k`` chunks and waits for the client to leave.
    ``framing`` is ``"chunked"`` (the default, as streaming APIs answer), ``"length"``
    (``content-length``) or ``"close"`` (body delimited by closing the connection).
    """

    status: int = 200
    headers: tuple[tuple[str, str], ...] = (("content-type", "text/event-stream"),)
    chunks: tuple[bytes, ...] = ()
    drop_after: int | None = None
    stall_after: int | None = None
    framing: str = "chunked"

    @classmethod
    def recorded(
        cls,
        response: RecordedResponse,
        *,
        cuts: Sequence[int] = (),
        drop_after: int | None = None,
        stall_after: int | None = None,
        framing: str = "chunked",
    ) -> Scripted:
        """A recorded response, its body cut at the given byte offsets."""
        body = response.body
        bounds = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body)]
        chunks = tuple(body[a:b] for a, b in itertools.pairwise(bounds) if b > a)
        return cls(
            status=response.status,
            headers=response.headers,
            chunks=chunks,
            drop_after=drop_after,
            stall_after=stall_after,
            framing=framing,
        )


@frozen
class ReceivedRequest:
    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None


@frozen
class _Queue:
    items: list[Scripted] = field(factory=list)


class WireServer:
    """Start with `start()`, point a client at `url`, `serve(...)` responses, `close()`."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._queue = _Queue()
        self._last: Scripted | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.requests: list[ReceivedRequest] = []
        self.body_bytes_sent = 0
        self.client_gone = asyncio.Event()
        self.stalled = asyncio.Event()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self, *responses: Scripted) -> None:
        """Queue responses for the next requests, in order."""
        self._queue.items.extend(responses)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        # Aborted transports wake every handler with EOF or a connection error, so they end
        # on their own; waiting for them keeps a cancelled handler from outliving the loop.
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None

    def _next(self) -> Scripted:
        if self._queue.items:
            self._last = self._queue.items.pop(0)
        if self._last is None:
            return Scripted(status=500, headers=(), chunks=(b"nothing scripted",), framing="length")
        return self._last

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    return
                self.requests.append(request)
                keep_open = await self._respond(self._next(), reader, writer)
                if not keep_open:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _read_request(self, reader: asyncio.StreamReader) -> ReceivedRequest | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            if line:
                key, _, value = line.partition(":")
                headers.append((key.strip().lower(), value.strip()))
        length = int(dict(headers).get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
        return ReceivedRequest(method, target, tuple(headers), body)

    async def _respond(
        self, response: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Write one response; return whether the connection may serve another request."""
        reason = _REASONS.get(response.status, "Status")
        head = [f"HTTP/1.1 {response.status} {reason}"]
        head += [f"{k}: {v}" for k, v in response.headers]
        if response.framing == "chunked":
            head.append("transfer-encoding: chunked")
        elif response.framing == "length":
            head.append(f"content-length: {sum(len(c) for c in response.chunks)}")
        else:
            head.append("connection: close")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        for sent, chunk in enumerate(response.chunks):
            if response.drop_after is not None and sent >= response.drop_after:
                writer.transport.abort()
                return False
            if response.stall_after is not None and sent >= response.stall_after:
                await self._await_client_gone(reader)
                return False
            if not chunk:
                continue
            if response.framing == "chunked":
                writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            else:
                writer.write(chunk)
            self.body_bytes_sent += len(chunk)
            try:
                await writer.drain()
            except ConnectionError:
                self.client_gone.set()
                return False
            # Let the client read this chunk on its own before the next one is written.
            await asyncio.sleep(0)
        if response.drop_after is not None and response.drop_after >= len(response.chunks):
            writer.transport.abort()
            return False
        if response.stall_after is not None:
            await self._await_client_gone(reader)
            return False
        if response.framing == "chunked":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        return response.framing == "length"

    async def _await_client_gone(self, reader: asyncio.StreamReader) -> None:
        self.stalled.set()
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass
        self.client_gone.set()
