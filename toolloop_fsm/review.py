"""Reviewing before anyone sees it: the `Reviewer` protocol, the `ReviewPacket` it is shown and
the `Verdict` it returns (`Pass`, `Revise`, `Unavailable`).

Drafting (`LoopPolicy.drafting`) holds a turn's prose until a reviewer passed it; the tool
checkpoint (`LoopPolicy.review_tool_calls`) shows each new tool call to the reviewer before it
runs. Both ask the same protocol. The packet carries only admitted evidence: the candidate,
the trigger, the two latest conversation items, the tools with their actual outcomes (their
arguments passed through each tool's ``redact`` hook) and where the revision stands; for a
tool checkpoint, the proposed call, marked ``not_executed``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from enum import StrEnum
from typing import Any
from typing import Protocol
from typing import TypeAlias
from typing import runtime_checkable

from attrs import field
from attrs import frozen
from attrs import validators as check

#: The longest ``problem`` or ``direction`` a finding may carry, in characters.
FINDING_TEXT_LIMIT = 300
#: How many findings one `Revise` verdict carries, at least and at most.
MIN_FINDINGS, MAX_FINDINGS = 1, 4


class FindingCategory(StrEnum):
    """What a finding is about."""

    CHARACTER = "character"
    VOICE = "voice"
    INITIATIVE = "initiative"
    CHEMISTRY = "chemistry"
    REPETITION = "repetition"
    CONTINUITY = "continuity"
    TOOL_USE = "tool_use"


def _finding_text(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"Finding.{attribute.name} must be non-blank text, got {value!r}")
    if len(value) > FINDING_TEXT_LIMIT:
        raise ValueError(
            f"Finding.{attribute.name} is {len(value)} characters; at most "
            f"{FINDING_TEXT_LIMIT} are allowed"
        )


@frozen
class Finding:
    """One thing the reviewer wants changed: its category, the problem and the direction
    to take (each non-blank, at most 300 characters)."""

    category: FindingCategory = field(converter=FindingCategory)
    problem: str = field(validator=_finding_text)
    direction: str = field(validator=_finding_text)


@frozen
class ReviewUsage:
    """What one review cost: the tokens its request read and wrote, ``estimated`` when the
    provider reported none (`toolloop_fsm.result.estimate_tokens` of its text)."""

    input_tokens: int = field(validator=check.and_(check.instance_of(int), check.ge(0)))
    output_tokens: int = field(validator=check.and_(check.instance_of(int), check.ge(0)))
    estimated: bool = False


@frozen
class Pass:
    """The candidate may be shown (or the call may run) as it is."""

    usage: ReviewUsage | None = field(default=None, kw_only=True)


def _as_findings(value: Iterable[Finding]) -> tuple[Finding, ...]:
    # a typed converter: with a bare ``tuple`` the attrs plugin gives mypy a constructor
    # signature (``Iterable[_T_co]``) that no argument satisfies
    return tuple(value)


def _findings(instance: Any, attribute: Any, value: tuple[Finding, ...]) -> None:
    if not MIN_FINDINGS <= len(value) <= MAX_FINDINGS:
        raise ValueError(f"Revise carries {MIN_FINDINGS}–{MAX_FINDINGS} findings, got {len(value)}")
    for finding in value:
        if not isinstance(finding, Finding):
            raise TypeError(f"Revise findings must be Finding values, got {finding!r}")


@frozen
class Revise:
    """Send it back: 1–4 findings say what to change. For a drafted reply, the first
    `Revise` asks the model for a replacement; for a tool call, it rejects the call."""

    findings: tuple[Finding, ...] = field(converter=_as_findings, validator=_findings)
    usage: ReviewUsage | None = field(default=None, kw_only=True)


@frozen
class Unavailable:
    """The reviewer could not give a verdict (``reason``: ``"timeout"``, ``"refusal"``,
    ``"malformed"``, ``"secret"``, a provider failure…). The reply is delivered as it is; the
    reviewer is not asked again in this turn."""

    reason: str = field(validator=check.instance_of(str))
    usage: ReviewUsage | None = field(default=None, kw_only=True)


Verdict: TypeAlias = Pass | Revise | Unavailable
VERDICT_TYPES = (Pass, Revise, Unavailable)


class CandidateStatus(StrEnum):
    """Where the candidate stands: held and complete, or held and cut at the held-prose
    ceiling (the reviewer is told the kept text will be delivered as cut)."""

    PENDING = "pending"
    PENDING_CUT_AT_LENGTH_LIMIT = "pending_cut_at_length_limit"


class ReviewKind(StrEnum):
    RESPONSE = "response"
    TOOL_CALL = "tool_call"


@frozen
class ReviewedTool:
    """A tool the turn ran (or reused, or refused), with its actual outcome. ``arguments``
    went through the tool's ``redact`` hook."""

    name: str
    arguments: Mapping[str, Any]
    success: bool
    data: Any = None
    message: str | None = None
    status: str | None = None
    reason: str | None = None


@frozen
class ProposedCall:
    """The call the tool checkpoint is asked about; it has not run."""

    name: str
    arguments: Mapping[str, Any]
    status: str = "not_executed"
    correction: bool = False


@frozen
class RevisionInfo:
    """Where the review budget stands when the packet is made."""

    reviews_done: int
    max_reviews: int
    revisions_done: int
    max_revisions: int
    previous_findings: tuple[Finding, ...] = ()


@frozen
class ReviewPacket:
    """Everything a reviewer is shown, and nothing else."""

    kind: ReviewKind
    candidate: str
    status: CandidateStatus
    trigger: str
    history: tuple[Mapping[str, Any], ...]
    tools: tuple[ReviewedTool, ...]
    revision: RevisionInfo
    proposed_call: ProposedCall | None = None


@runtime_checkable
class Reviewer(Protocol):
    """What drafting and the tool checkpoint ask. ``review`` is bounded by
    `LoopPolicy.review_timeout`; a reviewer that raises (anything but `KeyboardInterrupt` or
    `SystemExit`) is `Unavailable`."""

    async def review(self, packet: ReviewPacket) -> Verdict: ...


@frozen
class ReviewRecord:
    """One review the turn asked for, in the result: what was reviewed, the verdict's kind
    (``pass``, ``revise``, ``unavailable``), its findings or reason."""

    kind: ReviewKind
    trigger: str
    verdict: str
    findings: tuple[Finding, ...] = ()
    reason: str | None = None
    call: str | None = None


__all__ = [
    "CandidateStatus",
    "Finding",
    "FindingCategory",
    "Pass",
    "ProposedCall",
    "ReviewKind",
    "ReviewPacket",
    "ReviewRecord",
    "ReviewUsage",
    "ReviewedTool",
    "Reviewer",
    "Revise",
    "RevisionInfo",
    "Unavailable",
    "Verdict",
]
