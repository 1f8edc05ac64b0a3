"""The HTTP stream provider base: everything an adapter over httpx shares, so that an adapter
is its request body and its decoder.

Owns three things:

* `StreamDecoder` — the one protocol every adapter's sans-IO decoder implements. `event(name,
  data, out)` takes one framed event (an SSE event; an NDJSON line, named ``"message"``) and
  appends the chunk events it makes to ``out``; `finish(out)` is called when the body ended
  and appends what was pending; `done` says the stream's own end (``[DONE]``, a terminal
  event, a done line) arrived, `finished` that the format's finish marker did (`finish_marker`
  names it: a ``finish_reason``, a terminal event, a ``stop_reason``, …). Both raise
  `ProviderError` for what the provider reports or sends wrong.
* `decode_stream` — a body through a framing and a decoder, the response's model and id
  reported as soon as the decoder learns them (`toolloop_fsm.observation.report_response`:
  the telemetry's ``gen_ai.response.*``). Whatever the read boundaries,
  every chunk decoded before a failure is yielded, in order, before the failure is raised; and
  nothing after the stream's own end is read or decoded, even when it came in the same read —
  it is not part of the pass, and a server that holds the connection open after it does not
  hold the pass. A body that ends — cleanly, even after ``[DONE]`` — before the decoder saw
  its format's finish marker was cut (`unfinished_stream`): the reply is not complete,
  whatever it delivered.
* `HTTPStreamProvider` — the adapter's shell: construction (the API root, the model, an
  optional API key, an optional shared ``httpx.AsyncClient`` never closed here, extra request
  headers, a name, a timeout, the telemetry's provider name), what the telemetry says of it
  (`provider_name`, `operation_name`, `server_address`, `server_port`), a ``repr`` that
  shows no secret, the request headers (the caller's, then the framing's ``accept`` and the
  adapter's protocol headers, then the key in the adapter's credential header), the secrets
  no text may contain (the key and every credential header), and `stream`: POST the
  adapter's body through `post_stream`, decode it with the adapter's decoder, and let a
  failure out only as `redacted_error`, raised outside any ``except`` block so that nothing
  is chained to it.
"""

from __future__ import annotations

from abc import ABC
from abc import abstractmethod
from collections.abc import AsyncGenerator
from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any
from typing import ClassVar
from typing import Literal
from typing import Protocol
from typing import TypedDict

import httpx

from toolloop_fsm.events import Chunk
from toolloop_fsm.observation import report_response
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers._http import Framing
from toolloop_fsm.providers._http import post_stream
from toolloop_fsm.providers._secrecy import header_secrets
from toolloop_fsm.providers._secrecy import redact
from toolloop_fsm.providers._secrecy import redacted_error
from toolloop_fsm.providers._sse import EventFramer
from toolloop_fsm.providers._sse import NDJSONDecoder
from toolloop_fsm.providers._sse import RawEvent
from toolloop_fsm.providers._sse import SSEDecoder

_ACCEPT: Mapping[Framing, str] = {"sse": "text/event-stream", "ndjson": "application/x-ndjson"}
_DEFAULT_PORTS: Mapping[str, int] = {"https": 443, "http": 80}


# --------------------------------------------------------------------------- decoding
class ResponseNames:
    """What a stream's payloads name of their response: the model that wrote it and the
    response's id. The first non-empty text named is kept (a later payload repeats it)."""

    __slots__ = ("id", "model")

    def __init__(self) -> None:
        self.model: str | None = None
        self.id: str | None = None

    def take(self, model: object, response_id: object) -> None:
        """Keep ``model`` and ``response_id`` where still unknown (non-text is ignored)."""
        if self.model is None and isinstance(model, str) and model:
            self.model = model
        if self.id is None and isinstance(response_id, str) and response_id:
            self.id = response_id


class PassDecoder:
    """What every decoder keeps of its pass: whether its format's end of the pass arrived
    (`done`: nothing after it belongs to this pass) and the names of its response."""

    __slots__ = ("_done", "response")

    def __init__(self) -> None:
        self._done = False
        self.response = ResponseNames()

    @property
    def done(self) -> bool:
        """The end of the pass arrived: nothing after it belongs to this pass."""
        return self._done


class StreamDecoder(Protocol):
    """A provider's sans-IO decoder of framed events into chunk events (module docstring)."""

    @property
    def response(self) -> ResponseNames: ...

    @property
    def done(self) -> bool: ...

    @property
    def finished(self) -> bool: ...

    @property
    def finish_marker(self) -> str: ...

    def event(self, name: str, data: str, out: list[Chunk]) -> None: ...

    def finish(self, out: list[Chunk]) -> None: ...


