"""`ModelReviewer`: a ready `Reviewer` that asks a model for its verdict as strict JSON.

Owns the one request a review makes and every way it can go wrong:

* **The request.** One `ProviderRequest` with no tools: a system instruction (it begins with
  `REVIEW_MARKER`, which a scripted server may look for) that explains the job and the exact
  answer shape, and a user message that is the packet as one JSON document — the candidate,
  its status and what that status means, the trigger, the history, the tools with their
  outcomes, where the revision stands and, for a tool checkpoint, the proposed call.
* **The answer.** ``{"verdict": "pass"}``, or ``{"verdict": "revise", "findings": [...]}``
  with 1–4 findings, each ``{"category", "problem", "direction"}`` (a `FindingCategory`,
  then two non-blank texts of at most 300 characters), and no other keys. The answer may be
  wrapped in one Markdown code fence (```` ```json ```` or a bare ```` ``` ````); any other
  text around it makes it malformed. It is checked against `VERDICT_SCHEMA`, compiled once.
* **The byte budget.** The user message is at most ``max_input_bytes`` of UTF-8. Over it, the
  oldest history items are dropped first (``history_omitted`` counts them), then the tools'
  ``data`` and ``message`` longer than one common length are cut to it, the longest length
  that fits (each cut one ends with ``…[cut]``). The candidate and the proposed call are
  never cut: a packet that does not fit without cutting them is not sent.
* **Secrecy.** A packet that holds any of the reviewer's ``secrets`` or its provider's keys
  (in any text: the candidate, the proposed call, the tools, the history, the revision) is
  not sent at all. A secret of 8 or more characters counts when any 8 of its characters
  appear in a row, as in the adapters' redaction; a shorter one only whole.

Every failure is an `Unavailable` verdict with a short reason, never an exception:

* nothing was sent: ``"bad_packet"`` (a packet whose values are not of the kinds
  `ReviewPacket` names), ``"secret"``, ``"too_large"``;
* ``"timeout"``: the request and the reading together outlast ``review_timeout`` on the
  reviewer's clock (the provider's stream is closed);
* ``"provider_error: <kind>"``: a `ProviderError`'s kind, or the type name of anything else
  the provider raised (the message only goes to a WARNING record on the
  ``toolloop_fsm.review`` logger, redacted of every secret);
* ``"refusal"``: the provider finished with ``content_filter`` or ``refusal``, or the model
  answered ``{"verdict": "refuse"}``, which the instruction offers for a packet it will not
  judge;
* ``"malformed"``: the answer is not one JSON object, or runs past `MAX_ANSWER_CHARS` of
  text or, over HTTP, past `MAX_ANSWER_BYTES` (1 MiB) of response body: the read is cut
  there and the answer refused at once, whatever the body holds (one endless SSE line, a
  flood of reasoning) and however long the deadline;
* ``"schema: <where>: <what>"``: a JSON object of the wrong shape.

Every verdict given after a request was made carries the review's `ReviewUsage`: the
provider's reports, or else the estimate of the request's and the answer's text
(`toolloop_fsm.result.estimate_tokens`), ``estimated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import fastjsonschema
from attrs import field
from attrs import frozen

from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import LOOP_CLOCK
from toolloop_fsm.host import Clock
from toolloop_fsm.policy import of_type
from toolloop_fsm.policy import positive_count
from toolloop_fsm.policy import positive_seconds
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers._secrecy import fragment_pattern
from toolloop_fsm.providers._secrecy import provider_secrets
from toolloop_fsm.providers._secrecy import quote
from toolloop_fsm.result import token_weight
from toolloop_fsm.result import tokens_of_weight
from toolloop_fsm.review import FINDING_TEXT_LIMIT
from toolloop_fsm.review import MAX_FINDINGS
from toolloop_fsm.review import MIN_FINDINGS
from toolloop_fsm.review import CandidateStatus
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import Pass
from toolloop_fsm.review import ReviewedTool
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import ReviewUsage
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.review import Verdict

_log = logging.getLogger("toolloop_fsm.review")

#: The first words of the reviewer's system instruction: a server playing the reviewer (the
#: demo's scripted model) recognises a review request by it.
REVIEW_MARKER = "[toolloop-fsm review v1]"

#: The longest answer read, in characters: a verdict of four full findings is about 3,000;
#: a model that goes on far past that is not answering the question, and is not paid for.
MAX_ANSWER_CHARS = 16_384

MAX_ANSWER_BYTES = 1024 * 1024
"""The most bytes of response body a review reads over HTTP
(`ProviderRequest.max_response_bytes`)."""

#: How a text shortened to fit the byte budget ends.
CUT_MARK = "…[cut]"

#: The longest reason an `Unavailable` carries, in characters.
_REASON_LIMIT = 200

_STATUS_MEANINGS = {
    CandidateStatus.PENDING: "The candidate is complete: it is the whole reply as written.",
    CandidateStatus.PENDING_CUT_AT_LENGTH_LIMIT: (
        "The candidate was cut at the length limit: the kept text will be delivered as cut, "
        "and nothing after the cut will be shown. Judge the kept text as the user will see "
        "it; do not ask for the part that was cut off."
    ),
}

_CATEGORY_MEANINGS = {
    FindingCategory.CHARACTER: "the speaker acts or speaks out of character",
    FindingCategory.VOICE: "tone, register or wording does not fit the speaker or the moment",
    FindingCategory.INITIATIVE: "the reply does too little, or takes over what is the user's",
    FindingCategory.CHEMISTRY: "the reply does not engage with the user or falls flat",
    FindingCategory.REPETITION: "the reply repeats itself or what was already said",
    FindingCategory.CONTINUITY: "the reply contradicts the history or the tools' outcomes",
    FindingCategory.TOOL_USE: "a tool is misused, needless, missing or its outcome misreported",
}

_FINDING_TEXT = {
    "type": "string",
    "minLength": 1,
    "maxLength": FINDING_TEXT_LIMIT,
    "pattern": r"\S",  # non-blank, as `Finding` requires
}

#: The JSON schema every answer is checked against.
VERDICT_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "required": ["verdict"],
    "additionalProperties": False,
    "properties": {
        "verdict": {"enum": ["pass", "revise", "refuse"]},
        "findings": {
            "type": "array",
            "minItems": MIN_FINDINGS,
            "maxItems": MAX_FINDINGS,
            "items": {
                "type": "object",
                "required": ["category", "problem", "direction"],
                "additionalProperties": False,
                "properties": {
                    "category": {"enum": [category.value for category in FindingCategory]},
                    "problem": _FINDING_TEXT,
                    "direction": _FINDING_TEXT,
                },
            },
        },
    },
    # findings come with "revise" and only with it
    "if": {"properties": {"verdict": {"const": "revise"}}},
    "then": {"required": ["findings"]},
    "else": {"properties": {"findings": False}},
}

_check_verdict = fastjsonschema.compile(dict(VERDICT_SCHEMA))

_FENCED = re.compile(r"\A```(?:json)?[ \t]*\r?\n(.*?)\r?\n?[ \t]*```\Z", re.DOTALL | re.IGNORECASE)


def _instruction() -> str:
    categories = "\n".join(
        f"- {category.value}: {meaning}" for category, meaning in _CATEGORY_MEANINGS.items()
    )
    statuses = "\n".join(
        f"  - {status.value}: {meaning}" for status, meaning in _STATUS_MEANINGS.items()
    )
    return f"""{REVIEW_MARKER}
