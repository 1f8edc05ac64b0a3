"""The demo: an embedded OpenAI-compatible server on loopback with a scripted "model", and a
full generation turn against it over real HTTP through `OpenAICompatibleProvider`.

The scripted model answers ``POST /v1/chat/completions`` with Server-Sent Events the way
OpenAI does, and ``GET /v1/models``; any other route, an unknown model or a malformed request
gets an OpenAI-shaped error (`DemoServer.answer`). It calls only the tools a request offers.
Its HTTP layer, and every bound on what a client can make it hold, is `toolloop_fsm.demo_http`.
Model ``swift-1`` is rate-limited (HTTP 429 with ``Retry-After``); model ``steady-2`` streams
text, asks for ``get_weather`` (a tool that needs a follow-up), receives
its result, answers, and calls ``update_short_term_memory`` after that text (which ends the
turn). The turn falls back from the first model to the second. Asked by a `ModelReviewer`,
the scripted model plays the reviewer (`review_verdict`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import Callable
from collections.abc import Collection
from typing import Any
from typing import TextIO

from attrs import define
from attrs import field

from toolloop_fsm.attempts import Attempt
from toolloop_fsm.demo_http import BoundedHttpServer
from toolloop_fsm.demo_http import HttpRequest
from toolloop_fsm.demo_http import Reply
from toolloop_fsm.demo_http import ServeLimits
from toolloop_fsm.demo_http import api_error
from toolloop_fsm.demo_http import event_stream
from toolloop_fsm.demo_http import json_reply
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.model_reviewer import REVIEW_MARKER
from toolloop_fsm.model_reviewer import ModelReviewer
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.pump import run_generation_turn
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.review import Reviewer
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.review import Verdict

RATE_LIMITED_MODEL = "swift-1"
ANSWERING_MODEL = "steady-2"
QUESTION = "What's the weather like in Paris today?"


# --------------------------------------------------------------------------- the scripted model
def _chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
    body = {
        "id": "chatcmpl-demo",
        "object": "chat.completion.chunk",
        "created": 1_764_460_800,
        "model": ANSWERING_MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _words(text: str) -> list[str]:
    pieces: list[str] = []
    for word in text.split(" "):
        pieces.append(word + " ")
    pieces[-1] = pieces[-1].rstrip(" ")
    return pieces


#: The finding the scripted reviewer sends a first drafted reply back with.
DEMO_FINDING = {
    "category": "voice",
    "problem": "The reply reads like a forecast bulletin, not like someone talking to a friend.",
    "direction": "Say it warmly and in your own words; keep the temperature and the sky.",
}


def _is_review(messages: list[dict[str, Any]]) -> bool:
    """Whether the request is a `ModelReviewer`'s: its system instruction starts with the
    review marker."""
    return any(
        m.get("role") == "system"
        and isinstance(m.get("content"), str)
        and m["content"].startswith(REVIEW_MARKER)
        for m in messages
    )


def review_verdict(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The scripted reviewer's verdict: a drafted reply that was never revised is sent back
    once with a ``voice`` finding; a revised reply and every tool call pass. A packet it
    cannot read (the user message is not the packet's JSON) it refuses to judge."""
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    try:
        packet = json.loads(users[-1]) if users and isinstance(users[-1], str) else None
    except ValueError:
        packet = None
    if not isinstance(packet, dict):
        return {"verdict": "refuse"}
    revision = packet.get("revision")
    revisions_done = revision.get("revisions_done") if isinstance(revision, dict) else None
    if packet.get("kind") == "response" and revisions_done == 0:
        return {"verdict": "revise", "findings": [DEMO_FINDING]}
    return {"verdict": "pass"}


def _review_reply(messages: list[dict[str, Any]]) -> list[bytes]:
    answer = json.dumps(review_verdict(messages))
    frames = [_chunk({"role": "assistant", "content": ""})]
    # the verdict arrives in pieces, as on the wire
    frames += [_chunk({"content": answer[i : i + 16]}) for i in range(0, len(answer), 16)]
    frames.append(_chunk({}, "stop"))
    return frames + _closing_frames(_prompt_tokens(messages), max(1, estimate_tokens(answer)))


