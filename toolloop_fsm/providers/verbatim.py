"""Verbatim tool calling (docs/behaviour.md §10.3): tool calls written in the assistant's text.

This module owns both sides of verbatim tool calling:

* `VerbatimToolCalls(provider)` wraps any provider. Calls the model writes as text —
  ``name({...})`` bare, in an inline code span of one to three backticks, or alone in a fenced
  code block — come out as ordinary `FunctionCall` events, so the loop treats verbatim and
  native models alike. Everything else in the text flows on as `TextDelta`; only the
  shortest suffix that could still begin a call is held back.
* `verbatim_scaffolding`, `strip_verbatim_scaffolding` and `prepare_context` are the prompt
  side the outer tier uses when it prepares each attempt's context: the system message that
  shows a verbatim model its tools and the accepted call forms, marked so that it can be
  stripped again when the turn falls back to a native model.

Accepted argument forms: ``()`` only when the tool has no required parameter; one JSON object;
one JSON string only when the tool has exactly one required parameter and it is a string
(decoded to ``{parameter: value}``). A call is finalised when its closing parenthesis (and the
closing backticks or fence it was opened with) arrived, or when the stream ends; anything
malformed or naming an unknown tool is released as ordinary text, unchanged.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import AsyncIterator
from collections.abc import Sequence
from enum import Enum
from enum import auto
from typing import Any

import attrs
from attrs import frozen

from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers._arguments import decode_arguments
from toolloop_fsm.providers._history import ToolBatch
from toolloop_fsm.providers._history import tool_batches
from toolloop_fsm.providers._history import tool_response_json
from toolloop_fsm.scaffolding import _NO_FORMS
from toolloop_fsm.scaffolding import SCAFFOLDING_KEY
from toolloop_fsm.scaffolding import VERBATIM_SCAFFOLDING
from toolloop_fsm.scaffolding import _call_forms
from toolloop_fsm.scaffolding import is_verbatim_scaffolding
from toolloop_fsm.scaffolding import prepare_context
from toolloop_fsm.scaffolding import strip_verbatim_scaffolding
from toolloop_fsm.scaffolding import verbatim_scaffolding

VERBATIM_BUFFER_CAP = 8192
"""The longest candidate call held back (docs/behaviour.md §10.3), in characters."""


# --------------------------------------------------------------------------- the scanner
def _call_start_pattern(names: Sequence[str]) -> str:
    """A pattern matching exactly where a call can begin in the text seen so far.

    A bare call begins with ``name(`` — or a prefix of it that reaches the end of the text —
    at a word boundary; a span with one or two backticks and then the same; a fence or a
    three-backtick span with three backticks. The names go in as a trie so that prose words
    sharing a tool name's first letters ("get", "set") and ordinary `code` spans are ruled
    out by one search instead of opening a candidate each time.
    """
    name = _name_trie(names) if names else "(?!)"
    return rf"(?<!`)(?:```|``?(?:\Z|{name}))|(?<!\w){name}"


def _name_trie(names: Sequence[str]) -> str:
    trie: dict[str, Any] = {}
    for name in names:
        node = trie
        for char in name + "(":
            node = node.setdefault(char, {})

    def branches(node: dict[str, Any]) -> str:
        options = [
            re.escape(char) + (rf"(?:\Z|{branches(child)})" if child else "")
            for char, child in sorted(node.items())
        ]
        return f"(?:{'|'.join(options)})"

    return branches(trie)


class _Phase(Enum):
    TICKS = auto()  # inside the opening backtick run
    LANG = auto()  # after ```: a fence's language word, or the name of a ```name()``` span
    LANG_SPACE = auto()  # blanks after the language word, before the fence's newline
    FENCE_BODY = auto()  # whitespace inside the fence, before the name
    NAME = auto()
    ARGS = auto()  # after "(", before the argument value
    STRUCT = auto()  # inside a JSON object or array, outside strings
    STRING = auto()  # inside a JSON string
    AFTER_ARGS = auto()  # after the argument value, before ")"
    CLOSE_TICKS = auto()  # the closing backtick run (of a span, or the closing fence)
    FENCE_END = auto()  # whitespace between ")" and the closing fence


class _Form(Enum):
    BARE = auto()
    SPAN = auto()
    FENCE = auto()


class _Step(Enum):
    MORE = auto()  # every character offered was consumed; the candidate is still open
    CALL = auto()  # the call is complete
    FAIL = auto()  # the candidate cannot be a call


@frozen
class _RecognisedCall:
    """A call found in the text, and how many characters of text it replaces."""

    call: FunctionCall
    source_length: int


_Piece = str | _RecognisedCall

_WHITESPACE = frozenset(" \t\r\n")
_BLANKS = frozenset(" \t\r")
_LANGUAGE_PUNCTUATION = frozenset("-+.#")
# Outside strings, a JSON object can only contain structure, numbers and true/false/null;
# anything else proves early that the candidate is prose, so it is released at once.
_JSON_OUTSIDE_STRINGS = frozenset(" \t\r\n:,0123456789+-.eEtruefalsn")
_JSON_CLOSERS = {"}": "{", "]": "["}
# Raw control characters are invalid inside JSON strings: they end a candidate early.
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_WORD = re.compile(r"\w")


class _CallScanner:
    """Turns a text stream into released text and recognised calls.

    The result is a pure function of the whole text: at each position a call is tried; if
    the text there cannot be a call, one character is released and the rest is scanned
    again. Chunk boundaries only decide *when* text is released, never *what* is released.
    """

    __slots__ = (
        "_arg_start",
        "_arguments",
        "_cap",
        "_closing",
        "_escaped",
        "_form",
        "_forms",
        "_held",
        "_name",
        "_name_starts",
        "_next_call",
        "_open",
        "_phase",
        "_prefixes",
        "_previous",
        "_stack",
        "_start",
        "_ticks",
        "_tool",
        "_word",
    )

    def __init__(self, tools: Sequence[ToolSpec], *, first_call: int, cap: int) -> None:
        self._forms = {tool.name: _call_forms(tool) for tool in tools if tool.name}
        names = list(self._forms)
        self._prefixes = frozenset(name[:k] for name in names for k in range(1, len(name) + 1))
        self._name_starts = frozenset(name[0] for name in names)
        self._start = re.compile(_call_start_pattern(names))
        self._cap = cap
        self._next_call = first_call
        self._previous = ""  # the character just before the scan position
        self._open = False
        self._held = ""
        self._reset()

    @property
    def holding(self) -> bool:
        return self._open

    def _reset(self) -> None:
        self._open = False
        self._held = ""
        self._phase = _Phase.NAME
        self._form = _Form.BARE
        self._ticks = 0
        self._closing = 0
        self._word = ""
        self._name = ""
        self._tool = _NO_FORMS
        self._stack: list[str] = []
        self._escaped = False
        self._arg_start = 0
        self._arguments: dict[str, Any] = {}

    # ----------------------------------------------------------------- driving
    def passes_through(self, text: str) -> bool:
        """Whether ``text`` goes out untouched: nothing is held and no call can begin in it.

        This is the per-chunk fast path: one regular-expression search over the chunk.
        """
        if self._open:
            return False
        if not text:
            return True
        match = self._start.search(text)
        if match is not None and match.start() == 0 and not self._boundary_before(text[0]):
            match = self._start.search(text, 1)
        if match is not None:
            return False
        self._previous = text[-1]
        return True

    def feed(self, text: str) -> list[_Piece]:
        """Scan more text; returns what can be released now, in order."""
        pieces: list[_Piece] = []
        self._scan(text, pieces)
        return pieces

    def finish(self) -> list[_Piece]:
        """The stream ended: settle the held candidate."""
        pieces: list[_Piece] = []
        while self._open:
            candidate = self._held
            call = self._settle_at_end()
            self._reset()
            if call is not None:
                pieces.append(_RecognisedCall(call, len(candidate)))
                self._previous = candidate[-1]
                break
            self._release(candidate[0], pieces)
            self._scan(candidate[1:], pieces)
        return pieces

    def _boundary_before(self, first: str) -> bool:
        """Whether a call may begin with ``first`` right after the previous character.

        The start pattern's look-behind cannot see the previous chunk's last character.
        """
        if first == "`":
            return self._previous != "`"
        return not _WORD.match(self._previous or " ")

    def _next_start(self, work: str, i: int) -> int:
        """Index of the first position at or after ``i`` where a call could begin."""
        match = self._start.search(work, i)
        if match is not None and match.start() == 0 and not self._boundary_before(work[0]):
            match = self._start.search(work, 1)
        return len(work) if match is None else match.start()

    def _release(self, text: str, pieces: list[_Piece]) -> None:
        if pieces and isinstance(pieces[-1], str):
            pieces[-1] += text
        else:
            pieces.append(text)
        self._previous = text[-1]

    def _scan(self, work: str, pieces: list[_Piece]) -> None:
        i = 0
        n = len(work)
        while i < n:
            if not self._open:
                j = self._next_start(work, i)
                if j > i:
                    self._release(work[i:j], pieces)
                    i = j
                    continue
                self._open = True
                if work[i] == "`":
                    self._phase = _Phase.TICKS
                    self._form = _Form.SPAN
            limit = min(n, i + self._cap - len(self._held))
            j, step = self._advance(work, i, limit)
            candidate = self._held + work[i:j]
            if step is _Step.MORE:
                if j < n:
                    # Over the buffer cap: the candidate goes out as text, as it is.
                    self._reset()
                    self._release(candidate, pieces)
                    i = j
                    continue
                self._held = candidate
                return
            if step is _Step.CALL:
                pieces.append(_RecognisedCall(self._make_call(), len(candidate)))
                self._reset()
                self._previous = candidate[-1]
                i = j
                continue
            self._reset()
            # Not a call from its first character on; a call may still begin after it.
            self._release(candidate[0], pieces)
            work = candidate[1:] + work[j:]
            i = 0
            n = len(work)

    # ----------------------------------------------------------------- the candidate
    def _advance(self, work: str, i: int, limit: int) -> tuple[int, _Step]:
        """Consume ``work[i:limit]`` into the open candidate, as far as it goes."""
        first = i
        origin = len(self._held) - first  # candidate offset of work[k] is origin + k
        while i < limit:
            phase = self._phase
            c = work[i]
            if phase is _Phase.STRING:
                if self._escaped:
                    self._escaped = False
                    i += 1
                    continue
                stop = _STRING_STOP.search(work, i, limit)
                if stop is None:
                    i = limit
                    break
                i = stop.start()
                c = work[i]
                if c == "\\":
                    self._escaped = True
                    i += 1
                    continue
                if c != '"':
                    return i, _Step.FAIL
                i += 1
                if self._stack:
                    self._phase = _Phase.STRUCT
                    continue
                argument_text = (self._held + work[first:i])[self._arg_start :]
                try:
                    value = json.loads(argument_text)
                except ValueError:
                    return i, _Step.FAIL
                assert self._tool.string_parameter is not None
                self._arguments = {self._tool.string_parameter: value}
                self._phase = _Phase.AFTER_ARGS
            elif phase is _Phase.STRUCT:
                if c == '"':
                    self._phase = _Phase.STRING
                elif c == "{" or c == "[":
                    self._stack.append(c)
                elif c in _JSON_CLOSERS:
                    if not self._stack or self._stack[-1] != _JSON_CLOSERS[c]:
                        return i, _Step.FAIL
                    self._stack.pop()
                    if not self._stack:
                        argument_text = (self._held + work[first : i + 1])[self._arg_start :]
                        arguments, _, error = decode_arguments(argument_text, cut=False)
                        if error is not None or not isinstance(arguments, dict):
                            return i, _Step.FAIL
                        self._arguments = arguments
                        self._phase = _Phase.AFTER_ARGS
                elif c not in _JSON_OUTSIDE_STRINGS:
                    return i, _Step.FAIL
                i += 1
            elif phase is _Phase.NAME:
                if self._name + c in self._prefixes:
                    self._name += c
                elif c == "(" and self._name in self._forms:
                    self._tool = self._forms[self._name]
                    self._phase = _Phase.ARGS
                else:
                    return i, _Step.FAIL
                i += 1
            elif phase is _Phase.ARGS:
                if c == ")":
                    if not self._tool.accepts_empty:
                        return i, _Step.FAIL
                    self._arguments = {}
                    i += 1
                    if self._after_parenthesis():
                        return i, _Step.CALL
                    continue
                if c == "{":
                    self._stack = ["{"]
                    self._phase = _Phase.STRUCT
                    self._arg_start = origin + i
                elif c == '"':
                    if self._tool.string_parameter is None:
                        return i, _Step.FAIL
                    self._phase = _Phase.STRING
                    self._arg_start = origin + i
                elif c not in _WHITESPACE:
                    return i, _Step.FAIL
                i += 1
            elif phase is _Phase.AFTER_ARGS:
                if c == ")":
                    i += 1
                    if self._after_parenthesis():
                        return i, _Step.CALL
                    continue
                if c not in _WHITESPACE:
                    return i, _Step.FAIL  # trailing garbage after the argument
                i += 1
            elif phase is _Phase.CLOSE_TICKS:
                if c != "`":
                    return i, _Step.FAIL
                self._closing += 1
                i += 1
                if self._closing == self._ticks:
                    return i, _Step.CALL
            elif phase is _Phase.FENCE_END:
                if c == "`":
                    self._phase = _Phase.CLOSE_TICKS
                    continue
                if c not in _WHITESPACE:
                    return i, _Step.FAIL
                i += 1
            elif phase is _Phase.TICKS:
                if c == "`":
                    self._ticks += 1
                    i += 1
                    if self._ticks > 3:
                        return i, _Step.FAIL
                elif self._ticks == 3:
                    self._phase = _Phase.LANG
                elif c in self._name_starts:
                    self._phase = _Phase.NAME
                else:
                    return i, _Step.FAIL
            elif phase is _Phase.LANG:
                if c == "(":
                    if self._word not in self._forms:
                        return i, _Step.FAIL
                    self._name = self._word
                    self._tool = self._forms[self._word]
                    self._phase = _Phase.ARGS
                elif c == "\n":
                    self._form = _Form.FENCE
                    self._phase = _Phase.FENCE_BODY
                elif c in _BLANKS:
                    self._phase = _Phase.LANG_SPACE
                elif _WORD.match(c) or c in _LANGUAGE_PUNCTUATION:
                    self._word += c
                else:
                    return i, _Step.FAIL
                i += 1
            elif phase is _Phase.LANG_SPACE:
                if c == "\n":
                    self._form = _Form.FENCE
                    self._phase = _Phase.FENCE_BODY
                elif c not in _BLANKS:
                    return i, _Step.FAIL
                i += 1
            else:  # _Phase.FENCE_BODY
                if c in self._name_starts:
                    self._phase = _Phase.NAME
                    continue
                if c not in _WHITESPACE:
                    return i, _Step.FAIL
                i += 1
        return i, _Step.MORE

    def _after_parenthesis(self) -> bool:
        """The closing parenthesis arrived; True when that completes the call."""
        if self._form is _Form.BARE:
            return True
        if self._form is _Form.SPAN:
            self._phase = _Phase.CLOSE_TICKS
        else:
            self._phase = _Phase.FENCE_END
            self._ticks = 3
        self._closing = 0
        return False

    def _settle_at_end(self) -> FunctionCall | None:
        """The call the held candidate makes now that no more text will come, if any."""
        phase = self._phase
        if phase is _Phase.ARGS:
            # "name(" and nothing after it: the model began a call and was cut off before
            # its first argument byte — a truncated call, never a call without arguments
            # (which might run a tool whose optional arguments were about to follow).
            return self._make_call(arguments={}, truncated=True)
        if phase in (_Phase.AFTER_ARGS, _Phase.CLOSE_TICKS, _Phase.FENCE_END):
            return self._make_call()
        if phase is _Phase.STRING and not self._stack:
            # A cut-off string argument: its value is incomplete, so none is kept.
            return self._make_call(arguments={}, truncated=True)
        if phase in (_Phase.STRUCT, _Phase.STRING):
            arguments, truncated, error = decode_arguments(self._held[self._arg_start :], cut=True)
            if error is not None or not isinstance(arguments, dict):
                return None
            return self._make_call(arguments=arguments, truncated=truncated)
        return None

    def _make_call(
        self, *, arguments: dict[str, Any] | None = None, truncated: bool = False
    ) -> FunctionCall:
        call = FunctionCall(
            self._name,
            self._arguments if arguments is None else arguments,
            call_id=f"verbatim_{self._next_call}",
            truncated=truncated,
            provider_data={"verbatim": True},
        )
        self._next_call += 1
        return call


# --------------------------------------------------------------------------- causal order
class _CausalOrder:
    """Keeps non-text chunks in their place relative to the text around them.

    A chunk that arrives while text is held is deferred and emitted right after the text
    (or call) that preceded it, so the output order is the input order with each call
    standing where its text ended.
    """

    __slots__ = ("_deferred", "_received", "_released")

    def __init__(self) -> None:
        self._received = 0  # characters of text received
        self._released = 0  # characters of text released or turned into calls
        self._deferred: deque[tuple[int, Chunk]] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._deferred)

    def received(self, length: int) -> None:
        self._received += length

    def defer(self, chunk: Chunk) -> None:
        self._deferred.append((self._received, chunk))

    def place(self, pieces: list[_Piece]) -> list[Chunk | _RecognisedCall]:
        out: list[Chunk | _RecognisedCall] = []
        deferred = self._deferred
        for piece in pieces:
            start = self._released
            if isinstance(piece, str):
                end = start + len(piece)
                cut = 0
                while deferred and deferred[0][0] < end:
                    offset, chunk = deferred.popleft()
                    if offset - start > cut:
                        out.append(TextDelta(piece[cut : offset - start]))
                        cut = offset - start
                    out.append(chunk)
                out.append(TextDelta(piece[cut:]))
            else:
                # The call is known when its last character arrives: what came in while it
                # was being written goes first.
                end = start + piece.source_length
                while deferred and deferred[0][0] < end:
                    out.append(deferred.popleft()[1])
                out.append(piece)
            self._released = end
        return out

    def flush(self) -> list[Chunk]:
        out = [chunk for _, chunk in self._deferred]
        self._deferred.clear()
        return out


# --------------------------------------------------------------------------- the provider
class VerbatimToolCalls:
    """A provider whose model writes its tool calls as text; yields them as `FunctionCall`s.

    ``stream`` hands the wrapped provider the request in text form (`as_verbatim_request`:
    no native tools, the tool history as plain messages) and rewrites its text:
    calls of ``request.tools`` become `FunctionCall` events (ids ``verbatim_<n>``, numbered on
    from the calls already in ``request.history``; ``provider_data`` says ``"verbatim": True``
    and, under ``"text_before"``, how many characters of text the pass released before it);
    all other chunks pass through in order. If the wrapped stream raises, text held as a
    possible call is dropped with it: it was never delivered, and a failed pass's half call
    must not run.

    A model writing its calls has no option asking for one call per response:
    ``parallel_tool_calls`` sends nothing (the wrapped provider gets no tools), and every call
    the pass writes is run.
    """

    tool_calling = "verbatim"

    __slots__ = ("buffer_cap", "name", "provider")

    def __init__(self, provider: Provider, *, buffer_cap: int = VERBATIM_BUFFER_CAP) -> None:
        if buffer_cap < 1:
            raise ValueError(f"buffer_cap must be at least 1, got {buffer_cap}")
        self.provider = provider
        self.name = provider.name
        self.buffer_cap = buffer_cap

    @property
    def continuation_style(self) -> Any:
        """The wrapped provider's; absent (AttributeError) when it has none."""
        return getattr(self.provider, "continuation_style")  # noqa: B009

    def __repr__(self) -> str:
        return f"VerbatimToolCalls({self.provider!r})"

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        chunks = self.provider.stream(as_verbatim_request(request))
        try:
            if not request.tools:
                async for chunk in chunks:
                    yield chunk
                return
            scanner = _CallScanner(
                request.tools, first_call=len(request.history) + 1, cap=self.buffer_cap
            )
            order = _CausalOrder()
            passes_through = scanner.passes_through
            # characters of text yielded so far: a recognised call records where in the
            # pass's text it stood, so that the history replays the text around it in order
            emitted = 0
            async for chunk in chunks:
                if not isinstance(chunk, TextDelta):
                    if scanner.holding:
                        order.defer(chunk)
                    else:
                        yield chunk
                    continue
                if passes_through(chunk.text):
                    # Offsets in `order` only matter relative to each other while text is
                    # held, so text that flows straight through need not be counted.
                    emitted += len(chunk.text)
                    yield chunk
                    continue
                was_holding = scanner.holding
                pieces = scanner.feed(chunk.text)
                if (
                    not was_holding
                    and not scanner.holding
                    and len(pieces) == 1
                    and isinstance(pieces[0], str)
                ):
                    # A candidate opened and failed inside the chunk: it still goes untouched.
                    emitted += len(chunk.text)
                    yield chunk
                    continue
                order.received(len(chunk.text))
                for out in order.place(pieces):
                    emitted, out = _positioned(out, emitted)
                    yield out
                if not scanner.holding and order.pending:
                    for out in order.flush():
                        yield out
            for out in order.place(scanner.finish()):
                emitted, out = _positioned(out, emitted)
                yield out
            for out in order.flush():
                yield out
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()


TEXT_BEFORE_KEY = "text_before"
"""``provider_data`` key of a recognised call: how many characters of the pass's text the
model wrote before the call (the rest of the pass's text came after it)."""


def _positioned(placed: Chunk | _RecognisedCall, emitted: int) -> tuple[int, Chunk]:
    """Count released text; a recognised call becomes its `FunctionCall`, marked with the
    number of characters of text released before it."""
    if isinstance(placed, TextDelta):
        return emitted + len(placed.text), placed
    if isinstance(placed, _RecognisedCall):
        data = {**(placed.call.provider_data or {}), TEXT_BEFORE_KEY: emitted}
        return emitted, attrs.evolve(placed.call, provider_data=data)
    return emitted, placed


def _replayed_message(batch: ToolBatch) -> str:
    """The assistant's message as the model wrote it: the pass's text with each call of the
    batch standing where it was written (at the end when that is not recorded), in order."""
    text = batch.pre_tool_text or ""
    pieces: list[str] = []
    written = 0  # characters of the text already placed
    for entry in batch.entries:
        call = entry.call
        before = (call.provider_data or {}).get(TEXT_BEFORE_KEY)
        if not isinstance(before, int) or isinstance(before, bool) or not 0 <= before <= len(text):
            before = len(text)
        # a call never stands before the one the model wrote ahead of it
        before = max(before, written)
        arguments = json.dumps(dict(call.arguments), ensure_ascii=False, sort_keys=True)
        pieces.append(f"{text[written:before]}{call.name}({arguments})")
        written = before
    pieces.append(text[written:])
    return "".join(pieces)


def _replayed_results(batch: ToolBatch) -> str:
    """Every response of the batch, one ``[result of name] {…}`` line each, in order."""
    return "\n".join(
        f"[result of {entry.call.name}] {tool_response_json(entry.response)}"
        for entry in batch.entries
    )


def as_verbatim_request(request: ProviderRequest) -> ProviderRequest:
    """The request as a model without native tool calling must receive it: no ``tools`` (a
    server may reject them for such a model) and each tool batch as two plain messages —
    the assistant's message as it wrote it (the pass's text with every call, written as it
    writes calls, where it stood), then the tool's responses as one user message. Such a
    model has no option asking for one call per response: ``parallel_tool_calls`` reaches
    the wrapped provider with no tools, so it sends nothing of it either."""
    if not request.tools and not request.history:
        return request
    transcript: list[dict[str, Any]] = []
    for batch in tool_batches(request.history):
        transcript.append({"role": "assistant", "content": _replayed_message(batch)})
        transcript.append({"role": "user", "content": _replayed_results(batch)})
    return attrs.evolve(request, context=(*request.context, *transcript), tools=(), history=())


__all__ = [
    "SCAFFOLDING_KEY",
    "TEXT_BEFORE_KEY",
    "VERBATIM_BUFFER_CAP",
    "VERBATIM_SCAFFOLDING",
    "VerbatimToolCalls",
    "as_verbatim_request",
    "is_verbatim_scaffolding",
    "prepare_context",
    "strip_verbatim_scaffolding",
    "verbatim_scaffolding",
]
