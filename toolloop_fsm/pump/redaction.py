"""Key redaction: of the text a provider streams, before the machine takes it (`StreamMask`:
the channel, observers, live events, snapshots, tools, the history and the result all see
the same masked text; the in-process pumps and a durable turn's worker both read through
it), of a provider's failure (`Secrets.masked_failure`), of what a tool returns
(`Secrets.masked_outcome`), of a whole result (every text holding a key, or an 8-character
run of one, redacted before a result leaves the outer tier), and of every text a log record
or an observed event carries (`Secrets`)."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import re
import sys
from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import attrs

from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers._secrecy import FRAGMENT
from toolloop_fsm.providers._secrecy import REDACTED
from toolloop_fsm.providers._secrecy import fragment_pattern
from toolloop_fsm.providers._secrecy import pieces
from toolloop_fsm.providers._secrecy import provider_secrets
from toolloop_fsm.providers._secrecy import redact
from toolloop_fsm.providers._secrecy import secret_spans


class Secrets:
    """The API keys of one turn, for every text that leaves it: what the provider streams
    (`stream_mask`), what a tool returns (`masked_outcome`), a log record, an observed
    event. Under the outer tier they are every key of the chain and the running provider's
    own (`with_provider`); in a `run_tool_loop` turn, the provider's own: an HTTP adapter's
    ``secrets`` (its key and credential headers), or a custom provider's ``api_key``.
    Without any, only ``key=`` query values and URL passwords are masked in records and
    events, and the stream is read as it comes."""

    __slots__ = ("_leak", "_tails", "keys")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = tuple(dict.fromkeys(key for key in keys if key))
        self._leak = fragment_pattern(self.keys)
        self._tails = _stream_tails(self.keys)

    def with_provider(self, provider: object) -> Secrets:
        """These keys and the ones ``provider`` holds (`provider_secrets`)."""
        own = [key for key in provider_secrets(provider) if key not in self.keys]
        return Secrets((*self.keys, *own)) if own else self

    def clean(self, text: str) -> str:
        """``text`` with every key, every 8-character run of one, every ``key=`` query value
        and every URL password replaced by ``[REDACTED]``."""
        return redact(text, self.keys)

    def holds_any(self, text: str) -> bool:
        """Whether ``text`` holds a key or a run of one (a quick test before `clean`)."""
        return self._leak is not None and self._leak.search(text) is not None

    # ------------------------------------------------------------------ the provider's stream
    def mask(self, text: str) -> str:
        """``text`` with every key and every 8-character run of one replaced by
        ``[REDACTED]`` (the keys only: what the model wrote stays as it wrote it)."""
        if self._leak is None or self._leak.search(text) is None:
            return text
        return _masked_spans(text, 0, len(text), _merged(secret_spans(text, self.keys)), -1)

    def mask_value(self, value: Any) -> Any:
        """A JSON value (a call's arguments) with `mask` applied to every text in it, names
        included; ``value`` itself when it holds no piece of a key."""
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, Mapping):
            pairs = [(self.mask_value(name), self.mask_value(item)) for name, item in value.items()]
            if all(
                name is old_name and item is old_item
                for (name, item), (old_name, old_item) in zip(pairs, value.items(), strict=True)
            ):
                return value
            return dict(pairs)
        if isinstance(value, list | tuple):
            items = [self.mask_value(item) for item in value]
            if all(a is b for a, b in zip(value, items, strict=True)):
                return value
            return items if isinstance(value, list) else tuple(items)
        return value

    def masked_outcome(self, event: ToolFinished) -> ToolFinished:
        """What a tool returned (or how it failed), masked before the machine takes it: its
        data, message, expression, failure reason and a context restart's item; ``event``
        itself when none of them holds a piece of a key. A tool may quote a key it was
        handed or found, and what it says goes to the history, the next request, the
        channel (its expression, its failure notice) and the result."""
        if self._leak is None:
            return event
        data = self.mask_value(event.data)
        message = self.mask(event.message) if type(event.message) is str else event.message
        expression = event.expression
        if type(expression) is str:
            expression = self.mask(expression)
        error = self.mask(event.error) if type(event.error) is str else event.error
        restart = event.context_restart
        if restart is not None:
            item = self.mask_value(restart.item)
            if item is not restart.item:
                restart = attrs.evolve(restart, item=item)
        if (
            data is event.data
            and message is event.message
            and expression is event.expression
            and error is event.error
            and restart is event.context_restart
        ):
            return event
        return attrs.evolve(
            event,
            data=data,
            message=message,
            expression=expression,
            error=error,
            context_restart=restart,
        )

    def masked_failure(self, err: Exception) -> StreamFailed:
        """What a provider's exception means to the machine: a `ProviderError` as it
        classified itself, anything else a retryable ``provider_error``; its message masked
        as a log record is (`clean`: the keys, and the ``key=`` query values and URL passwords
        an error may quote; it is never delivered, so nothing has to match a delivery); every
        shell that reads a stream fails a pass with it."""
        if isinstance(err, ProviderError):
            return StreamFailed(
                self.clean(err.message) if isinstance(err.message, str) else err.message,
                kind=err.kind,
                retryable=err.retryable,
                status_code=err.status_code,
                retry_after=err.retry_after,
            )
        return StreamFailed(
            self.clean(f"the provider raised {type(err).__name__}: {err}"),
            kind="provider_error",
            retryable=True,
        )

    def stream_mask(self) -> StreamMask:
        """A mask for one pass's stream, which the pump hands each chunk through before the
        machine (or an observer) takes it (`StreamMask`)."""
        return StreamMask(self)

    def masked(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``stream`` with every key, and every 8-character run of one, masked (`StreamMask`
        over an iterator: for a reader that cannot hand chunks through the mask itself, as
        an observer's tap cannot); ``stream`` itself when the turn has no keys."""
        if self._leak is None:
            return stream
        return masked_stream(self.stream_mask(), stream)


@attrs.frozen
class _StreamTails:
    """What a streamed text may end with that the next chunk could complete into a piece of
    a key: every proper prefix of every piece (``starts``), and by the character such a
    prefix ends with, the lengths of the prefixes ending in it, longest first (``lengths``),
    and the longest one's length; and the shortest piece's length (a shorter text holds no
    piece: its search is spared; with no keys, larger than any text). A text ending in a
    character no prefix ends with holds nothing back; otherwise a few lookups tell how much
    it holds."""

    starts: frozenset[str]
    lengths: Mapping[str, tuple[int, ...]]
    longest: int
    shortest: int


@functools.lru_cache(maxsize=64)
def _stream_tails(keys: tuple[str, ...]) -> _StreamTails:
    """The `_StreamTails` of ``keys``, made once per set of keys (a turn's pumps each hold
    its `Secrets`; the prefixes of two keys are a few hundred strings)."""
    starts: set[str] = set()
    for key in keys:
        for piece in pieces(key):
            starts.update(piece[:size] for size in range(1, len(piece)))
    lengths: dict[str, set[int]] = {}
    for start in starts:
        lengths.setdefault(start[-1], set()).add(len(start))
    return _StreamTails(
        frozenset(starts),
        {end: tuple(sorted(sizes, reverse=True)) for end, sizes in lengths.items()},
        max(map(len, starts), default=0),
        min((min(len(key), FRAGMENT) for key in keys), default=sys.maxsize),
    )


class StreamMask:
    """The turn's keys masked out of one pass's stream, chunk by chunk. A key can arrive
    split over chunks, so a text or thought chunk holds back its tail while that tail could
    begin a piece of a key (at most 7 characters), and lets it through with the next chunk
    of its kind; before a chunk of another kind, at the end of the stream, before the
    stream's failure, and when a deadline or a stop is about to end the pass, the reader
    lets it through itself (`release_before`, `release`): what arrived is the model's all
    the same. A chunk with nothing to mask passes as it is. Call arguments, a malformed
    call's raw text and its parse error, and scene metadata are masked whole.

    A reader hands each chunk through in two steps: when text is held (``held``), the chunk
    that `release_before` returns goes first; then the one `admit` returns, if any."""

    __slots__ = (
        "_leak",
        "_lengths",
        "_longest",
        "_secrets",
        "_shortest",
        "_starts",
        "context",
        "held",
        "kind",
    )

    def __init__(self, secrets: Secrets) -> None:
        self._secrets = secrets
        self._leak = secrets._leak
        tails = secrets._tails
        self._starts = tails.starts
        self._lengths = tails.lengths
        self._longest = tails.longest
        self._shortest = tails.shortest
        #: the raw text held back (the start of a piece of a key, perhaps)
        self.held = ""
        #: the raw text just let through inside a mask (a piece that continues it is masked
        #: without a second ``[REDACTED]``)
        self.context = ""
        #: the kind of text chunk the mask is in (`TextDelta`, `ThoughtDelta`), if any
        self.kind: type | None = None

    def release(self) -> Any:
        """The held text as a chunk, masked (``None`` when nothing is held)."""
        return self._let_through("", final=True)

    def release_before(self, chunk: Any) -> Any:
        """The held text as a chunk, masked, when ``chunk`` does not continue it (a chunk
        of another kind); ``None`` when it does, or nothing is held."""
        kind = type(chunk)
        if (
            kind is self.kind
            and (kind is TextDelta or chunk.signature is None)
            and type(chunk.text) is str
        ):
            return None
        return self.release()

    def admit(self, chunk: Any) -> Any:
        """The chunk to hand on for ``chunk``: masked, joined to the held text it continues,
        its own tail held back; ``None`` when all of it is held. (Held text that ``chunk``
        does not continue was let through by `release_before`.)"""
        kind = type(chunk)
        if kind is TextDelta or (kind is ThoughtDelta and chunk.signature is None):
            text = chunk.text
            if type(text) is str:
                current = self.kind
                if current is not kind and current is not None:
                    assert not self.held, "release_before lets held text through first"
                    self.context = ""
                # the common case: nothing held, a text with no piece of a key (one shorter
                # than the shortest piece holds none, unsearched), whose tail begins none
                leak = self._leak
                if (
                    not self.held
                    and not self.context
                    and (text[-1:] not in self._lengths or self._hold_from(text) == len(text))
                    and (len(text) < self._shortest or (leak and leak.search(text)) is None)
                ):
                    self.kind = kind
                    return chunk
                return self._let_through(text, final=False, kind=kind, chunk=chunk)
        assert not self.held, "release_before lets held text through first"
        self.context = ""
        self.kind = None
        return self._masked_chunk(chunk)

    def _hold_from(self, buffer: str) -> int:
        """Where the longest suffix of ``buffer`` that is a proper prefix of a piece of a key
        begins (``len(buffer)`` when there is none)."""
        end = len(buffer)
        lengths = self._lengths.get(buffer[-1:])
        if lengths is not None:
            starts = self._starts
            for size in lengths:  # longest first
                if size <= end and buffer[end - size :] in starts:
                    return end - size
        return end

    def _let_through(
        self, text: str, *, final: bool, kind: type | None = None, chunk: Any = None
    ) -> Any:
        """The chunk to let through for ``text`` arriving after what is held (all of it when
        ``final``): masked, its tail held back; ``None`` when nothing is let through.
        ``chunk`` is the arriving chunk, passed on itself when nothing changed. (A text with
        nothing to mask or hold and nothing held before it is `admit`'s common case.)"""
        held, context = self.held, self.context
        if kind is None:
            kind = self.kind
            if kind is None:
                return None
        if not held and not context and not text:
            if final:
                self.kind = None
            return None  # nothing held, nothing arriving
        leak = self._leak
        shortest = self._shortest
        buffer = context + held + text
        start = len(context)
        spans = (
            _merged(secret_spans(buffer, self._secrets.keys))
            if leak is not None and len(buffer) >= shortest and leak.search(buffer) is not None
            else None
        )
        if final:
            cut = len(buffer)
        else:
            # the tail that may be the start of a piece is held (what was let through before
            # ``start`` cannot be: it is only looked at again); when a piece of a key reaches
            # into that tail, it is masked now and everything after it held, since the next
            # chunk may continue a piece that overlaps the mask
            cut = max(self._hold_from(buffer), start)
            if spans and spans[-1][1] > cut:
                cut = spans[-1][1]
        if spans:
            out = _masked_spans(buffer, start, cut, spans, start if context else -1)
            # whether what was let through ends inside a mask the next chunk may continue
            open_mask = spans[-1][1] == cut > start or (bool(context) and cut == start)
        else:
            out = buffer[start:cut]
            open_mask = bool(context) and cut == start
        self.held = buffer[cut:]
        self.context = buffer[max(0, cut - self._longest) : cut] if open_mask and not final else ""
        self.kind = None if final else kind
        if not out:
            return None
        if chunk is not None and out == chunk.text:
            return chunk
        if kind is ThoughtDelta:
            return ThoughtDelta(out)
        return TextDelta(out)

    def _masked_chunk(self, chunk: Any) -> Any:
        """A chunk other than streamed text, masked whole (itself when nothing changed)."""
        kind = type(chunk)
        secrets = self._secrets
        if kind is FunctionCall:
            arguments = secrets.mask_value(chunk.arguments)
            error = chunk.parse_error
            masked_error = secrets.mask(error) if type(error) is str else error
            if arguments is chunk.arguments and masked_error is error:
                return chunk
            return attrs.evolve(chunk, arguments=arguments, parse_error=masked_error)
        if kind in (SceneMetadata, ThoughtDelta, TextDelta) and type(chunk.text) is str:
            text = secrets.mask(chunk.text)
            return chunk if text is chunk.text else attrs.evolve(chunk, text=text)
        return chunk


async def masked_stream(mask: StreamMask, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``stream``'s chunks handed through ``mask``: what a reader that cannot hand each
    chunk through the mask itself reads instead (an observer's tap). Held text goes out
    before a chunk that does not continue it, at the end, and before a failure is raised."""
    try:
        try:
            async for chunk in stream:
                if mask.held:
                    released = mask.release_before(chunk)
                    if released is not None:
                        yield released
                out = mask.admit(chunk)
                if out is not None:
                    yield out
        except Exception:
            # what arrived before the failure is the model's: it goes first
            released = mask.release()
            if released is not None:
                yield released
            raise
        released = mask.release()
        if released is not None:
            yield released
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, overlapping or touching ones joined (as `redact` joins them)."""
    if not spans:
        return spans
    spans.sort()
    merged = [spans[0]]
    for start, end in spans[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def _masked_spans(
    text: str, start: int, end: int, spans: list[tuple[int, int]], masked_to: int
) -> str:
    """``text[start:end]`` with each of ``spans`` (merged, each ending by ``end``) replaced
    by ``[REDACTED]``; a span beginning by ``masked_to`` continues the mask let through
    just before ``start``, and adds none."""
    parts: list[str] = []
    position = start
    for span_start, span_end in spans:
        if span_end <= position:
            continue
        if span_start > masked_to:
            parts += (text[position:span_start], REDACTED)
        position = masked_to = span_end
    parts.append(text[position:end])
    return "".join(parts)


#: A turn that knows no keys.
NO_SECRETS = Secrets()


class RedactedError(Exception):
    """Stands in for a host exception whose message quoted an API key."""


def _scrub(value: Any, keys: Sequence[str], leak: re.Pattern[str]) -> Any:
    """Every text in ``value`` with every key, and every 8-character run of one, redacted
    (the adapters' own rule: a server may quote a key cut short or partly masked). ``leak``
    finds the texts that need it."""
    if isinstance(value, str):
        return redact(value, keys) if leak.search(value) else value
    if isinstance(value, dict):
        return {name: _scrub(item, keys, leak) for name, item in value.items()}
    if isinstance(value, list):
        return [_scrub(item, keys, leak) for item in value]
    return value


#: Declared field types that hold no text: a number, a flag (``None`` or not), written out or
#: resolved (the converter resolves a class's annotations in place). Result values are built
#: by the engine with these types, so such fields are never read for keys.
_TEXTLESS: frozenset[object] = frozenset(
    {
        *("int", "float", "bool", "int | None", "float | None", "bool | None"),
        *(int, float, bool, int | None, float | None, bool | None),
    }
)
#: Values that hold no text, passed over without a question; an enumeration's members (a
#: status, a kind) are added as they are met: declared names, nothing from outside the turn.
_LEAVES: set[type] = {int, float, bool}
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {}
#: Joins a value's texts for one search: a match cannot span two texts unless a key holds it.
_SEPARATOR = "\x00"
_BLOCK = FRAGMENT // 2


def _text_fields(kind: type) -> tuple[str, ...]:
    """The fields of an attrs or dataclass class that can hold text from outside the turn,
    computed once a class: not a number or flag, not an enumeration, not a name the library
    declares (`VOCABULARY` metadata)."""
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        if attrs.has(kind):
            # the types written out as names are resolved (the result converter does it too),
            # so that an enumeration-typed field is seen as one; a name that cannot be
            # resolved leaves its field read
            with contextlib.suppress(Exception):
                attrs.resolve_types(kind)
        declared = attrs.fields(kind) if attrs.has(kind) else dataclasses.fields(kind)
        names = tuple(
            field.name
            for field in declared
            if field.type not in _TEXTLESS
            and not (isinstance(field.type, type) and issubclass(field.type, enum.Enum))
            and not field.metadata.get("vocabulary", False)
        )
        _TEXT_FIELDS[kind] = names
    return names


def _gather_texts(value: Any, texts: list[str]) -> None:
    """Append every text reachable from ``value`` that can carry something from outside the
    turn — strings, in sequences, sets, mappings (names and values), attrs and dataclass
    instances — to ``texts``. Passed over: enumeration members and fields the library fills
    with its own declared names (`_text_fields`); a key cannot reach those, and a name that
    happened to match a run of a key would tell nothing of it."""
    kind = type(value)
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        if kind in _LEAVES:
            return
        if isinstance(value, enum.Enum):
            _LEAVES.add(kind)
            return
        if isinstance(value, str):
            texts.append(value)
            return
        if isinstance(value, list | tuple | set | frozenset):
            for item in value:
                if type(item) is str:  # the common cases, spared a call: a text, or a value
                    texts.append(item)  # of a class already met (a trace step, a delivery)
                elif (fields := _TEXT_FIELDS.get(type(item))) is not None:
                    _gather_fields(item, fields, texts)
                elif item is not None:
                    _gather_texts(item, texts)
            return
        if isinstance(value, Mapping):
            for name, item in value.items():
                _gather_texts(name, texts)
                _gather_texts(item, texts)
            return
        if not attrs.has(kind) and not (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            return
        names = _text_fields(kind)
    _gather_fields(value, names, texts)


def _gather_fields(value: Any, names: tuple[str, ...], texts: list[str]) -> None:
    """`_gather_texts` of the fields ``names`` of ``value``."""
    for name in names:
        item = getattr(value, name)
        if type(item) is str:
            texts.append(item)
        elif item is not None:
            _gather_texts(item, texts)


@functools.lru_cache(maxsize=64)
def _blocks(keys: tuple[str, ...]) -> frozenset[str]:
    """Texts of which any piece of a key `redact` replaces holds at least one: each key's
    aligned 4-character blocks (any 8-character run of a key covers a whole one), or the key
    itself when shorter than 8 characters (only then matched whole)."""
    blocks: set[str] = set()
    for key in keys:
        if len(key) < FRAGMENT:
            blocks.add(key)
        else:
            blocks.update(key[i : i + _BLOCK] for i in range(0, len(key) - _BLOCK + 1, _BLOCK))
    return frozenset(blocks)


def may_hold_key(
    value: Any, keys: Sequence[str], leak: re.Pattern[str], clean: dict[int, str] | None = None
) -> bool:
    """Whether any text in ``value`` holds a piece of a key ``leak`` finds — the quick test
    that spares a clean result the conversion and walk of `_scrub`. Never wrong when it
    answers no: every distinct text that can carry a key (`_gather_texts`) is searched,
    joined into one; a plain substring test for the keys' blocks first, the pattern only if
    one is there.

    ``clean`` holds the texts earlier looks of the same turn found clean, by identity (it
    keeps them alive, so an id is not reused): a turn's result shares most of its texts with
    its attempts' results, already looked at, so only the texts new to it are searched (a
    text made by joining two clean ones is a new text). A look that answers no adds the
    texts it searched."""
    texts: list[str] = []
    _gather_texts(value, texts)
    # one search per text object: a result holds the same text in several places
    fresh = {id(text): text for text in texts}
    if clean:
        fresh = {ident: text for ident, text in fresh.items() if clean.get(ident) is not text}
    joined = _SEPARATOR.join(fresh.values())
    if any(block in joined for block in _blocks(tuple(keys))):
        if any(_SEPARATOR in key for key in keys):  # a piece could span two texts: one by one
            if any(leak.search(text) is not None for text in fresh.values()):
                return True
        elif leak.search(joined) is not None:
            return True
    if clean is not None:
        clean.update(fresh)
    return False