def scripted_reply(messages: list[dict[str, Any]], tools: Collection[str]) -> list[bytes]:
    """What the scripted model streams for a conversation so far, calling only the ``tools``
    the request offered (none offered: it answers in text); a `ModelReviewer`'s request gets
    the scripted reviewer's verdict (`review_verdict`). It answers the last question: the
    tool results it reads are those since that question (drafting's revision instruction is
    not a question)."""
    if _is_review(messages):
        return _review_reply(messages)
    asked = _question_at(messages)
    answered = [m for m in messages[asked + 1 :] if m.get("role") == "tool"]
    # call ids are numbered across the conversation: a call of a later turn never reuses one
    earlier = sum(m.get("role") == "tool" for m in messages[: max(asked, 0)])
    prompt = _prompt_tokens(messages)
    if _asks_for_a_revision(messages):
        return _revised_reply(answered, prompt)
    cities = asked_cities(messages)
    payment = asked_payment(messages)
    if payment is not None and "send_money" in tools:
        return _payment_reply(payment, cities[0] if cities else "Paris", answered, prompt, earlier)
    if "get_weather" not in tools and not answered:
        text = "I can't look up the weather from here: no forecast tool was offered to me."
        return _reply(text, [], 0, prompt)
    if len(cities) > 1:
        return _batch_reply(cities, answered, tools, prompt, earlier)
    city = cities[0] if cities else "Paris"  # a question naming no known city: Paris
    if not answered:
        text = f"Let me check the forecast for {city}. "
        calls = [{"name": "get_weather", "arguments": json.dumps({"city": city})}]
        return _reply(text, calls, earlier, prompt)
    weather = _forecast(answered[-1])
    outing = "a walk along the Seine" if city == "Paris" else "a walk"
    text = (
        f"It's {weather.get('temp_c', '?')} °C and {weather.get('sky', 'unknown')} in {city} — "
        f"a good day for {outing}."
    )
    calls = _remembering(tools, f"asked about the weather in {city}")
    if calls:
        text += f" I'll remember you asked about {city}."
    return _reply(text, calls, earlier + len(answered), prompt)


#: The cities the scripted model knows; a question naming two or more makes it batch.
DEMO_CITIES = ("Paris", "London", "Rome", "Berlin", "Madrid", "Tokyo", "Oslo", "Lisbon")


def _is_revision_instruction(message: dict[str, Any]) -> bool:
    """Whether a message is drafting's revision instruction (a user message that asks for a
    replacement reply, not a new question)."""
    content = message.get("content")
    return (
        message.get("role") == "user" and isinstance(content, str) and "needs a revision" in content
    )


