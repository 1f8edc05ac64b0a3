"""Starting a durable turn from a Temporal client, and the handle that stops it, tells it of
a follow-up and waits for its result."""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
from temporalio.client import Client
from temporalio.client import WorkflowHandle

from toolloop_fsm.approvals import ApprovalError
from toolloop_fsm.approvals import ApprovalKey
from toolloop_fsm.approvals import ApprovalRequest
from toolloop_fsm.approvals import Decision
from toolloop_fsm.approvals import PendingApproval
from toolloop_fsm.decisions import decide
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.snapshot import snapshot_from_json
from toolloop_fsm.temporal._values import APPROVAL_MEMO
from toolloop_fsm.temporal._values import DECIDE_SIGNAL
from toolloop_fsm.temporal._values import FOLLOW_UP_SIGNAL
from toolloop_fsm.temporal._values import REFUSED_MEMO
from toolloop_fsm.temporal._values import STOP_SIGNAL
from toolloop_fsm.temporal._values import WORKFLOW_NAME
from toolloop_fsm.temporal._values import TurnInput
from toolloop_fsm.temporal._values import with_turn_converter

#: How soon a lost worker is noticed by default (its passes and tools heartbeat three times
#: as often).
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


@attrs.frozen
class TurnHandle:
    """A running durable turn: `stop`, `follow_up`, `result`, and for a turn that waits for
    approval `pending_approvals` and `decide`. ``workflow_id`` names it (a
    host may get a handle again with ``client.get_workflow_handle(workflow_id)``)."""

    handle: WorkflowHandle[Any, GenerationTurnResult]

    @property
    def workflow_id(self) -> str:
        return self.handle.id

    async def stop(self, stop_message: str | None = None) -> None:
        """The host's /kill: stop the turn, queueing ``stop_message`` first. A stop sent
        while no worker is alive is honoured when one returns."""
        await self.handle.signal(STOP_SIGNAL, stop_message)

    async def follow_up(self) -> None:
        """A new user message arrived for this conversation while the turn ran."""
        await self.handle.signal(FOLLOW_UP_SIGNAL)

    async def result(self) -> GenerationTurnResult:
        """Wait for the turn's result."""
        return await self.handle.result()

    async def pending_approvals(self) -> tuple[PendingApproval, ...]:
        """The calls the turn waits on for approval (docs/behaviour.md §3.13), in emitted
        order; empty while it waits on none. The workflow waits without a worker holding it:
        the decisions may come from any process, hours later."""
        approval = await self._approval()
        return approval.calls if approval is not None else ()

    async def decide(
        self, decisions: Iterable[Decision], *, approval_key: ApprovalKey | None = None
    ) -> None:
        """Send the decisions on the calls the turn waits on; the turn goes on with them.
        They are checked here first, as a resume checks them (each call has one, bound to
        it, signed with ``approval_key`` when given): `ApprovalError` names what does not
        match, and nothing is sent."""
        given = list(decisions)
        approval = await self._approval()
        if approval is None:
            raise ApprovalError("this turn waits on no approval")
        decide(snapshot_from_json(approval.snapshot), given, key=approval_key)
        await self.handle.signal(DECIDE_SIGNAL, given)

    async def refused_decisions(self) -> str | None:
        """Why the turn refused the last decisions it was sent (``None``: it refused none)."""
        described = await self.handle.describe()
        refused: str | None = await described.memo_value(REFUSED_MEMO, None, type_hint=str)
        return refused

    async def _approval(self) -> ApprovalRequest | None:
        # the workflow's memo: the server answers it, with no worker running
        described = await self.handle.describe()
        approval: ApprovalRequest | None = await described.memo_value(
            APPROVAL_MEMO, None, type_hint=ApprovalRequest
        )
        return approval


async def start_generation_turn(
    client: Client,
    *,
    task_queue: str,
    attempts: Sequence[str],
    channel: str,
    request: TurnRequest,
    tools: Iterable[str] | None = None,
    policy: TurnPolicy | None = None,
    workflow_id: str | None = None,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
    execution_timeout: timedelta | None = None,
) -> TurnHandle:
    """Start a durable generation turn on ``task_queue`` and return its handle.

    ``attempts`` names the fallback chain's providers, ``channel`` the channel and ``tools``
    the tools (``None``: every tool the worker has), all by their names in the registries of
    `TurnWorker`: providers, tools and channels live on the workers, never in the workflow's
    history (nor do API keys). The turn's id (``request.turn_id``, else ``workflow_id``,
    else a fresh one) is also its workflow id and the prefix of its idempotency keys.
    ``heartbeat_timeout`` is how soon a lost worker is noticed: its pass is then tried again
    on another worker, continuing from what it delivered.

    Drafting and the tool checkpoint need a reviewer, which a durable turn does not take:
    a policy with `LoopPolicy.drafting` or `LoopPolicy.review_tool_calls` on is refused
    (`ValueError` naming the switch), as is a custom `LoopPolicy.end_after_pre_tool_text`
    (a function cannot travel to the workers). So are token and cost budgets
    (`LoopPolicy.budget`, `TurnPolicy.budget`): a durable pass streams and delivers on its
    worker, which cannot yet cut it where a budget's room ends (docs/behaviour.md §2.8).
    """
    policy = policy if policy is not None else TurnPolicy()
    if not isinstance(policy, TurnPolicy):
        raise TypeError(f"policy must be a TurnPolicy, got {type(policy).__name__}")
    for switch in ("drafting", "review_tool_calls"):
        if getattr(policy.loop, switch):
            raise ValueError(
                f"LoopPolicy.{switch} is on, but a durable turn takes no reviewer: run "
                "drafting and the tool checkpoint in process (run_generation_turn)"
            )
    for owner, budget in (("LoopPolicy", policy.loop.budget), ("TurnPolicy", policy.budget)):
        if budget is not None:
            raise ValueError(
                f"{owner}.budget is set, but a durable pass cannot yet be cut where a budget's "
                "room ends: run budgeted turns in process (run_generation_turn)"
            )
    if policy.loop.end_after_pre_tool_text is not None:
        raise ValueError(
            "LoopPolicy.end_after_pre_tool_text is a function, which a durable turn cannot "
            "carry to its workers: leave it None (the built-in rule) for a durable turn"
        )
    attempts = tuple(attempts)
    if not attempts or not all(isinstance(name, str) and name for name in attempts):
        raise ValueError(f"attempts must name one provider or more, got {attempts!r}")
    if isinstance(tools, str):
        raise TypeError("tools is a collection of tool names, not one name")
    if not (
        isinstance(heartbeat_timeout, int | float)
        and math.isfinite(heartbeat_timeout)
        and heartbeat_timeout > 0
    ):
        raise ValueError(
            f"heartbeat_timeout must be a positive number of seconds, got {heartbeat_timeout!r}"
        )
    turn_id = request.turn_id or workflow_id
    if turn_id is None:
        import uuid

        turn_id = uuid.uuid4().hex
    if request.turn_id != turn_id:
        request = attrs.evolve(request, turn_id=turn_id)
    turn = TurnInput(
        request,
        attempts,
        channel,
        None if tools is None else tuple(tools),
        policy,
        float(heartbeat_timeout),
    )
    handle: WorkflowHandle[Any, GenerationTurnResult] = await with_turn_converter(
        client
    ).start_workflow(
        WORKFLOW_NAME,
        turn,
        id=workflow_id or turn_id,
        task_queue=task_queue,
        result_type=GenerationTurnResult,
        execution_timeout=execution_timeout,
    )
    return TurnHandle(handle)
