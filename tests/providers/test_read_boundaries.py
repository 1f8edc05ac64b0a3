"""Decoding does not depend on how the network splits a body into reads.

Every recorded stream (``tests/data/wire``) and every hand-written ending
(``tests/data/endings``: streams that end in an in-stream error, a proxy's HTML page, a cut,
stray bytes after ``[DONE]``) is served over loopback HTTP by a real server that writes each
piece as its own write and flush. Served in one read and served split — one byte per read over
a stretch of the body, reads of random sizes, cuts inside multi-byte UTF-8 characters and
between CR and LF — an adapter must yield the same chunks, in the same order, and then fail
with the same error (kind, message, status, retryability, retry hint), or finish the same way.
The same holds with `VerbatimToolCalls` on top.

One regression per adapter pins the defect this property found: text read together with an
in-stream error (one read) was dropped by the OpenAI-style adapters.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import httpx
import pytest
from attrs import frozen
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers import replay
from tests.providers import wire
from tests.providers.replay import adapter_kind
from tests.providers.wire import RecordedResponse
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers import VerbatimToolCalls

API_KEY = "sk-read-boundaries-0123456789abcdef"
REQUEST = ProviderRequest([{"role": "user", "content": "hi"}])
TOOLS = (
    ToolSpec(
        "get_weather",
        "Current weather for a city.",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    ),
    ToolSpec(
        "get_time",
        "Current time in a zone.",
        {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    ),
)
VERBATIM_REQUEST = ProviderRequest([{"role": "user", "content": "hi"}], tools=TOOLS)
# One byte per read costs a loopback write each: over this many bytes of a body, not all of it.
BYTE_STRETCH = 256
# Three reads per stream (each one a loopback replay) keep the suite's time in bounds; the
# ci profile is derandomized, so they are the same three on every run.
SPLITS = settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- the cases
@frozen
class Case:
    name: str
    index: int
    response: RecordedResponse

    def __str__(self) -> str:
        return f"{self.name}[{self.index}]"


CASES = [
    *(Case(name, i, r) for name in wire.names() for i, r in enumerate(wire.load(name))),
    *(Case(name, 0, wire.load_ending(name)) for name in wire.ending_names()),
]


def adapter(name: str, server: WireServer, client: httpx.AsyncClient) -> Provider:
    """The adapter a capture's name says it was recorded from (or written for)."""
    return replay.adapter(adapter_kind(name), server.url, API_KEY, client)


@frozen
class Outcome:
    """Everything a pass shows its consumer: the chunks, then the error it ended with."""

    chunks: tuple[Chunk, ...]
    error: tuple[str, str, int | None, bool, float | None] | None


async def outcome(
    server: WireServer,
    source: Provider,
    response: RecordedResponse,
    reads: Sequence[bytes],
    request: ProviderRequest = REQUEST,
) -> Outcome:
    server.serve(Scripted(status=response.status, headers=response.headers, chunks=tuple(reads)))
    chunks: list[Chunk] = []
    try:
        async for chunk in source.stream(request):
            chunks.append(chunk)
    except ProviderError as error:
        failure = (error.kind, error.message, error.status_code, error.retryable, error.retry_after)
        return Outcome(tuple(chunks), failure)
    return Outcome(tuple(chunks), None)


def split(body: bytes, cuts: Sequence[int]) -> tuple[bytes, ...]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body)]
    return tuple(body[a:b] for a, b in itertools.pairwise(bounds))


def seams(body: bytes) -> list[int]:
    """Offsets where a cut splits a UTF-8 character, or falls just before a CR or an LF (so
    between the CR and LF of a CRLF, and between the two line ends closing an event)."""
    found = [i for i, byte in enumerate(body) if byte & 0xC0 == 0x80 or byte in (0x0A, 0x0D)]
    return found or [len(body) // 2]


def reads_of(body: bytes) -> st.SearchStrategy[tuple[bytes, ...]]:
    """How the network may deliver ``body``: one byte per read over a stretch of it (all of a
    short body), reads of random sizes, or cuts at its awkward seams."""
    size = len(body)
    byte_by_byte = st.integers(0, max(0, size - BYTE_STRETCH)).map(
        lambda start: split(body, range(start, start + BYTE_STRETCH + 1))
    )
    random_sizes = st.lists(st.integers(1, max(1, size - 1)), max_size=40).map(
        lambda cuts: split(body, cuts)
    )
    awkward = st.lists(st.sampled_from(seams(body)), min_size=1, max_size=40).map(
        lambda cuts: split(body, cuts)
    )
    return st.one_of(byte_by_byte, random_sizes, awkward)


# --------------------------------------------------------------------------- the property
@SPLITS
@given(data=st.data())
@pytest.mark.parametrize("case", CASES, ids=str)
async def test_every_stream_decodes_the_same_however_the_network_splits_it(
    wire_server: WireServer, client: httpx.AsyncClient, case: Case, data: st.DataObject
) -> None:
    source = adapter(case.name, wire_server, client)
    whole = await outcome(wire_server, source, case.response, [case.response.body])
    reads = data.draw(reads_of(case.response.body), label="reads")
    assert await outcome(wire_server, source, case.response, reads) == whole


@SPLITS
@given(data=st.data())
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.response.status == 200 and "openai-chat" in c.name], ids=str
)
async def test_verbatim_calls_and_text_come_out_the_same_however_the_network_splits_it(
    wire_server: WireServer, client: httpx.AsyncClient, case: Case, data: st.DataObject
) -> None:
    source = VerbatimToolCalls(adapter(case.name, wire_server, client))
    body = case.response.body
    whole = await outcome(wire_server, source, case.response, [body], VERBATIM_REQUEST)
    reads = data.draw(reads_of(body), label="reads")
    assert await outcome(wire_server, source, case.response, reads, VERBATIM_REQUEST) == whole