def _question_at(messages: list[dict[str, Any]]) -> int:
    """The index of the last question: the last user message that is not drafting's
    revision instruction (-1 when there is none)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.get("role") == "user" and not _is_revision_instruction(message):
            return index
    return -1


def asked_cities(messages: list[dict[str, Any]]) -> list[str]:
    """The known cities the last question names, in the order it names them."""
    asked = _question_at(messages)
    question = messages[asked].get("content") if asked >= 0 else None
    if not isinstance(question, str):
        return []
    found = [(question.find(city), city) for city in DEMO_CITIES if city in question]
    return [city for _, city in sorted(found)]


_PAYMENT = re.compile(r"\bsend (\w+) (\d+)", re.IGNORECASE)


def asked_payment(messages: list[dict[str, Any]]) -> tuple[str, int] | None:
    """Whom and how much the last question asks to pay ("Send Bob 50 …"), if it does."""
    asked = _question_at(messages)
    question = messages[asked].get("content") if asked >= 0 else None
    found = _PAYMENT.search(question) if isinstance(question, str) else None
    return (found[1].capitalize(), int(found[2])) if found else None


def _payment_reply(
    payment: tuple[str, int],
    city: str,
    answered: list[dict[str, Any]],
    prompt: int,
    earlier: int,
) -> list[bytes]:
    """A payment and a forecast asked for at once: both calls in one response (the payment
    is the tool that waits for approval); once both are answered, what happened to each."""
    to, amount = payment
    if len(answered) < 2:
        text = f"I'll send {to} the money and check {city}. "
        calls = [
            {"name": "send_money", "arguments": json.dumps({"to": to, "amount": amount})},
            {"name": "get_weather", "arguments": json.dumps({"city": city})},
        ]
        return _reply(text, calls, earlier + len(answered), prompt)
    sent, weather = (_response(message) for message in answered[-2:])
    paid = sent.get("data") if isinstance(sent.get("data"), dict) else None
    if sent.get("success") and paid is not None:
        text = f"Sent {paid.get('amount')} € to {paid.get('to')}."
    else:
        text = f"I did not send the money: {sent.get('reason') or 'it failed'}"
    forecast = weather.get("data")
    temp_c = forecast.get("temp_c", "?") if isinstance(forecast, dict) else "?"
    text += f" It's {temp_c} °C in {city}."
    return _reply(text, [], earlier + len(answered), prompt)


def _response(message: dict[str, Any]) -> dict[str, Any]:
    """The response a tool message shows, as the loop sent it (empty when it is not one)."""
    with contextlib.suppress(ValueError, AttributeError):
        shown = json.loads(message.get("content") or "{}")
        if isinstance(shown, dict):
            return shown
    return {}


def _forecast(message: dict[str, Any]) -> dict[str, Any]:
    """The forecast a tool message shows (empty when it shows none)."""
    with contextlib.suppress(ValueError, AttributeError):
        data = json.loads(message.get("content") or "{}").get("data")
        if isinstance(data, dict):
            return data
    return {}


def _batch_reply(
    cities: list[str],
    answered: list[dict[str, Any]],
    tools: Collection[str],
    prompt: int,
    earlier: int,
) -> list[bytes]:
    """Several cities asked about: every forecast in one response (a tool batch), as OpenAI,
    Anthropic and Gemini models do; once all are answered, one sentence per city, then the
    memory note."""
    if len(answered) < len(cities):
        text = f"Let me check {', '.join(cities[:-1])} and {cities[-1]}. "
        calls = [
            {"name": "get_weather", "arguments": json.dumps({"city": city})} for city in cities
        ]
        return _reply(text, calls, earlier + len(answered), prompt)
    parts = []
    # the answers come in emitted order, one per city asked about
    for city, message in zip(cities, answered[-len(cities) :], strict=True):
        data = _forecast(message)
        if "temp_c" not in data:  # a call that failed or was refused: no forecast to tell
            parts.append(f"{city}: not looked up")
            continue
        parts.append(f"{city}: {data['temp_c']} °C, {data.get('sky', 'unknown')}")
    text = "; ".join(parts) + "."
    calls = _remembering(tools, f"asked about {', '.join(cities)}")
    if calls:
        text += " I'll remember you asked."
    return _reply(text, calls, earlier + len(answered), prompt)


def _remembering(tools: Collection[str], note: str) -> list[dict[str, str]]:
    """The memory call, when the request offered the memory tool."""
    if "update_short_term_memory" not in tools:
        return []
    return [{"name": "update_short_term_memory", "arguments": json.dumps({"note": note})}]


def _prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The scripted model's count of the prompt: the library's estimate of each message's
    content (`toolloop_fsm.result.estimate_tokens`), and a token a message."""
    return sum(estimate_tokens(str(m.get("content") or "")) for m in messages) + len(messages)


