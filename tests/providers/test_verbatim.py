"""VerbatimToolCalls: tool calls written in text become FunctionCalls; the rest flows as text.

Also the prompt-side helpers (scaffolding added for verbatim models, stripped for native ones).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers import VerbatimToolCalls
from toolloop_fsm.providers.verbatim import SCAFFOLDING_KEY
from toolloop_fsm.providers.verbatim import VERBATIM_BUFFER_CAP
from toolloop_fsm.providers.verbatim import is_verbatim_scaffolding
from toolloop_fsm.providers.verbatim import prepare_context
from toolloop_fsm.providers.verbatim import strip_verbatim_scaffolding
from toolloop_fsm.providers.verbatim import verbatim_scaffolding
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

# --------------------------------------------------------------------------- tools
GET_WEATHER = ToolSpec(
    "get_weather",
    "Current weather for a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
GET_TIME = ToolSpec("get_time", "The current time.", {"type": "object", "properties": {}})
SEARCH = ToolSpec(
    "search",
    "Web search.",
    {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    },
)
BOOK_FLIGHT = ToolSpec(
    "book_flight",
    "Book a flight.",
    {
        "type": "object",
        "properties": {"origin": {"type": "string"}, "destination": {"type": "string"}},
        "required": ["origin", "destination"],
    },
)
SET_VOLUME = ToolSpec(
    "set_volume",
    "Set the volume.",
    {"type": "object", "properties": {"level": {"type": "integer"}}, "required": ["level"]},
)
TOOLS = (GET_WEATHER, GET_TIME, SEARCH, BOOK_FLIGHT, SET_VOLUME)
NAMES = tuple(tool.name for tool in TOOLS)


# --------------------------------------------------------------------------- a scripted provider
class ScriptedChunks:
    """Yields the scripted chunks; ``after_chunk(i)`` runs when the consumer asks for more."""

    name = "scripted"

    def __init__(
        self,
        chunks: Sequence[Chunk],
        *,
        after_chunk: Callable[[int], None] | None = None,
        fail_with: Exception | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.after_chunk = after_chunk
        self.fail_with = fail_with
        self.requests: list[ProviderRequest] = []

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        self.requests.append(request)
        for index, chunk in enumerate(self.chunks):
            yield chunk
            if self.after_chunk is not None:
                self.after_chunk(index)
        if self.fail_with is not None:
            raise self.fail_with


def request_for(tools: Sequence[ToolSpec] = TOOLS, **fields: Any) -> ProviderRequest:
    return ProviderRequest([{"role": "user", "content": "hi"}], tools=tools, **fields)


def pieces(text: str, cuts: Sequence[int] = ()) -> list[Chunk]:
    """``text`` as TextDeltas split at ``cuts``."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    return [TextDelta(text[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


def every(text: str, size: int) -> list[int]:
    return list(range(size, len(text), size))


async def collect(provider: Provider, request: ProviderRequest | None = None) -> list[Chunk]:
    wrapped = VerbatimToolCalls(provider)
    return [chunk async for chunk in wrapped.stream(request or request_for())]


