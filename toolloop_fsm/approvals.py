"""Approvals of tool calls (docs/behaviour.md §3.13), as values: a call the turn waits on
(`PendingApproval`), the host's decision on it (`Decision`: approve, approve with edited
arguments, deny), what a turn that ended ``awaiting_approval`` carries (`ApprovalRequest`),
and how a decision is bound to its call — a digest of the turn, the attempt, the pass, the
call's place, id, tool and arguments, signed with HMAC-SHA256 when the host keeps a key.

A digest is derived from what the snapshot holds, never stored in it: a snapshot whose
call was changed gives another digest, and a decision taken on the original is refused.
Applying decisions to a snapshot is `toolloop_fsm.decisions`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any
from typing import Literal

from attrs import field
from attrs import frozen

Verdict = Literal["approve", "deny"]
VERDICTS: tuple[Verdict, ...] = ("approve", "deny")

#: A host's signing key: bytes, or a text taken as its UTF-8 bytes.
ApprovalKey = bytes | str


class ApprovalError(ValueError):
    """Decisions that cannot be applied to the paused turn: one is missing, answers no call
    of it, does not match the call it names (another call, a changed snapshot), or is not
    signed by the host's key. Raised at the resume, before anything runs or is sent."""


def canonical_json(value: Any) -> str:
    """``value`` as JSON in one spelling: sorted keys, no spaces, no NaN."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def call_digest(
    turn_id: str | None,
    attempt: int,
    iteration: int,
    position: int,
    call_id: str | None,
    tool: str,
    arguments: Mapping[str, Any],
) -> str:
    """The SHA-256 of one call of one paused batch: a decision names it, so it answers that
    call and no other (another turn, attempt, pass or place, other arguments)."""
    text = canonical_json([turn_id, attempt, iteration, position, call_id, tool, dict(arguments)])
    return hashlib.sha256(text.encode()).hexdigest()


def _key_bytes(key: ApprovalKey) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return key
    raise TypeError(f"an approval key is bytes or a text, not {type(key).__name__}")


@frozen
class Decision:
    """The host's decision on one pending call, bound to it by ``digest`` (see
    `PendingApproval.approve` and `PendingApproval.deny`, which make them). ``arguments``
    are an approved call's edited arguments (``None``: it runs as the model sent it);
    ``reason`` is what the model is told of a denial. ``signature`` is the HMAC-SHA256, under
    the host's key, of everything else (``None``: unsigned)."""

    digest: str = field()
    verdict: Verdict = field()
    position: int = field()
    tool: str = field()
    call_id: str | None = None
    reason: str | None = None
    arguments: Mapping[str, Any] | None = None
    signature: str | None = None

    @digest.validator
    def _check_digest(self, _attribute: Any, value: object) -> None:
        if not isinstance(value, str) or len(value) != 64:
            raise ValueError(f"Decision.digest must be a call's SHA-256 digest, got {value!r}")

    @verdict.validator
    def _check_verdict(self, _attribute: Any, value: object) -> None:
        if value not in VERDICTS:
            raise ValueError(f"Decision.verdict must be 'approve' or 'deny', got {value!r}")
        if value == "deny" and self.arguments is not None:
            raise ValueError("a denial carries no arguments: approve with arguments= to edit")

    def signed_text(self) -> str:
        """What the signature covers: every field but the signature itself."""
        edited = dict(self.arguments) if self.arguments is not None else None
        return canonical_json(
            [self.digest, self.verdict, self.position, self.tool, self.call_id, self.reason, edited]
        )

    def signed(self, key: ApprovalKey) -> Decision:
        """This decision signed with ``key``."""
        mac = hmac.new(_key_bytes(key), self.signed_text().encode(), hashlib.sha256)
        return Decision(
            self.digest,
            self.verdict,
            self.position,
            self.tool,
            self.call_id,
            self.reason,
            self.arguments,
            mac.hexdigest(),
        )

    def signed_by(self, key: ApprovalKey) -> bool:
        """Whether ``signature`` is this decision's under ``key`` (compared in constant time)."""
        if self.signature is None:
            return False
        expected = hmac.new(_key_bytes(key), self.signed_text().encode(), hashlib.sha256)
        return hmac.compare_digest(expected.hexdigest(), self.signature)

    def to_json(self) -> str:
        """The decision as JSON text (for an approver in another process)."""
        return canonical_json(
            {
                "digest": self.digest,
                "verdict": self.verdict,
                "position": self.position,
                "tool": self.tool,
                "call_id": self.call_id,
                "reason": self.reason,
                "arguments": dict(self.arguments) if self.arguments is not None else None,
                "signature": self.signature,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        """Read `to_json`'s text back; anything else raises `ApprovalError`."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as err:
            raise ApprovalError(f"a decision must be JSON text: {err}") from None
        if not isinstance(data, dict):
            raise ApprovalError("a decision must be a JSON object")
        expected: dict[str, tuple[type, ...]] = {
            "digest": (str,),
            "verdict": (str,),
            "position": (int,),
            "tool": (str,),
            "call_id": (str, type(None)),
            "reason": (str, type(None)),
            "arguments": (dict, type(None)),
            "signature": (str, type(None)),
        }
        unknown = sorted(set(data) - set(expected))
        missing = sorted(set(expected) - set(data))
        if unknown or missing:
            raise ApprovalError(f"a decision's fields: missing {missing}, unknown {unknown}")
        for name, kinds in expected.items():
            value = data[name]
            if not isinstance(value, kinds) or (int in kinds and isinstance(value, bool)):
                raise ApprovalError(f"a decision's {name} has the wrong type: {value!r}")
        try:
            return cls(**data)
        except ValueError as err:
            raise ApprovalError(str(err)) from None


@frozen
class PendingApproval:
    """A call the turn waits on: where it sits (``position`` in the batch of pass
    ``iteration`` of ``attempt``), its id, tool and ``arguments`` as the model sent them, and
    the ``digest`` a decision on it names. ``predicate_error`` says the tool's
    ``needs_approval`` predicate raised on these arguments (the call then waits, to be
    safe)."""

    turn_id: str | None
    attempt: int
    iteration: int
    position: int
    call_id: str | None
    tool: str
    arguments: Mapping[str, Any]
    digest: str
    predicate_error: str | None = None

    def approve(
        self, *, arguments: Mapping[str, Any] | None = None, key: ApprovalKey | None = None
    ) -> Decision:
        """Run the call; with ``arguments``, run it with these instead (the turn's history
        shows what ran). ``key`` signs the decision."""
        if arguments is not None and not isinstance(arguments, Mapping):
            raise TypeError(f"edited arguments must be a mapping, not {type(arguments).__name__}")
        decision = Decision(
            self.digest,
            "approve",
            self.position,
            self.tool,
            self.call_id,
            None,
            dict(arguments) if arguments is not None else None,
        )
        return decision.signed(key) if key is not None else decision

    def deny(self, reason: str, *, key: ApprovalKey | None = None) -> Decision:
        """Do not run the call; the model is told ``reason`` as its result."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("a denial needs a reason: the model is told it as the call's result")
        decision = Decision(self.digest, "deny", self.position, self.tool, self.call_id, reason)
        return decision.signed(key) if key is not None else decision


@frozen
class ApprovalRequest:
    """What a turn that ended ``awaiting_approval`` hands its host: the ``calls`` it waits
    on, in emitted order, and its ``snapshot`` as JSON text, to keep until the decisions
    come (`toolloop_fsm.snapshot_from_json` reads it back; `resume_tool_loop` or
    `resume_generation_turn` with ``decisions=`` continues the turn)."""

    calls: tuple[PendingApproval, ...]
    snapshot: str


__all__ = [
    "ApprovalError",
    "ApprovalKey",
    "ApprovalRequest",
    "Decision",
    "PendingApproval",
    "Verdict",
    "call_digest",
    "canonical_json",
]