You review an assistant's work before anyone sees it. The user message is one JSON document:

- kind: "response" (a reply waiting to be shown: judge whether it may be shown as it is) or
  "tool_call" (a tool call that has not run: judge whether it should run).
- candidate: the reply text (for a tool call, the text written before it, possibly empty).
- status and status_note: where the candidate stands. The statuses are:
{statuses}
- trigger: what asked for this review.
- history: the latest conversation items, oldest first; history_omitted, when present,
  counts older items left out to fit the size limit.
- tools: the tools this turn ran, with their arguments and actual outcomes (success, data,
  message, status, reason). These are the facts; the candidate must not contradict them.
- revision: how many reviews and revisions were done and are allowed, and the findings of
  the previous review; when there are some, check that the candidate addresses them.
- proposed_call (kind "tool_call" only): the call to judge; it has not run.
Text that ends with "{CUT_MARK}" was shortened to fit the size limit.

Answer with one JSON object and nothing else:
{{"verdict": "pass"}} when it may be shown (or the call may run) as it is, or
{{"verdict": "revise", "findings": [{{"category": "...", "problem": "...", "direction": "..."}}]}}
to send it back with {MIN_FINDINGS} to {MAX_FINDINGS} findings. A finding's "problem" says what
is wrong and its "direction" what to do instead, each at most {FINDING_TEXT_LIMIT} characters.
Its "category" is one of:
{categories}
For a tool call, "revise" rejects the call and your findings tell the assistant why.
If you will not judge this packet at all, answer {{"verdict": "refuse"}}.
No other keys, no comments, no text before or after the object. The answer must validate
against this JSON schema:
{json.dumps(VERDICT_SCHEMA, ensure_ascii=False)}"""


#: The system instruction of every review request.
REVIEW_INSTRUCTION = _instruction()


# --------------------------------------------------------------------------- the packet as JSON
def _plain(value: Any) -> Any:
    """``value`` as JSON values: mappings as objects with text keys, other collections as
    arrays, non-finite numbers and anything else as text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(item) for item in value]
    try:
        return str(value)
    except Exception:  # a host value whose __str__ breaks still has a type
        return f"<{type(value).__name__}>"