@pytest.mark.parametrize("name", wire.ending_names(), ids=str)
async def test_each_ending_decodes_the_same_one_byte_per_read_as_in_one_read(
    wire_server: WireServer, client: httpx.AsyncClient, name: str
) -> None:
    response = wire.load_ending(name)
    source = adapter(name, wire_server, client)
    whole = await outcome(wire_server, source, response, [response.body])
    one_byte_each = [response.body[i : i + 1] for i in range(len(response.body))]
    assert await outcome(wire_server, source, response, one_byte_each) == whole


# --------------------------------------------------------------------------- regressions
# Each ending whose text precedes its failure, with the failure a user is told about.
TEXT_THEN_FAILURE = {
    "openai-chat__text-then-error-chunk-code-500.sse": (
        "Partial answer before the failure — ça coûte 5 €",
        "server",
    ),
    "openai-chat__text-then-throttling-error-event-crlf.sse": (
        "Partial answer before Zürich 🌤 東京",
        "rate_limit",
    ),
    "openai-chat__text-then-html-page.sse": ("Partial answer before the proxy gave up", "protocol"),
    "openai-responses__text-then-error-event-code-429.sse": (
        "Partial answer before the failure — déjà vu",
        "rate_limit",
    ),
    "anthropic__text-then-error-event-crlf.sse": (
        "Partial answer before the failure — 東京 🌍",
        "server",
    ),
    "anthropic__text-then-cut.sse": ("Partial answer before the cut", "protocol"),
    "gemini__text-then-error-object-crlf.sse": (
        "Partial answer before the failure — naïve café",
        "server",
    ),
    "gemini__text-then-appended-json-error.sse": ("Partial answer before the failure", "protocol"),
    "ollama__text-then-error-line-crlf.ndjson": (
        "Partial answer before the failure — ünïcödé",
        "server",
    ),
    "ollama__text-then-html-page.ndjson": ("Partial answer before the proxy gave up", "protocol"),
}


def test_every_failing_ending_has_an_expectation() -> None:
    failing = {n for n in wire.ending_names() if "stray" not in n and "verbatim" not in n}
    assert set(TEXT_THEN_FAILURE) == failing


@pytest.mark.parametrize("name", sorted(TEXT_THEN_FAILURE), ids=str)
async def test_text_read_together_with_the_failure_still_comes_out_before_it(
    wire_server: WireServer, client: httpx.AsyncClient, name: str
) -> None:
    text, kind = TEXT_THEN_FAILURE[name]
    response = wire.load_ending(name)
    # the whole body, error included, arrives in a single read
    result = await outcome(
        wire_server, adapter(name, wire_server, client), response, [response.body]
    )
    assert "".join(c.text for c in result.chunks if isinstance(c, TextDelta)) == text
    assert result.error is not None and result.error[0] == kind


async def test_chunks_after_done_are_not_part_of_the_pass_even_in_the_same_read(
    wire_server: WireServer, client: httpx.AsyncClient
) -> None:
    name = "openai-chat__stray-chunk-after-done.sse"
    response = wire.load_ending(name)
    result = await outcome(
        wire_server, adapter(name, wire_server, client), response, [response.body]
    )
    assert result.error is None
    assert "".join(c.text for c in result.chunks if isinstance(c, TextDelta)) == "The whole answer."


async def test_a_verbatim_call_before_an_error_in_the_same_read_still_comes_out(
    wire_server: WireServer, client: httpx.AsyncClient
) -> None:
    name = "openai-chat__verbatim-call-then-error.sse"
    response = wire.load_ending(name)
    source = VerbatimToolCalls(adapter(name, wire_server, client))
    result = await outcome(wire_server, source, response, [response.body], VERBATIM_REQUEST)
    calls = [(c.name, dict(c.arguments)) for c in result.chunks if isinstance(c, FunctionCall)]
    text = "".join(c.text for c in result.chunks if isinstance(c, TextDelta))
    # the half-written second call was never delivered and must not run: it goes with the error
    assert calls == [("get_weather", {"city": "Paris"})]
    assert text == "Let me check.  and then "
    assert result.error is not None and result.error[0] == "rate_limit"