def _reply(text: str, calls: list[dict[str, str]], numbered: int, prompt: int) -> list[bytes]:
    """Text in words, then the calls (each's arguments in fragments, as on the wire, their
    ids after the ``numbered`` calls the conversation answered); no calls: the response ends
    ``stop``."""
    frames = [_chunk({"role": "assistant", "content": ""})]
    frames += [_chunk({"content": piece}) for piece in _words(text)]
    for index, call in enumerate(calls):
        opening = {
            "index": index,
            "id": f"call_{numbered}_{index}",
            "type": "function",
            "function": {"name": call["name"], "arguments": ""},
        }
        frames.append(_chunk({"tool_calls": [opening]}))
        arguments = call["arguments"]
        for start in range(0, len(arguments), 12):
            fragment = {"index": index, "function": {"arguments": arguments[start : start + 12]}}
            frames.append(_chunk({"tool_calls": [fragment]}))
    frames.append(_chunk({}, "tool_calls" if calls else "stop"))
    written = text + "".join(call["name"] + call["arguments"] for call in calls)
    return frames + _closing_frames(prompt, max(1, estimate_tokens(written)))


def _closing_frames(prompt_tokens: int, completion_tokens: int) -> list[bytes]:
    """The usage chunk and the ``[DONE]`` line that end every scripted stream."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    body = json.dumps({"id": "chatcmpl-demo", "choices": [], "usage": usage}).encode()
    return [b"data: " + body + b"\n\n", b"data: [DONE]\n\n"]


def _asks_for_a_revision(messages: list[dict[str, Any]]) -> bool:
    """Whether the last user message is drafting's revision instruction."""
    users = [m for m in messages if m.get("role") == "user"]
    return bool(users) and _is_revision_instruction(users[-1])


def _revised_reply(answered: list[dict[str, Any]], prompt: int) -> list[bytes]:
    """The scripted model's replacement after a review sent its draft back: the same facts,
    said warmly, and no tool called again."""
    data: dict[str, Any] = {}
    for message in answered:
        shown = _forecast(message)
        if "temp_c" in shown:
            data = shown
    text = (
        f"Good news — Paris is {data.get('sky', 'lovely')} today, a mild "
        f"{data.get('temp_c', '?')} °C. Perfect weather for a long walk along the Seine!"
    )
    return _reply(text, [], len(answered), prompt)


# --------------------------------------------------------------------------- the routes
def _offered_tools(payload: dict[str, Any]) -> frozenset[str] | Reply:
    """The names of the tools a request offers (none when ``tool_choice`` is ``"none"``),
    or the 400 for a ``tools`` that is not a list of functions."""
    tools = payload.get("tools", [])
    names: set[str] = set()
    if not isinstance(tools, list):
        return api_error(400, "'tools' must be an array of tools", param="tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or tool.get("type") != "function":
            return api_error(
                400,
                f'\'tools[{index}]\' must be {{"type": "function", "function": {{"name": …}}}}',
                param=f"tools[{index}]",
            )
        names.add(name)
    return frozenset() if payload.get("tool_choice") == "none" else frozenset(names)


def _completion_request(body: bytes) -> tuple[str, list[dict[str, Any]], frozenset[str]] | Reply:
    """A chat completion request's model, messages and offered tools, or the error it earns."""
    try:
        payload = json.loads(body)
    except ValueError as err:  # UnicodeDecodeError included
        return api_error(400, f"We could not parse the JSON body of your request: {err}")
    if not isinstance(payload, dict):
        return api_error(400, "the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return api_error(400, "you must provide a model parameter", param="model")
    if model not in (RATE_LIMITED_MODEL, ANSWERING_MODEL):
        return api_error(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    messages = payload.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        return api_error(
            400, "'messages' must be a non-empty array of messages with a role", param="messages"
        )
    if payload.get("stream") is not True:
        return api_error(
            400, 'the scripted model only streams: send "stream": true', param="stream"
        )
    tools = _offered_tools(payload)
    if isinstance(tools, Reply):
        return tools
    return model, messages, tools


def _models_listed() -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "owned_by": "toolloop-fsm-demo"}
            for name in (RATE_LIMITED_MODEL, ANSWERING_MODEL)
        ],
    }


