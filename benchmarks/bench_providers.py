"""Decoding speed of `OpenAICompatibleProvider` against a minimal httpx-sse + json.loads reader.

Both read the same bytes from memory through ``httpx.MockTransport`` in the same run, so the
network is not what is measured: what differs is SSE framing, JSON decoding and, for the
adapter, building chunk events and assembling tool calls. Two streams, built from the shape
of the recorded OpenAI captures (``tests/data/wire``): ~10,000 text chunks
(``openai-chat__text-obfuscation-usage-null.jsonl``) and ~10,000 tool-call argument fragments
(``openai-chat__tool-call-single.sse``). Each is served twice: one body read per SSE event (as a
live stream arrives) and 64 KiB reads (as a backlog is drained). Last, the SSE framing alone:
`toolloop_fsm.providers._sse.aiter_sse` against httpx-sse on the same bytes.

Run: ``python benchmarks/bench_providers.py`` (``--chunks N``, ``--repeat R``). The target is
an adapter/reference time ratio of at most 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import httpx_sse

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers._sse import aiter_sse
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider

WIRE = Path(__file__).resolve().parent.parent / "tests" / "data" / "wire"
REQUEST = ProviderRequest([{"role": "user", "content": "hi"}])


def _text_stream(chunks: int) -> list[bytes]:
    lines = (WIRE / "openai-chat__text-obfuscation-usage-null.jsonl").read_bytes().splitlines()
    payloads = [json.loads(line) for line in lines]
    content = [p for p in payloads if p["choices"] and p["choices"][0]["delta"].get("content")]
    events = [payloads[0]]
    events += [content[i % len(content)] for i in range(chunks)]
    events += [payloads[-2], payloads[-1]]  # the finish chunk, the usage chunk
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _tool_stream(chunks: int) -> list[bytes]:
    body = (WIRE / "openai-chat__tool-call-single.sse").read_bytes()
    payloads = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
    first, fragment, finish, usage = payloads[0], payloads[1], payloads[-2], payloads[-1]
    events: list[Any] = [first]
    pieces = ['{"notes": "'] + ["word " for _ in range(chunks - 2)] + ['"}']
    for piece in pieces:
        event = json.loads(json.dumps(fragment))
        event["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] = piece
        events.append(event)
    events += [finish, usage]
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


class _Body(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self._parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part


def _client(parts: list[bytes]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Body(parts)
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _reads(events: list[bytes], mode: str) -> list[bytes]:
    if mode == "per-event":
        return events
    whole = b"".join(events)
    return [whole[i : i + 65536] for i in range(0, len(whole), 65536)]


async def _adapter(client: httpx.AsyncClient) -> int:
    provider = OpenAICompatibleProvider("http://bench/v1", "m", client=client)
    count = 0
    async for chunk in provider.stream(REQUEST):
        count += 1
        if isinstance(chunk, FunctionCall):
            assert chunk.arguments["notes"].startswith("word")
    return count


async def _reference(client: httpx.AsyncClient) -> int:
    count = 0
    async with httpx_sse.aconnect_sse(client, "POST", "http://bench/v1/chat/completions") as source:
        async for event in source.aiter_sse():
            if event.data.startswith("[DONE]"):
                break
            json.loads(event.data)
            count += 1
    return count


async def _our_sse(client: httpx.AsyncClient) -> int:
    count = 0
    async with client.stream("POST", "http://bench/v1/chat/completions") as response:
        async for _event in aiter_sse(response.aiter_bytes()):
            count += 1
    return count


async def _httpx_sse(client: httpx.AsyncClient) -> int:
    count = 0
    async with httpx_sse.aconnect_sse(client, "POST", "http://bench/v1/chat/completions") as source:
        async for _event in source.aiter_sse():
            count += 1
    return count


async def _timed(
    run: Callable[[httpx.AsyncClient], Coroutine[Any, Any, int]], client: httpx.AsyncClient
) -> float:
    # CPU time of this process: the work is single-threaded and CPU-bound, and other
    # processes on a shared machine then do not skew one side more than the other.
    start = time.process_time()
    await run(client)
    return time.process_time() - start


async def main(chunks: int, repeat: int) -> float:
    worst = 0.0
    for label, events in (("text", _text_stream(chunks)), ("tool-call", _tool_stream(chunks))):
        for mode in ("per-event", "64KiB"):
            parts = _reads(events, mode)
            n = len(events) - 1  # every event but [DONE]
            ref = adapter = float("inf")
            async with _client(parts) as client:
                # Interleaved, best of `repeat`: neither side profits from a warmer process.
                for _ in range(repeat):
                    ref = min(ref, await _timed(_reference, client))
                    adapter = min(adapter, await _timed(_adapter, client))
            ratio = adapter / ref
            worst = max(worst, ratio)
            print(
                f"{label:9} {mode:9} events={n:6d}  reference {n / ref:10,.0f} chunks/s"
                f"  adapter {n / adapter:10,.0f} chunks/s  adapter/reference time {ratio:.2f}"
            )
    print(f"worst ratio {worst:.2f} (target <= 1.5)")
    # The SSE framing alone, no JSON: the decoder choice documented in providers/_sse.py.
    for mode in ("per-event", "64KiB"):
        events = _text_stream(chunks)
        parts = _reads(events, mode)
        ours = theirs = float("inf")
        async with _client(parts) as client:
            for _ in range(repeat):
                theirs = min(theirs, await _timed(_httpx_sse, client))
                ours = min(ours, await _timed(_our_sse, client))
        print(
            f"sse-only  {mode:9} events={len(events):6d}  httpx-sse {len(events) / theirs:10,.0f}"
            f" events/s  _sse.aiter_sse {len(events) / ours:10,.0f} events/s"
            f"  httpx-sse/ours time {theirs / ours:.2f}"
        )
    return worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=9)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.chunks, arguments.repeat))
