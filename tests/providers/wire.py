"""Loaders for the recorded provider streams in ``tests/data/wire`` (see SOURCES.md there).

`load(name)` turns any capture into the list of HTTP responses it records, ready for
`wire_server.WireServer` to serve:

* RAW-SSE (``*.sse``) — the body exactly as captured, one 200 ``text/event-stream`` response;
* JSONL-PAYLOAD (``*.jsonl``) — each line re-framed the way its provider frames events:
  OpenAI-chat-shaped servers ``data: <line>\\n\\n`` + ``data: [DONE]\\n\\n``; Anthropic and the
  Responses API ``event: <type>\\ndata: <line>\\n\\n`` (no ``[DONE]``); Gemini
  ``data: <line>\\r\\n\\r\\n``. Responses files holding several responses are split into one
  recorded response per ``response.created``;
* VCR-YAML (``*.cassette.yaml``) — one response per interaction, with its recorded status,
  headers and body (``body.string`` verbatim, or ``parsed_body`` re-serialised as JSON);
* TRANSCRIPT (``*.txt``) — the NDJSON lines from line 13 on, one ``application/x-ndjson``
  response.

`load_ending(name)` serves a hand-written body from ``tests/data/endings`` (streams that end in
an error, a cut or stray bytes, which the recordings lack) as one 200 response.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from attrs import frozen

WIRE_DIR = Path(__file__).resolve().parent.parent / "data" / "wire"
ENDINGS_DIR = WIRE_DIR.parent / "endings"

SSE_HEADERS: tuple[tuple[str, str], ...] = (("content-type", "text/event-stream; charset=utf-8"),)
NDJSON_HEADERS: tuple[tuple[str, str], ...] = (("content-type", "application/x-ndjson"),)

# Providers whose JSONL-PAYLOAD lines are OpenAI chat chunks.
_CHAT_PREFIXES = (
    "openai-chat__",
    "azure-openai-chat__",
    "deepseek__",
    "groq__",
    "mistral__",
    "openrouter__",
    "vllm__",
    "xai__",
    "alibaba-qwen__",
    "openai-compatible-gateway__",
)
_EVENT_NAMED_PREFIXES = (
    "anthropic__",
    "anthropic-compatible__",
    "openai-responses__",
    "azure-openai-responses__",
)
_GEMINI_PREFIXES = ("gemini__", "gemini-vertex__")
# Framing headers describe the recorded transfer, not ours: the server re-frames the body.
_DROPPED_HEADERS = frozenset(
    {"transfer-encoding", "content-length", "content-encoding", "connection"}
)
TRANSCRIPT_FIRST_LINE = 13


@frozen
class RecordedResponse:
    """One recorded HTTP response: status, headers (lower-case names) and body bytes."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None


def path(name: str) -> Path:
    return WIRE_DIR / name


def names(*prefixes: str) -> list[str]:
    """Capture file names (SOURCES.md excluded), optionally only those with a prefix."""
    found = sorted(p.name for p in WIRE_DIR.iterdir() if p.name != "SOURCES.md")
    if prefixes:
        found = [n for n in found if n.startswith(prefixes)]
    return found


def ending_names(*prefixes: str) -> list[str]:
    """The hand-written stream endings in ``tests/data/endings`` (see the README there)."""
    found = sorted(p.name for p in ENDINGS_DIR.iterdir() if p.suffix in (".sse", ".ndjson"))
    if prefixes:
        found = [n for n in found if n.startswith(prefixes)]
    return found


def load_ending(name: str) -> RecordedResponse:
    """A hand-written ending as the 200 response that serves it."""
    headers = NDJSON_HEADERS if name.endswith(".ndjson") else SSE_HEADERS
    return RecordedResponse(200, headers, (ENDINGS_DIR / name).read_bytes())