#: The routes the scripted model answers, and the one method each takes.
_ROUTES = {"/v1/models": "GET", "/v1/chat/completions": "POST"}


@define
class DemoServer:
    """The scripted model on 127.0.0.1, speaking just enough of the OpenAI API, within
    ``limits``. With ``record_requests`` it keeps every chat completion request it read (for
    tests); otherwise it keeps none."""

    host: str = "127.0.0.1"
    port: int = 0
    limits: ServeLimits = field(factory=ServeLimits)
    record_requests: bool = False
    requests: list[dict[str, Any]] = field(factory=list)
    _http: BoundedHttpServer | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def open_connections(self) -> int:
        return self._http.open_connections if self._http is not None else 0

    async def __aenter__(self) -> DemoServer:
        self._http = BoundedHttpServer(self.answer, self.limits, self.host, self.port)
        await self._http.start()
        self.port = self._http.port
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    def answer(self, request: HttpRequest) -> Reply:
        """The reply to one request (what the scripted model streams, or an OpenAI-shaped
        error)."""
        method = _ROUTES.get(request.path)
        if method is None:
            return api_error(
                404, f"Invalid URL ({request.method} {request.path})", code="unknown_url"
            )
        if request.method != method:
            return api_error(
                405,
                f"{request.method} is not allowed on {request.path}; use {method}",
                code="method_not_allowed",
                headers=(("allow", method),),
            )
        if request.path == "/v1/models":
            return json_reply(200, _models_listed())
        asked = _completion_request(request.body)
        if isinstance(asked, Reply):
            return asked
        model, messages, tools = asked
        if self.record_requests:
            self.requests.append(json.loads(request.body))
        if model == RATE_LIMITED_MODEL:
            return api_error(
                429,
                "Rate limit reached for requests",
                kind="requests",
                code="rate_limit_exceeded",
                headers=(("retry-after", "20"),),
            )
        return event_stream(scripted_reply(messages, tools))


# --------------------------------------------------------------------------- the demo tools
_DEMO_WEATHER = {"London": ("drizzle", 14), "Rome": ("sunny", 26), "Oslo": ("snow", -3)}


def demo_tools(memory: list[str]) -> list[Tool]:
    async def get_weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        city = str(arguments.get("city", "?"))
        sky, temp_c = _DEMO_WEATHER.get(city, ("clear", 21))
        return ToolResult(data={"city": city, "sky": sky, "temp_c": temp_c}, message="demo data")

    async def update_short_term_memory(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        memory.append(str(arguments.get("note", "")))
        return ToolResult(data={"saved": True})

    return [
        Tool(
            "get_weather",
            "Current weather for a city.",
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            get_weather,
        ),
        Tool(
            "update_short_term_memory",
            "Remember a short note about the user (silent).",
            {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]},
            update_short_term_memory,
            requires_follow_up=False,
        ),
    ]