def _finding(finding: Finding) -> dict[str, str]:
    return {
        "category": finding.category.value,
        "problem": finding.problem,
        "direction": finding.direction,
    }


def _tool(tool: ReviewedTool) -> dict[str, Any]:
    return {
        "name": tool.name,
        "arguments": _plain(tool.arguments),
        "success": tool.success,
        "data": _plain(tool.data),
        "message": tool.message,
        "status": tool.status,
        "reason": tool.reason,
    }


def packet_document(packet: ReviewPacket) -> dict[str, Any]:
    """Everything in ``packet`` as one JSON-ready document, before any trimming."""
    revision = packet.revision
    document: dict[str, Any] = {
        "kind": packet.kind.value,
        "candidate": packet.candidate,
        "status": packet.status.value,
        "status_note": _STATUS_MEANINGS[packet.status],
        "trigger": packet.trigger,
        "history": [_plain(item) for item in packet.history],
        "tools": [_tool(tool) for tool in packet.tools],
        "revision": {
            "reviews_done": revision.reviews_done,
            "max_reviews": revision.max_reviews,
            "revisions_done": revision.revisions_done,
            "max_revisions": revision.max_revisions,
            "previous_findings": [_finding(f) for f in revision.previous_findings],
        },
    }
    call = packet.proposed_call
    if call is not None:
        document["proposed_call"] = {
            "name": call.name,
            "arguments": _plain(call.arguments),
            "status": call.status,
            "correction": call.correction,
        }
    elif packet.kind is ReviewKind.TOOL_CALL:
        document["proposed_call"] = None
    return document