def expected_sha256() -> dict[str, str]:
    """The sha256 list from SOURCES.md: file name → hex digest."""
    text = (WIRE_DIR / "SOURCES.md").read_text(encoding="utf-8")
    return {m.group(2): m.group(1) for m in re.finditer(r"^([0-9a-f]{64})  (\S+)$", text, re.M)}


def sha256(name: str) -> str:
    return hashlib.sha256(path(name).read_bytes()).hexdigest()


def load(name: str) -> list[RecordedResponse]:
    """Every HTTP response recorded in capture ``name``."""
    if name.endswith(".cassette.yaml"):
        return _load_cassette(name)
    if name.endswith(".sse"):
        return [RecordedResponse(200, SSE_HEADERS, path(name).read_bytes())]
    if name.endswith(".jsonl"):
        return _load_jsonl(name)
    if name.endswith(".txt"):
        lines = path(name).read_bytes().split(b"\n")[TRANSCRIPT_FIRST_LINE - 1 :]
        return [RecordedResponse(200, NDJSON_HEADERS, b"\n".join(lines))]
    raise ValueError(f"unknown capture format: {name}")


def payloads(name: str) -> list[Any]:
    """The decoded JSON payload lines of a JSONL-PAYLOAD capture."""
    return [json.loads(line) for line in _jsonl_lines(name)]


def _jsonl_lines(name: str) -> list[bytes]:
    return [line for line in path(name).read_bytes().split(b"\n") if line.strip()]


def _load_jsonl(name: str) -> list[RecordedResponse]:
    lines = _jsonl_lines(name)
    if name.startswith(_CHAT_PREFIXES):
        body = b"".join(b"data: " + line + b"\n\n" for line in lines) + b"data: [DONE]\n\n"
        return [RecordedResponse(200, SSE_HEADERS, body)]
    if name.startswith(_GEMINI_PREFIXES):
        body = b"".join(b"data: " + line + b"\r\n\r\n" for line in lines)
        return [RecordedResponse(200, SSE_HEADERS, body)]
    if name.startswith(_EVENT_NAMED_PREFIXES):
        responses: list[list[bytes]] = []
        for line in lines:
            kind = json.loads(line)["type"]
            if not responses or (kind == "response.created" and responses[-1]):
                responses.append([])
            responses[-1].append(b"event: " + kind.encode() + b"\ndata: " + line + b"\n\n")
        return [RecordedResponse(200, SSE_HEADERS, b"".join(parts)) for parts in responses]
    raise ValueError(f"no framing known for JSONL capture {name}")


def _load_cassette(name: str) -> list[RecordedResponse]:
    document = yaml.safe_load(path(name).read_text(encoding="utf-8"))
    recorded: list[RecordedResponse] = []
    for interaction in document["interactions"]:
        response = interaction["response"]
        headers: list[tuple[str, str]] = []
        for key, values in (response.get("headers") or {}).items():
            if key.lower() in _DROPPED_HEADERS:
                continue
            for value in values if isinstance(values, list) else [values]:
                headers.append((key.lower(), str(value)))
        body_field = response.get("body")
        if isinstance(body_field, dict) and "string" in body_field:
            raw = body_field["string"]
            body = raw if isinstance(raw, bytes) else str(raw).encode("utf-8")
        elif "parsed_body" in response:
            body = json.dumps(response["parsed_body"]).encode("utf-8")
        else:
            body = b""
        recorded.append(RecordedResponse(int(response["status"]["code"]), tuple(headers), body))
    return recorded


def request_bodies(name: str) -> list[Any]:
    """The recorded request bodies of a cassette (``parsed_body`` or decoded ``body``)."""
    document = yaml.safe_load(path(name).read_text(encoding="utf-8"))
    bodies: list[Any] = []
    for interaction in document["interactions"]:
        request = interaction["request"]
        if "parsed_body" in request:
            bodies.append(request["parsed_body"])
        else:
            body = request.get("body")
            bodies.append(json.loads(body) if isinstance(body, str) and body else body)
    return bodies