def unfinished_stream(provider: str, finish_marker: str) -> ProviderError:
    """The failure of a pass whose body ended before its format's finish marker: a retryable
    ``protocol`` error. A server that stops a stream early (llama.cpp's ends an interrupted
    one with ``[DONE]`` and no ``finish_reason``) or a proxy that closes it cleanly leaves a
    reply cut short, which must not pass for a complete one; the outer tier continues it from
    what was delivered."""
    return ProviderError(
        f"{provider}: the stream ended without {finish_marker}: the reply was cut short",
        kind="protocol",
        retryable=True,
    )


def framer(framing: Framing, secrets: Iterable[str | None] = ()) -> EventFramer:
    """A fresh framer for one body: SSE (strict, its quotes redacted of ``secrets``) or NDJSON."""
    return SSEDecoder(secrets=secrets) if framing == "sse" else NDJSONDecoder()


async def decode_stream(
    body: AsyncGenerator[bytes, None],
    decoder: StreamDecoder,
    *,
    framing: Framing = "sse",
    secrets: Iterable[str | None] = (),
    provider: str = "provider",
) -> AsyncGenerator[Chunk, None]:
    """Frame ``body`` and run each event through ``decoder``, yielding its chunks.

    Every chunk decoded before a failure (the decoder's, or a line that is no SSE field) is
    yielded, in order, before the failure is raised; nothing after the decoder saw the
    stream's end is decoded. Both hold whatever the read boundaries: a read may hold many
    events, and the chunks of those before a failure are not lost with it. A body that ends
    before the decoder saw its finish marker fails as `unfinished_stream` (``provider`` names
    the provider in its message). Stops reading once
    the decoder is done, and closes ``body`` either way (a cancelled or abandoned pass closes
    the HTTP response at once).
    """
    events = framer(framing, secrets)
    out: list[Chunk] = []
    failure: ProviderError | None = None
    names = decoder.response
    reported: tuple[str | None, str | None] = (None, None)
    async with aclosing(body) as raw:
        async for data in raw:
            failure = _run_events(events.feed_raw(data), decoder, out)
            if (names.model, names.id) != reported:  # before any chunk or failure it came with
                reported = (names.model, names.id)
                report_response(*reported)
            if out:
                for chunk in out:
                    yield chunk
                out.clear()
            if failure is not None or decoder.done:
                break
            if events.error is not None:
                failure = events.error
                break
        else:
            failure = _run_events(events.finish_raw(), decoder, out) or events.error
    if failure is None:
        failure = _body_ended(decoder, out, provider)
    if (names.model, names.id) != reported:
        report_response(names.model, names.id)
    for chunk in out:
        yield chunk
    if failure is not None:
        raise failure


def _body_ended(decoder: StreamDecoder, out: list[Chunk], provider: str) -> ProviderError | None:
    """The body ended with nothing wrong so far: the decoder's last chunks go to ``out``,
    unless it never saw its finish marker (`unfinished_stream`); the error it raised, if any."""
    if not decoder.finished:
        return unfinished_stream(provider, decoder.finish_marker)
    try:
        decoder.finish(out)
    except ProviderError as error:
        return error
    return None


def _run_events(
    events: list[RawEvent], decoder: StreamDecoder, out: list[Chunk]
) -> ProviderError | None:
    """Feed ``events`` to ``decoder`` until it is done; the error it raised, if it did (the
    chunks it appended to ``out`` before that stay there)."""
    try:
        for name, text, _id, _retry in events:
            decoder.event(name, text, out)
            if decoder.done:
                break
    except ProviderError as error:
        return error
    return None


# --------------------------------------------------------------------------- the provider
class StreamOptions(TypedDict, total=False):
    """The constructor options every HTTP stream provider takes (`HTTPStreamProvider`)."""

    client: httpx.AsyncClient | None
    headers: Mapping[str, str] | None
    name: str | None
    timeout: httpx.Timeout | None
    provider_name: str | None


class KeyedStreamOptions(StreamOptions, total=False):
    """`StreamOptions` and the API key, for the providers that take one."""

    api_key: str | None