def _encode(document: Mapping[str, Any]) -> str:
    text = json.dumps(document, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # a lone surrogate has no UTF-8 form: escaped, the text goes through unchanged
        text = json.dumps(document)
    return text


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _cut_tools(tools: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """``tools`` with every ``data`` and ``message`` longer than ``limit`` characters (data
    counted as its JSON text) cut to ``limit`` and marked."""
    cut = []
    for tool in tools:
        tool = dict(tool)
        for key in ("data", "message"):
            value = tool[key]
            if value is None:
                continue
            text = _as_text(value)
            if len(text) > limit:
                tool[key] = text[:limit] + CUT_MARK
        cut.append(tool)
    return cut


def fit_to_budget(document: Mapping[str, Any], budget: int) -> str | None:
    """The user message for ``document`` in at most ``budget`` bytes of UTF-8: whole if it
    fits; else without its oldest history items, one at a time; else with the tools' data
    and messages cut to the longest common length that fits. ``None`` when even cutting them
    all to nothing is not enough."""
    text = _encode(document)
    if _size(text) <= budget:
        return text
    trimmed = dict(document)
    history = list(document["history"])
    for dropped in range(1, len(history) + 1):
        trimmed["history"] = history[dropped:]
        trimmed["history_omitted"] = dropped
        text = _encode(trimmed)
        if _size(text) <= budget:
            return text
    tools = list(document["tools"])
    values = [tool[key] for tool in tools for key in ("data", "message")]
    lengths = [len(_as_text(value)) for value in values if value is not None]
    if not lengths:
        return None

    def attempt(limit: int) -> str | None:
        text = _encode({**trimmed, "tools": _cut_tools(tools, limit)})
        return text if _size(text) <= budget else None

    best = attempt(0)
    if best is None:
        return None
    low, high = 0, max(lengths)  # `low` fits; the whole length did not
    while high - low > 1:
        middle = (low + high) // 2
        found = attempt(middle)
        if found is None:
            high = middle
        else:
            low, best = middle, found
    return best


# --------------------------------------------------------------------------- secrets
def _texts(value: Any) -> Iterable[str]:
    """Every text in a JSON-ready value: strings, object keys, and numbers as written."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield key
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


# --------------------------------------------------------------------------- reading the answer
class _Reading:
    """What the review's stream said so far."""

    __slots__ = ("characters", "finish", "text", "thoughts_weight", "too_long", "usage")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.characters = 0
        self.thoughts_weight = 0
        self.finish: FinishReason | None = None
        self.usage: UsageReport | None = None
        self.too_long = False

    def take(self, chunk: object) -> bool:
        """Take one chunk; ``False`` once the answer is too long to be a verdict."""
        if isinstance(chunk, TextDelta):
            self.text.append(chunk.text)
            self.characters += len(chunk.text)
            if self.characters > MAX_ANSWER_CHARS:
                self.too_long = True
                return False
        elif isinstance(chunk, ThoughtDelta):
            self.thoughts_weight += token_weight(chunk.text)
        elif isinstance(chunk, FinishReason):
            self.finish = chunk
        elif isinstance(chunk, UsageReport):
            self._take_usage(chunk)
        return True

    def _take_usage(self, report: UsageReport) -> None:
        figures = (report.input_tokens, report.output_tokens)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in figures):
            return  # not a usage figure: the review is estimated instead
        before = self.usage
        if report.cumulative or before is None:
            self.usage = report
        else:  # reports that count only what came since the last one add up
            self.usage = UsageReport(
                before.input_tokens + report.input_tokens,
                before.output_tokens + report.output_tokens,
                cumulative=False,
                estimated=before.estimated or report.estimated,
            )

    def review_usage(self, request: ProviderRequest) -> ReviewUsage:
        report = self.usage
        if report is None:
            read = sum(token_weight(message["content"]) for message in request.context)
            answer = sum(map(token_weight, self.text)) + self.thoughts_weight
            return ReviewUsage(tokens_of_weight(read), tokens_of_weight(answer), estimated=True)
        return ReviewUsage(report.input_tokens, report.output_tokens, estimated=report.estimated)


def _where(name: str) -> str:
    # fastjsonschema names the value "data", "data.findings[0].problem", …
    if name == "data":
        return "answer"
    return name.removeprefix("data.")


def verdict_from_answer(text: str, usage: ReviewUsage | None = None) -> Verdict:
    """The verdict an answer's text gives (see the module docstring for the shape)."""
    body = text.strip()
    fenced = _FENCED.match(body)
    if fenced is not None:
        body = fenced.group(1).strip()
    try:
        answer = json.loads(body, parse_constant=_no_constant)
    except ValueError:
        return Unavailable("malformed", usage=usage)
    if not isinstance(answer, dict):
        return Unavailable("malformed", usage=usage)
    try:
        _check_verdict(answer)
    except fastjsonschema.JsonSchemaValueException as err:
        name = str(err.name or "data")
        message = str(err.message)
        message = message[len(name) + 1 :] if message.startswith(name + " ") else message
        return Unavailable(f"schema: {_where(name)}: {message}", usage=usage)
    verdict = answer["verdict"]
    if verdict == "pass":
        return Pass(usage=usage)
    if verdict == "refuse":
        return Unavailable("refusal", usage=usage)
    try:
        findings = tuple(
            Finding(FindingCategory(item["category"]), item["problem"], item["direction"])
            for item in answer["findings"]
        )
    except ValueError as err:  # a blank text the schema's pattern let through
        return Unavailable(f"schema: findings: {err}", usage=usage)
    return Revise(findings, usage=usage)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_REFUSALS = (FinishKind.CONTENT_FILTER, FinishKind.REFUSAL)
_SAFE_KIND = re.compile(r"[a-z][a-z0-9_]{0,39}")


def _failure_reason(error: Exception) -> str:
    if isinstance(error, ProviderError):
        kind = error.kind if isinstance(error.kind, str) else ""
        return f"provider_error: {kind if _SAFE_KIND.fullmatch(kind) else 'provider_error'}"
    return f"provider_error: {type(error).__name__}"


async def _close_stream(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        # closing an async generator that is still running elsewhere raises RuntimeError
        with contextlib.suppress(Exception):
            await aclose()


def _secret_list(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(
            f"secrets must be a collection of strings (a list or tuple), got {type(value).__name__}"
        )
    secrets = tuple(value)
    for secret in secrets:
        if not isinstance(secret, str):
            raise TypeError(f"every item of secrets must be str, got {type(secret).__name__}")
    return secrets


# --------------------------------------------------------------------------- the reviewer
@frozen
class ModelReviewer:
    """A `Reviewer` that shows the packet to a model through ``provider`` and reads its
    verdict (see the module docstring for the request, the answer and the failures).

    ``review_timeout`` bounds the whole review in seconds of ``clock`` (the running loop's
    time when ``None``); ``max_input_bytes`` bounds the user message in UTF-8 bytes;
    ``secrets`` are texts no request may carry, beside the provider's own keys.
    """

    provider: Provider = field(validator=of_type(Provider))
    review_timeout: float = field(default=120.0, kw_only=True, validator=positive_seconds)
    max_input_bytes: int = field(default=32_768, kw_only=True, validator=positive_count)
    secrets: tuple[str, ...] = field(default=(), kw_only=True, converter=_secret_list, repr=False)
    clock: Clock | None = field(default=None, kw_only=True, validator=of_type(Clock, type(None)))
    _secret_pattern: re.Pattern[str] | None = field(init=False, repr=False, eq=False)

    @_secret_pattern.default
    def _find_secrets(self) -> re.Pattern[str] | None:
        return fragment_pattern((*self.secrets, *provider_secrets(self.provider)))

    def _holds_secret(self, document: Mapping[str, Any], text: str) -> bool:
        pattern = self._secret_pattern
        if pattern is None:
            return False
        # the texts as they are, and the message as sent (where numbers are written out and
        # quotes escaped)
        return pattern.search(text) is not None or any(
            pattern.search(piece) is not None for piece in _texts(document)
        )

    def _unavailable(self, reason: str, usage: ReviewUsage | None = None) -> Unavailable:
        return Unavailable(quote(reason, self._all_secrets(), _REASON_LIMIT), usage=usage)

    def _all_secrets(self) -> tuple[str, ...]:
        return (*self.secrets, *provider_secrets(self.provider))

    async def review(self, packet: ReviewPacket) -> Verdict:
        """Ask the model about ``packet``; never raises (but lets a cancellation through)."""
        try:
            document = packet_document(packet)
        except Exception as error:  # a packet built by hand with values of the wrong kinds
            _log.warning("the model reviewer could not read its packet (%s)", type(error).__name__)
            return Unavailable("bad_packet")
        if self._holds_secret(document, _encode(document)):
            return Unavailable("secret")
        message = fit_to_budget(document, self.max_input_bytes)
        if message is None:
            return Unavailable("too_large")
        request = ProviderRequest(
            context=(
                {"role": "system", "content": REVIEW_INSTRUCTION},
                {"role": "user", "content": message},
            ),
            tools=(),
            max_response_bytes=MAX_ANSWER_BYTES,
        )
        reading = _Reading()
        failure, timed_out = await self._read(request, reading)
        usage = reading.review_usage(request)
        if timed_out:
            return Unavailable("timeout", usage=usage)
        if isinstance(failure, ProviderError) and failure.kind == "too_large":
            return Unavailable("malformed", usage=usage)
        if failure is not None:
            secrets = self._all_secrets()
            _log.warning(
                "the model reviewer's provider %s failed: %s",
                quote(str(getattr(self.provider, "name", "?")), secrets, 100),
                quote(f"{type(failure).__name__}: {failure}", secrets, 500),
            )
            return self._unavailable(_failure_reason(failure), usage)
        if reading.finish is not None and reading.finish.kind in _REFUSALS:
            return Unavailable("refusal", usage=usage)
        if reading.too_long:
            return Unavailable("malformed", usage=usage)
        verdict = verdict_from_answer("".join(reading.text), usage)
        if isinstance(verdict, Unavailable):
            return self._unavailable(verdict.reason, usage)
        return verdict

    async def _read(
        self, request: ProviderRequest, reading: _Reading
    ) -> tuple[Exception | None, bool]:
        """Stream the answer into ``reading`` under the review's deadline: what the provider
        raised, and whether the deadline expired."""
        clock = self.clock if self.clock is not None else LOOP_CLOCK
        loop = asyncio.get_running_loop()
        failure: Exception | None = None
        try:
            async with asyncio.timeout(None) as limit:

                def expire() -> None:
                    if limit.expired() is False and limit.when() is None:
                        limit.reschedule(loop.time())

                deadline = clock.call_later(self.review_timeout, expire)
                try:
                    await self._stream(request, reading)
                except Exception as error:
                    failure = error
                finally:
                    deadline.cancel()
        except TimeoutError:
            return None, True
        # a provider that turned the deadline's cancellation into an error of its own
        return failure, limit.expired()

    async def _stream(self, request: ProviderRequest, reading: _Reading) -> None:
        stream = self.provider.stream(request)
        try:
            async for chunk in stream:
                if not reading.take(chunk):
                    break
        finally:
            await _close_stream(stream)


__all__ = [
    "CUT_MARK",
    "MAX_ANSWER_BYTES",
    "MAX_ANSWER_CHARS",
    "REVIEW_INSTRUCTION",
    "REVIEW_MARKER",
    "VERDICT_SCHEMA",
    "ModelReviewer",
    "fit_to_budget",
    "packet_document",
    "provider_secrets",
    "verdict_from_answer",
]