# --------------------------------------------------------------------------- printing
class LiveTrace:
    """Prints every transition, delivery and notice as it happens (colour on a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.colour = out.isatty() and os.environ.get("NO_COLOR") is None

    def _paint(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.colour else text

    def attempt_step(self, attempt: int, step: TraceStep) -> None:
        self.step(step, indent="      ")

    def step(self, step: TraceStep, indent: str = "  ") -> None:
        if step.detail:
            self.out.write(self._paint(f"  ⟲ {step.detail}\n", "33"))
        elif step.state == step.next_state:
            self.out.write(self._paint(f"{indent}  · {step.state} ({step.event})\n", "2"))
        else:
            arrow = f"{step.state} --{step.event}--> {step.next_state}"
            colour = "36" if indent == "      " else "1;34"
            self.out.write(f"{indent}→ " + self._paint(arrow, colour) + "\n")
        self.out.flush()

    def delivery(self, delivered: Delivered) -> None:
        what = repr(delivered.text) if delivered.text is not None else f"[{delivered.expression}]"
        self.out.write(self._paint(f"  ✉ delivered {what}\n", "32"))

    def notice(self, notice: Notice) -> None:
        self.out.write(self._paint(f"  ! notice {notice.key}: {dict(notice.params)}\n", "35"))

    def line(self, text: str) -> None:
        self.out.write(text + "\n")


@define
class PrintingChannel:
    """A channel that shows what the turn delivers."""

    trace: LiveTrace
    delivered: list[Delivered] = field(factory=list)

    async def send_text(self, text: str) -> None:
        item = Delivered(len(self.delivered), text=text)
        self.delivered.append(item)
        self.trace.delivery(item)

    async def send_expression(self, expression: str) -> None:
        item = Delivered(len(self.delivered), expression=expression)
        self.delivered.append(item)
        self.trace.delivery(item)

    async def send_notice(self, notice: Notice) -> None:
        self.trace.notice(notice)

    async def queue_front(self, stop_message: str) -> None:
        self.trace.line(f"  ⏹ queued first: {stop_message!r}")

    async def attempt_superseded(self, attempt: int, label: str, delivered_text: str) -> None:
        self.trace.line(f"  ⟲ attempt {attempt} ({label}) superseded; kept {delivered_text!r}")


def summary(result: GenerationTurnResult, out: TextIO) -> None:
    out.write("\nResult\n")
    reason = f" ({result.reason})" if result.reason else ""
    out.write(f"  status        {result.status.value}{reason}\n")
    out.write(f"  reply         {result.delivered_text!r}\n")
    out.write(f"  credentials   {result.credential_source}\n")
    for record in result.attempts:
        key = f"key #{record.key_index}" if record.key_index is not None else "no key"
        state = f"superseded after {record.reason}" if record.superseded else record.status.value
        out.write(f"  attempt {record.index}     {record.label} ({key}): {state}\n")
    for entry in result.history:
        outcome = "ok" if entry.response.success else f"failed: {entry.response.reason}"
        arguments = json.dumps(dict(entry.call.arguments))
        out.write(f"  tool          {entry.call.name}({arguments}) → {outcome}\n")
    usage = result.usage
    out.write(f"  usage         {usage.input_tokens} in / {usage.output_tokens} out\n")


# --------------------------------------------------------------------------- running
class PrintingReviewer:
    """The demo's reviewer: a `ModelReviewer` whose verdicts are printed as they come."""

    def __init__(self, reviewer: Reviewer, trace: LiveTrace) -> None:
        self.reviewer = reviewer
        self.trace = trace

    async def review(self, packet: ReviewPacket) -> Verdict:
        what = "the tool call" if packet.proposed_call is not None else "the drafted reply"
        self.trace.line(f"  reviewer: asked about {what} ({len(packet.candidate)} characters held)")
        verdict = await self.reviewer.review(packet)
        if isinstance(verdict, Revise):
            for finding in verdict.findings:
                self.trace.line(
                    f"  reviewer: revise — {finding.category.value}: {finding.problem} "
                    f"→ {finding.direction}"
                )
        elif isinstance(verdict, Unavailable):
            self.trace.line(f"  reviewer: unavailable ({verdict.reason})")
        else:
            self.trace.line("  reviewer: pass")
        return verdict