class HTTPStreamProvider(ABC):
    """One pass streamed over HTTP: see the module docstring for what the base owns.

    A subclass names its path (or its whole `url`), its framing, how its key travels
    (`credential_headers`), any protocol headers of its own, its default name, and builds its
    body (`build_body`) and its decoder (`decoder`).
    """

    tool_calling: ClassVar[Literal["native"]] = "native"
    framing: ClassVar[Framing] = "sse"
    path: ClassVar[str] = ""
    default_name: ClassVar[str] = ""
    known_provider: ClassVar[str] = ""
    """The OpenTelemetry GenAI conventions' well-known ``gen_ai.provider.name`` of the API the
    adapter speaks (``openai``, ``anthropic``, ``gcp.gemini``, …); `provider_name` unless the
    host names another (a compatible server: ``provider_name="groq"``)."""
    operation_name: ClassVar[str] = "chat"
    """The conventions' ``gen_ai.operation.name`` of one pass (``chat``, ``text_completion``,
    ``generate_content``)."""
    takes_api_key: ClassVar[bool] = True
    """Whether the provider has an API key of its own (and its repr says whether one is set)."""

    __slots__ = (
        "_api_key",
        "_client",
        "_headers",
        "_secrets",
        "_timeout",
        "base_url",
        "model",
        "name",
        "provider_name",
    )

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        client: httpx.AsyncClient | None = None,
        headers: Mapping[str, str] | None = None,
        name: str | None = None,
        timeout: httpx.Timeout | None = None,
        provider_name: str | None = None,
    ) -> None:
        if provider_name is not None and (not isinstance(provider_name, str) or not provider_name):
            bad = TypeError if not isinstance(provider_name, str) else ValueError
            raise bad(
                f"provider_name must be a non-empty text (the telemetry's gen_ai.provider.name, "
                f"e.g. 'groq'), got {provider_name!r}"
            )
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = name or self.unnamed()
        self.provider_name = provider_name or self.known_provider or self.name
        self._api_key = api_key or None
        self._client = client
        self._timeout = timeout
        self._headers = {
            **(headers or {}),
            "accept": _ACCEPT[self.framing],
            **self.protocol_headers(),
            **(self.credential_headers(api_key) if api_key else {}),
        }
        secrets = (api_key,) if api_key else ()
        self._secrets = tuple(dict.fromkeys((*secrets, *header_secrets(self._headers))))

    def __repr__(self) -> str:
        base_url = redact(self.base_url, self._secrets)
        key = f", api_key={'<set>' if self._api_key else None}" if self.takes_api_key else ""
        return f"{type(self).__name__}(base_url={base_url!r}, model={self.model!r}{key})"

    # ---- what a subclass may say
    def unnamed(self) -> str:
        """The name of a provider given none: `default_name`."""
        return self.default_name

    def protocol_headers(self) -> dict[str, str]:
        """Headers the API itself requires on every request, beside ``accept``."""
        return {}

    def credential_headers(self, api_key: str) -> dict[str, str]:
        """The header(s) the API key travels in: a bearer ``authorization`` unless the API
        says otherwise. Keys travel in headers only, never in the URL."""
        return {"authorization": f"Bearer {api_key}"}

    @property
    def url(self) -> str:
        """Where a pass is POSTed: `path` under the API root."""
        return f"{self.base_url}/{self.path}"

    @property
    def server_address(self) -> str | None:
        """The host the passes go to (the telemetry's ``server.address``)."""
        return httpx.URL(self.base_url).host or None

    @property
    def server_port(self) -> int | None:
        """The port the passes go to, the scheme's default when the API root names none (the
        telemetry's ``server.port``)."""
        url = httpx.URL(self.base_url)
        return url.port or _DEFAULT_PORTS.get(url.scheme)

    @property
    def label(self) -> str:
        """How this provider's error messages name it: its name."""
        return self.name

    @property
    def secrets(self) -> tuple[str, ...]:
        """What no text from this provider may contain: the key and every credential header."""
        return self._secrets

    @abstractmethod
    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        """The JSON request body for one pass; raises `ProviderError` for a request the API
        cannot be sent."""

    @abstractmethod
    def decoder(self) -> StreamDecoder:
        """A fresh decoder for one pass's stream."""

    # ---- the pass
    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        secrets = self._secrets
        failure: ProviderError | None = None
        try:
            body = post_stream(
                self.url,
                self.build_body(request),
                provider=self.label,
                framing=self.framing,
                headers=self._headers,
                client=self._client,
                secrets=secrets,
                timeout=self._timeout,
                max_bytes=request.max_response_bytes,
            )
            decoded = decode_stream(
                body, self.decoder(), framing=self.framing, secrets=secrets, provider=self.label
            )
            # aclosing: a pass the reader abandons closes the response now, not when the
            # generators are collected.
            async with aclosing(decoded) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ProviderError as error:
            failure = redacted_error(error, secrets)
        if failure is not None:
            raise failure  # outside the `except`: nothing chained to it


__all__ = [
    "HTTPStreamProvider",
    "KeyedStreamOptions",
    "ResponseNames",
    "StreamDecoder",
    "StreamOptions",
    "decode_stream",
    "framer",
    "unfinished_stream",
]