def drive(coroutine: Coroutine[Any, Any, list[Chunk]]) -> list[Chunk]:
    """Run a coroutine that never suspends (the scripted provider never waits)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: list[Chunk] = done.value
        return result
    coroutine.close()
    raise AssertionError("the scripted stream suspended")


def run(text: str, cuts: Sequence[int] = (), tools: Sequence[ToolSpec] = TOOLS) -> list[Chunk]:
    return drive(collect(ScriptedChunks(pieces(text, cuts)), request_for(tools)))


Shape = list[str | tuple[str, Any, bool]]


def shape(events: Sequence[Chunk]) -> Shape:
    """Text merged into strings, calls as (name, arguments, truncated); other chunks dropped."""
    out: Shape = []
    for event in events:
        if isinstance(event, TextDelta):
            if out and isinstance(out[-1], str):
                out[-1] += event.text
            else:
                out.append(event.text)
        elif isinstance(event, FunctionCall):
            out.append((event.name, event.arguments, event.truncated))
    return out


def text_of(events: Sequence[Chunk]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def calls_of(events: Sequence[Chunk]) -> list[FunctionCall]:
    return [event for event in events if isinstance(event, FunctionCall)]


# --------------------------------------------------------------------------- accepted forms
PARIS = ("get_weather", {"city": "Paris"}, False)

ACCEPTED: list[tuple[str, str, Shape]] = [
    (
        "bare",
        'Let me check. get_weather({"city": "Paris"}) Done.',
        ["Let me check. ", PARIS, " Done."],
    ),
    ("bare at start", 'get_weather({"city": "Paris"})', [PARIS]),
    ("one backtick", 'Use `get_weather({"city": "Paris"})` now', ["Use ", PARIS, " now"]),
    ("two backticks", "``get_time()``", [("get_time", {}, False)]),
    ("three backticks inline", '```get_weather({"city": "Paris"})``` ok', [PARIS, " ok"]),
    (
        "fence with language",
        'Sure:\n```json\nget_weather({"city": "Paris"})\n```\nOK',
        ["Sure:\n", PARIS, "\nOK"],
    ),
    ("fence without language", "```\nget_time()\n```", [("get_time", {}, False)]),
    (
        "fence with language word, blanks and blank lines",
        '```tool_code  \r\n\n  get_weather("Paris")\n\n```',
        [PARIS],
    ),
    ("empty arguments, no required parameter", "get_time()", [("get_time", {}, False)]),
    ("empty object for a tool without parameters", "get_time({})", [("get_time", {}, False)]),
    ("string for the one required string parameter", 'get_weather("Paris")', [PARIS]),
    (
        "string when the other parameters are optional",
        'search("cats (and dogs)")',
        [("search", {"query": "cats (and dogs)"}, False)],
    ),
    (
        "nested JSON with ) and backticks inside strings",
        'get_weather({"city": "Pa)ris `x` ```", "extra": {"l": [1, {"a": "}])"}], "q": "\\")"}})',
        [
            (
                "get_weather",
                {"city": "Pa)ris `x` ```", "extra": {"l": [1, {"a": "}])"}], "q": '")'}},
                False,
            )
        ],
    ),
    ("blanks around the argument", 'get_weather( {"city": "Paris"}\n)', [PARIS]),
    (
        "non-string single parameter as an object",
        'set_volume({"level": 3})',
        [("set_volume", {"level": 3}, False)],
    ),
    (
        "two calls with prose between",
        'a get_time() b `search("x")` c',
        ["a ", ("get_time", {}, False), " b ", ("search", {"query": "x"}, False), " c"],
    ),
    (
        "unicode around a call",
        'Météo → get_weather({"city": "Zürich 東京"}) ✓',
        ["Météo → ", ("get_weather", {"city": "Zürich 東京"}, False), " ✓"],
    ),
    (
        "after punctuation",
        '(get_weather({"city": "Paris"}))',
        ["(", PARIS, ")"],
    ),
    ("complete arguments, ) missing at stream end", 'get_weather({"city": "Paris"}', [PARIS]),
    (
        "closing fence missing at stream end: the stream end finalises the call",
        'x\n```json\nget_weather({"city": "Paris"})\n',
        ["x\n", PARIS],
    ),
    # A wrapper that does not close properly is not part of the call, but the call inside
    # it still stands on its own as a bare call; the stray backticks stay text.
    ("blank before the closing backtick", "`get_time() `", ["`", ("get_time", {}, False), " `"]),
    (
        "text after the call inside the fence",
        "```\nget_time() now\n```",
        ["```\n", ("get_time", {}, False), " now\n```"],
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
@pytest.mark.parametrize("chunk_size", [1, 2, 7, 10_000])
def test_accepted_forms(text: str, expected: Shape, chunk_size: int) -> None:
    assert shape(run(text, every(text, chunk_size))) == expected


def test_tool_names_that_prefix_each_other() -> None:
    tools = [
        ToolSpec("get", "", {"type": "object", "properties": {}}),
        GET_WEATHER,
    ]
    text = 'get() get_weather("Paris") get_x()'
    for size in (1, 3, 100):
        assert shape(run(text, every(text, size), tools)) == [
            ("get", {}, False),
            " ",
            PARIS,
            " get_x()",
        ]


# --------------------------------------------------------------------------- rejected forms
REJECTED: list[tuple[str, str]] = [
    ("unknown name", 'get_wether({"city": "Paris"})'),
    ("unknown name with empty arguments", "unknown_tool()"),
    ("empty arguments when a parameter is required", "get_weather()"),
    ("empty arguments in a span when a parameter is required", "`get_weather()` is wrong"),
    ("string argument for a tool with two required parameters", 'book_flight("Paris")'),
    ("string argument for a non-string parameter", 'set_volume("3")'),
    ("trailing garbage after the object", 'get_weather({"city": "Paris"} please)'),
    ("two arguments", 'get_weather("Paris", "London")'),
    ("not at a word boundary", 'xget_weather("Paris")'),
    ("not at a word boundary: underscore", "_get_time()"),
    ("not at a word boundary: digit", "9get_time()"),
    ("blank between name and parenthesis", "get_time ()"),
    ("keyword arguments", 'get_weather(city="Paris")'),
    ("single-quoted JSON", "get_weather({'city': 'Paris'})"),
    ("unquoted value", "get_weather({city: Paris})"),
    ("invalid JSON number", 'get_weather({"city": "Paris", "days": 01})'),
    ("mismatched brackets", 'get_weather({"city": ["Paris"}])'),
    ("bad string escape", 'get_weather("Pa\\qris")'),
    ("raw newline inside a JSON string", 'get_weather("Pa\nris")'),
    ("name only, in a span", "Use `get_time` for that."),
    ("name only, in prose", "I could call get_weather, but won't."),
    ("unclosed fence with code at stream end", '```python\nprint("hi")\n'),
    ("unclosed fence with a name only at stream end", "```\nget_weather"),
    ("unclosed fence with JSON at stream end", '```json\n{"name": "get_weather"}'),
    ("a fence that is not a call", "```js\nconsole.log(1)\n```\n"),
    ("cut-off malformed arguments at stream end", 'get_weather({"city" 3'),
    ("garbage after the arguments, then the cut", '```json\nget_weather({"city": "P"}, '),
    ("opening parenthesis then prose", "get_time( is what I'd call"),
]


@pytest.mark.parametrize("text", [c[1] for c in REJECTED], ids=[c[0] for c in REJECTED])
@pytest.mark.parametrize("chunk_size", [1, 3, 10_000])
def test_rejected_forms_are_released_unchanged(text: str, chunk_size: int) -> None:
    events = run(text, every(text, chunk_size))
    assert calls_of(events) == []
    assert text_of(events) == text


def test_over_cap_candidate_is_released_as_text() -> None:
    text = 'see get_weather({"city": "' + "x" * (VERBATIM_BUFFER_CAP + 500) + '"}) end'
    events = run(text, every(text, 97))
    assert calls_of(events) == []
    assert text_of(events) == text


def test_a_call_exactly_at_the_cap_is_accepted_and_one_more_character_is_not() -> None:
    def call_of_length(length: int) -> str:
        padding = length - len('get_weather({"city": ""})')
        return 'get_weather({"city": "' + "y" * padding + '"})'

    at_cap = call_of_length(VERBATIM_BUFFER_CAP)
    assert shape(run(at_cap, every(at_cap, 50))) == [
        ("get_weather", {"city": "y" * (VERBATIM_BUFFER_CAP - 25)}, False)
    ]
    over = call_of_length(VERBATIM_BUFFER_CAP + 1)
    assert shape(run(over, every(over, 50))) == [over]


# --------------------------------------------------------------------------- stream end
@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('get_weather({"city": "Paris", "days": 3', {"city": "Paris"}),
        ('get_weather({"city": "Par', {}),
        ('`get_weather({"city": "Paris", "extra": ["a", "b', {"city": "Paris", "extra": ["a"]}),
        ('get_weather("Par', {}),
        ("get_weather(", {}),
        ("get_weather(  \n", {}),
    ],
)
def test_cut_off_call_at_stream_end_is_truncated(text: str, arguments: Any) -> None:
    events = run(text, every(text, 4))
    assert shape(events) == [("get_weather", arguments, True)]


def test_empty_argument_list_cut_at_stream_end_is_truncated() -> None:
    # Even for a tool without required parameters: "get_time(" may have been cut before
    # optional arguments, so it must not run as get_time().
    assert shape(run("now get_time(")) == ["now ", ("get_time", {}, True)]


async def test_truncated_call_after_prose() -> None:
    events = await collect(
        ScriptedChunks(pieces('Checking now: get_weather({"city": "Pa', [5, 20]))
    )
    assert shape(events) == ["Checking now: ", ("get_weather", {}, True)]


# --------------------------------------------------------------------------- streaming behaviour
async def test_call_split_across_many_chunks() -> None:
    text = 'Before. ```json\nget_weather({"city": "Paris", "q": "a)b"})\n``` After.'
    events = await collect(ScriptedChunks(pieces(text, range(1, len(text)))))
    assert shape(events) == [
        "Before. ",
        ("get_weather", {"city": "Paris", "q": "a)b"}, False),
        " After.",
    ]


async def test_prose_before_a_call_is_delivered_before_the_call_arrives() -> None:
    released: list[str] = []
    seen: list[str] = []

    def after_chunk(index: int) -> None:
        seen.append("".join(released))

    script = ScriptedChunks(
        [TextDelta("The weather: "), TextDelta("get_wea"), TextDelta('ther("Paris")')],
        after_chunk=after_chunk,
    )
    async for event in VerbatimToolCalls(script).stream(request_for()):
        if isinstance(event, TextDelta):
            released.append(event.text)
    assert seen == ["The weather: ", "The weather: ", "The weather: "]


async def test_call_ids_are_numbered_after_the_history_and_marked_verbatim() -> None:
    history = [
        ToolHistoryEntry(ToolCallRecord("get_time", {}), ToolResponseRecord(success=True)),
        ToolHistoryEntry(ToolCallRecord("get_time", {}), ToolResponseRecord(success=True)),
    ]
    script = ScriptedChunks(pieces('get_time() and search("x")'))
    events = await collect(script, request_for(history=history))
    calls = calls_of(events)
    assert [call.call_id for call in calls] == ["verbatim_3", "verbatim_4"]
    # each call records how much of the pass's text came before it: here " and " came between
    assert [call.provider_data for call in calls] == [
        {"verbatim": True, "text_before": 0},
        {"verbatim": True, "text_before": 5},
    ]
    assert all(call.parse_error is None for call in calls)


async def test_the_wrapped_provider_gets_the_request_without_native_tools() -> None:
    script = ScriptedChunks(pieces("hello"))
    request = request_for()
    await collect(script, request)
    (sent,) = script.requests
    assert sent.tools == ()
    assert list(sent.context) == list(request.context) and sent.prefill == request.prefill


async def test_chunks_without_a_possible_call_pass_through_untouched() -> None:
    plain = TextDelta("Plain prose, nothing to see.")
    failing_at_once = TextDelta("a `b` and (c) {d}")
    events = await collect(ScriptedChunks([plain, failing_at_once]))
    assert events[0] is plain
    assert events[1] is failing_at_once


async def test_without_tools_everything_passes_through() -> None:
    chunks: list[Chunk] = [TextDelta("get_time()"), ThoughtDelta("t"), UsageReport(1, 2)]
    events = await collect(ScriptedChunks(chunks), request_for(tools=()))
    assert events == chunks
    assert all(a is b for a, b in zip(events, chunks, strict=True))


async def test_non_text_chunks_keep_their_place() -> None:
    thought = ThoughtDelta("hmm")
    usage = UsageReport(10, 5)
    finish = FinishReason(FinishKind.STOP)
    native = FunctionCall("search", {"query": "n"}, call_id="native_1")
    script = ScriptedChunks(
        [
            TextDelta("Hi get_wea"),
            thought,
            TextDelta('ther({"city": "P"}) ok'),
            native,
            TextDelta(" see get_"),
            usage,
            TextDelta("x and get_time("),
            finish,
        ]
    )
    events = await collect(script)
    assert [type(e).__name__ if not isinstance(e, TextDelta) else e.text for e in events] == [
        "Hi ",
        "ThoughtDelta",  # arrived while the call was being written: before the call
        "FunctionCall",
        " ok",
        "FunctionCall",  # the native call, in its place
        " see ",
        "get_",
        "UsageReport",  # arrived after "get_" and before "x"
        "x and ",
        "FunctionCall",  # get_time( settled at stream end ...
        "FinishReason",  # ... before the finish reason that followed it
    ]
    assert events[1] is thought and events[4] is native and events[-1] is finish


async def test_a_chunk_arriving_inside_released_text_splits_it_in_place() -> None:
    thought = ThoughtDelta("t")
    script = ScriptedChunks([TextDelta("x `get_t"), thought, TextDelta("ea` y")])
    events = await collect(script)
    assert [e.text if isinstance(e, TextDelta) else e for e in events] == [
        "x ",
        "`get_t",
        thought,
        "ea` y",
    ]


async def test_provider_error_propagates_and_held_text_is_dropped() -> None:
    error = ProviderError("boom", kind="server", retryable=True)
    script = ScriptedChunks(pieces('ok get_weather({"ci'), fail_with=error)
    received: list[Chunk] = []
    with pytest.raises(ProviderError):
        async for event in VerbatimToolCalls(script).stream(request_for()):
            received.append(event)
    assert shape(received) == ["ok "]


def test_provider_attributes() -> None:
    script = ScriptedChunks([])
    wrapped = VerbatimToolCalls(script)
    assert wrapped.name == "scripted"
    assert wrapped.tool_calling == "verbatim"
    assert isinstance(wrapped, Provider)
    assert not hasattr(wrapped, "continuation_style")

    class Continuing(ScriptedChunks):
        continuation_style = True

    assert VerbatimToolCalls(Continuing([])).continuation_style is True
    with pytest.raises(ValueError, match="buffer_cap"):
        VerbatimToolCalls(script, buffer_cap=0)


# --------------------------------------------------------------------------- properties
_FRAGMENTS = st.one_of(
    st.sampled_from(NAMES).flatmap(lambda n: st.integers(1, len(n)).map(lambda k: n[:k])),
    st.sampled_from(
        [
            *("`", "``", "```", "````", "(", ")", "()", "({", "})", '("', '")', "{", "}", "["),
            *("]", '"', "\\", ":", ",", " ", "\n", "json", "_", "x", "1", "!", '{"city": "P"}'),
        ]
    ),
    st.text(st.characters(codec="utf-8"), max_size=4),
)
_TEXTS = st.lists(_FRAGMENTS, max_size=25).map("".join)


def _cuts(text: str) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=_TEXTS)
def test_property_chunking_never_changes_the_outcome(data: st.DataObject, text: str) -> None:
    whole = run(text)
    chunked = run(text, data.draw(_cuts(text)))
    assert shape(chunked) == shape(whole)
    if not calls_of(whole):
        # A text with no valid call passes through complete and unchanged.
        assert text_of(chunked) == text


_NO_PAREN_FRAGMENTS = st.one_of(
    st.sampled_from(NAMES).flatmap(lambda n: st.integers(1, len(n)).map(lambda k: n[:k])),
    st.sampled_from(["`", "``", "```", "````", "{", "}", '"', " ", "\n", "\t", "json", "x", "."]),
    st.text(st.characters(codec="utf-8", exclude_characters="("), max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=st.lists(_NO_PAREN_FRAGMENTS, max_size=25).map("".join))
def test_property_text_without_calls_passes_through_whole(data: st.DataObject, text: str) -> None:
    events = run(text, data.draw(_cuts(text)))
    assert calls_of(events) == []
    assert text_of(events) == text


_PREFIXES = "|".join(re.escape(name[:k]) for name in NAMES for k in range(len(name), 0, -1))
# What may still begin a call when no "(" has come yet: an opening backtick run, a fence
# with its language word and newline, and a prefix of a tool name (or a whole name).
_COULD_BEGIN = re.compile(
    rf"`{{1,2}}(?:{_PREFIXES})?|```(?:[\w+.#-]*[ \t\r]*(?:\n[ \t\r\n]*(?:{_PREFIXES})?)?)?"
    rf"|(?:{_PREFIXES})"
)


def _expected_holdback(text: str) -> str:
    """The shortest suffix of ``text`` (no "(" in it) that could still begin a call."""
    for start in range(len(text)):
        before = text[start - 1] if start else ""
        if text[start] == "`":
            if before == "`":
                continue
        elif re.match(r"\w", before):
            continue
        if _COULD_BEGIN.fullmatch(text, start):
            return text[start:]
    return ""


@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=st.lists(_NO_PAREN_FRAGMENTS, max_size=25).map("".join))
def test_property_holdback_is_only_what_could_begin_a_call(data: st.DataObject, text: str) -> None:
    chunks = pieces(text, data.draw(_cuts(text)))
    released: list[str] = []
    checks: list[tuple[str, str]] = []

    def after_chunk(index: int) -> None:
        fed = "".join(c.text for c in chunks[: index + 1] if isinstance(c, TextDelta))
        checks.append((fed, "".join(released)))

    async def consume() -> list[Chunk]:
        script = ScriptedChunks(chunks, after_chunk=after_chunk)
        async for event in VerbatimToolCalls(script).stream(request_for()):
            if isinstance(event, TextDelta):
                released.append(event.text)
        return []

    drive(consume())
    for fed, out in checks:
        assert fed.startswith(out)
        assert fed[len(out) :] == _expected_holdback(fed)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    text=st.lists(st.one_of(_FRAGMENTS, st.sampled_from(["!", "?", ";"])), max_size=25).map(
        "".join
    ),
)
def test_property_a_chunk_ending_where_no_call_can_continue_releases_everything(
    data: st.DataObject, text: str
) -> None:
    # Without quotes no JSON string can be open, so "!" can neither begin nor continue a
    # call: once a chunk ends with it, everything fed so far has been released.
    text = text.replace('"', "'") + "!"
    chunks = pieces(text, data.draw(_cuts(text)))
    released: list[str] = []
    fed_when_asked: list[str] = []
    events: list[Chunk] = []

    def after_chunk(index: int) -> None:
        fed = "".join(c.text for c in chunks[: index + 1] if isinstance(c, TextDelta))
        if fed.endswith("!"):
            fed_when_asked.append(fed)
            assert "".join(released) == fed

    async def consume() -> list[Chunk]:
        script = ScriptedChunks(chunks, after_chunk=after_chunk)
        async for event in VerbatimToolCalls(script).stream(request_for()):
            events.append(event)
            if isinstance(event, TextDelta):
                released.append(event.text)
        return events

    assume(not calls_of(run(text)))
    drive(consume())
    assert fed_when_asked[-1] == text


VALID_CALLS: list[tuple[str, tuple[str, Any, bool]]] = [
    ('get_weather({"city": "Paris"})', PARIS),
    ('get_weather({"city": "a)b\\"c`)"})', ("get_weather", {"city": 'a)b"c`)'}, False)),
    ("`get_time()`", ("get_time", {}, False)),
    ('``search("q)")``', ("search", {"query": "q)"}, False)),
    ("```get_time({})```", ("get_time", {}, False)),
    (
        '```json\nget_weather({"city": "Oslo", "n": [1, {"x": ")"}]})\n```',
        ("get_weather", {"city": "Oslo", "n": [1, {"x": ")"}]}, False),
    ),
    ('```\nsearch("x")\n```', ("search", {"query": "x"}, False)),
    (
        'book_flight({"origin": "A", "destination": "B"})',
        ("book_flight", {"origin": "A", "destination": "B"}, False),
    ),
]


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    before=_TEXTS,
    after=_TEXTS,
    call=st.sampled_from(VALID_CALLS),
)
def test_property_one_call_in_prose_is_found_however_it_is_chunked(
    data: st.DataObject, before: str, after: str, call: tuple[str, tuple[str, Any, bool]]
) -> None:
    before += " "
    source, expected = call
    # The prose must not hold a candidate open into the call, nor hold calls of its own.
    assume(shape(run(before)) == [before])
    held_open = run(before + "\x00")
    assume(shape(held_open) == [before + "\x00"])
    assume(shape(run(after)) in ([after], []))
    assume(not after.startswith("`"))
    text = before + source + after
    events = run(text, data.draw(_cuts(text)))
    assert shape(events) == [before, expected, *([after] if after else [])]


# --------------------------------------------------------------------------- scaffolding
CONTEXT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful bot."},
    {"role": "system", "content": "Server rules."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me see."},
    {"role": "user", "content": "Please."},
]


def test_scaffolding_lists_every_tool_and_the_accepted_forms() -> None:
    (message,) = verbatim_scaffolding(TOOLS)
    assert message["role"] == "system"
    assert message[SCAFFOLDING_KEY] == "verbatim"
    assert is_verbatim_scaffolding(message)
    content = message["content"]
    for tool in TOOLS:
        assert f"{tool.name}({{...}})" in content
        assert f'"name": "{tool.name}"' in content
        assert tool.description in content
    assert "get_time()" in content and "get_weather()" not in content
    assert 'get_weather("...")' in content and 'book_flight("...")' not in content
    assert "fenced code block" in content and "backticks" in content
    assert '"required": ["city"]' in content


def test_scaffolding_for_no_tools_is_nothing() -> None:
    assert verbatim_scaffolding([]) == []
    assert prepare_context(CONTEXT, [], verbatim=True) == CONTEXT


def test_verbatim_context_gets_scaffolding_after_the_leading_system_messages() -> None:
    prepared = prepare_context(CONTEXT, TOOLS, verbatim=True)
    assert prepared[:2] == CONTEXT[:2]
    assert is_verbatim_scaffolding(prepared[2])
    assert prepared[3:] == CONTEXT[2:]
    assert [m for m in prepared if not is_verbatim_scaffolding(m)] == CONTEXT


def test_native_context_has_no_scaffolding() -> None:
    assert prepare_context(CONTEXT, TOOLS, verbatim=False) == CONTEXT


def test_fallbacks_native_verbatim_native_are_exact() -> None:
    verbatim = prepare_context(CONTEXT, TOOLS, verbatim=True)
    assert prepare_context(verbatim, TOOLS, verbatim=True) == verbatim
    native = prepare_context(verbatim, TOOLS, verbatim=False)
    assert native == CONTEXT
    assert prepare_context(native, TOOLS, verbatim=True) == verbatim
    assert strip_verbatim_scaffolding(verbatim) == CONTEXT


def test_scaffolding_follows_the_current_tools() -> None:
    first = prepare_context(CONTEXT, TOOLS, verbatim=True)
    again = prepare_context(first, [GET_TIME], verbatim=True)
    assert again == prepare_context(CONTEXT, [GET_TIME], verbatim=True)
    assert sum(is_verbatim_scaffolding(m) for m in again) == 1


def test_context_without_system_messages_gets_scaffolding_first() -> None:
    context = [{"role": "user", "content": "hi"}]
    prepared = prepare_context(context, TOOLS, verbatim=True)
    assert is_verbatim_scaffolding(prepared[0]) and prepared[1:] == context


_MESSAGES = st.one_of(
    st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(["system", "user", "assistant"]),
        st.text(max_size=5),
    ),
    st.just(verbatim_scaffolding(TOOLS)[0]),
)


@settings(max_examples=200, deadline=None)
@given(context=st.lists(_MESSAGES, max_size=8), flags=st.lists(st.booleans(), min_size=1))
def test_property_preparing_is_idempotent_and_only_the_last_choice_counts(
    context: list[dict[str, Any]], flags: list[bool]
) -> None:
    prepared: list[dict[str, Any]] = list(context)
    for verbatim in flags:
        prepared = prepare_context(prepared, TOOLS, verbatim=verbatim)
    assert prepared == prepare_context(context, TOOLS, verbatim=flags[-1])
    assert prepare_context(prepared, TOOLS, verbatim=flags[-1]) == prepared
    assert sum(is_verbatim_scaffolding(m) for m in prepared) == int(flags[-1])
    assert strip_verbatim_scaffolding(prepared) == strip_verbatim_scaffolding(context)


async def test_the_wrapped_provider_gets_no_native_tools_and_the_history_as_text() -> None:
    from toolloop_fsm.result import ToolCallRecord
    from toolloop_fsm.result import ToolHistoryEntry
    from toolloop_fsm.result import ToolResponseRecord

    seen: list[ProviderRequest] = []

    class Recording:
        name = "plain"

        async def _play(self) -> Any:
            yield TextDelta("ok")

        def stream(self, request: ProviderRequest) -> Any:
            seen.append(request)
            return self._play()

    entry = ToolHistoryEntry(
        ToolCallRecord("get_weather", {"city": "Paris"}, "verbatim_1"),
        ToolResponseRecord(True, data={"sky": "clear"}, message="live"),
        pre_tool_text="Checking. ",
    )
    request = ProviderRequest(
        [{"role": "user", "content": "weather?"}],
        tools=(ToolSpec("get_weather", "w", {"type": "object"}),),
        history=(entry,),
    )
    chunks = [c async for c in VerbatimToolCalls(Recording()).stream(request)]
    assert chunks == [TextDelta("ok")]
    (wire,) = seen
    assert wire.tools == () and wire.history == ()
    assert wire.context[1] == {
        "role": "assistant",
        "content": 'Checking. get_weather({"city": "Paris"})',
    }
    assert wire.context[2]["role"] == "user"
    assert '"sky": "clear"' in wire.context[2]["content"]


async def test_text_written_after_a_verbatim_call_is_replayed_after_the_call() -> None:
    # The model wrote prose, a call, then more prose. The next request must show it its own
    # message in that order: shown the later prose first, a model copies the garbled form.
    from toolloop_fsm import Tool
    from toolloop_fsm import ToolResult
    from toolloop_fsm import TurnRequest
    from toolloop_fsm import run_tool_loop
    from toolloop_fsm.testing import RecordingChannel
    from toolloop_fsm.testing import ScriptedProvider
    from toolloop_fsm.testing import VirtualClock

    clock = VirtualClock()
    model = ScriptedProvider(
        [
            [
                TextDelta("Let me check. "),
                TextDelta('get_weather({"city": "Paris"})'),
                TextDelta(" One moment, please."),
            ],
            [TextDelta("Clear and 21 °C.")],
        ],
        clock=clock,
    )

    async def get_weather(arguments: dict[str, Any], _ctx: Any) -> ToolResult:
        return ToolResult(data={"sky": "clear"})

    tool = Tool("get_weather", "w", dict(GET_WEATHER.parameters), get_weather)
    result = await run_tool_loop(
        VerbatimToolCalls(model),
        [tool],
        RecordingChannel(clock=clock),
        TurnRequest([{"role": "user", "content": "Weather in Paris?"}]),
        clock=clock,
    )

    assert result.final_text == "Clear and 21 °C."
    follow_up = model.requests[1].context
    assert follow_up[1] == {
        "role": "assistant",
        "content": 'Let me check. get_weather({"city": "Paris"}) One moment, please.',
    }