async def run_demo(
    out: TextIO = sys.stdout,
    *,
    base_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    drafting: bool = False,
) -> GenerationTurnResult:
    """The full demo turn: against the embedded server, or against ``base_url``/``model``.
    ``drafting`` holds the reply for a `ModelReviewer` asking the same server (the embedded
    one sends the first draft back once, so a revision happens)."""
    trace = LiveTrace(out)
    memory: list[str] = []
    request = TurnRequest([{"role": "user", "content": QUESTION}])
    loop = LoopPolicy(delivery_flush_chars=24, first_token_timeout=60, drafting=drafting)
    turn_policy = TurnPolicy(loop=loop)
    channel = PrintingChannel(trace)
    reviewer: list[Reviewer | None] = [None]

    async def turn(attempts: list[Attempt]) -> GenerationTurnResult:
        return await run_generation_turn(
            attempts,
            demo_tools(memory),
            channel,
            request,
            policy=turn_policy,
            signals=TurnSignals(),
            on_step=trace.step,
            on_attempt_step=trace.attempt_step,
            reviewer=reviewer[0],
        )

    def reviewer_at(url: str, name: str, key: str | None) -> PrintingReviewer:
        asked = OpenAICompatibleProvider(url, name, api_key=key)
        return PrintingReviewer(ModelReviewer(asked), trace)

    if base_url is not None:
        assert model is not None
        trace.line(f"toolloop-fsm demo against {base_url} (model {model})\n")
        provider = OpenAICompatibleProvider(base_url, model, api_key=api_key)
        if drafting:
            reviewer[0] = reviewer_at(base_url, model, api_key)
        result = await turn([Attempt(provider, label=model)])
    else:
        async with DemoServer() as server:
            trace.line(
                f"toolloop-fsm demo: embedded OpenAI-compatible server at {server.base_url}\n"
                f"  chain: {RATE_LIMITED_MODEL} (its key is rate-limited) → {ANSWERING_MODEL}\n"
                f"  user:  {QUESTION}\n"
            )
            if drafting:
                trace.line(
                    "  drafting: nothing is shown until the reviewer (the same server) passes "
                    "the reply\n"
                )
                reviewer[0] = reviewer_at(server.base_url, ANSWERING_MODEL, "demo-review-key")

            def model_at(name: str) -> Callable[[str | None], OpenAICompatibleProvider]:
                return lambda key: OpenAICompatibleProvider(server.base_url, name, api_key=key)

            result = await turn(
                [
                    Attempt(
                        model_at(RATE_LIMITED_MODEL), keys=("demo-key-1",), label=RATE_LIMITED_MODEL
                    ),
                    Attempt(model_at(ANSWERING_MODEL), keys=("demo-key-2",), label=ANSWERING_MODEL),
                ]
            )
    summary(result, out)
    if memory:
        out.write(f"  memory        {memory}\n")
    return result


#: The port `toolloop-fsm serve` listens on unless told otherwise (the README's example
#: points at it).
SERVE_PORT = 8765


async def serve(
    out: TextIO = sys.stdout, *, port: int = SERVE_PORT, limits: ServeLimits | None = None
) -> None:
    """Run the embedded scripted model on 127.0.0.1 until cancelled (Ctrl-C), so a host can
    try the library without a model: its first line names the base URL. It keeps no request
    it answered, and holds connections within ``limits``."""
    bounds = limits or ServeLimits()
    async with DemoServer(port=port, limits=bounds) as server:
        out.write(f"toolloop-fsm serve: the scripted demo model at {server.base_url}\n")
        out.write(
            f"  models: {ANSWERING_MODEL} (answers, calling the tools a request offers: "
            f"get_weather, update_short_term_memory), {RATE_LIMITED_MODEL} (always HTTP 429, "
            "Retry-After 20)\n"
            f"  limits: bodies up to {bounds.max_body_bytes} bytes, "
            f"{bounds.max_connections} connections, idle ones closed after "
            f"{bounds.idle_timeout:g} s\n"
            "  any API key is accepted; Ctrl-C stops it\n"
        )
        out.flush()
        await asyncio.Event().wait()


def unreachable_message(result: GenerationTurnResult, base_url: str) -> str | None:
    """A clear sentence when the endpoint could not be used at all, else None."""
    if result.status.value != "error" or result.reason != "provider_error":
        return None
    kind = result.provider_error_kind
    detail = result.error_message or "no detail"
    if kind == "connection":
        return f"cannot reach {base_url}: {detail}"
    if kind == "auth":
        return f"{base_url} refused the credentials: {detail}"
    if kind in ("not_found", "bad_request"):
        return f"{base_url} refused the request: {detail}"
    return f"{base_url} failed: {detail}"
