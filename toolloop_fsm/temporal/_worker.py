"""The worker side of a durable turn: the host's registries (providers, tools, channels by
name) and the activities that use them — describing a turn's chain and tools, streaming one
provider pass (masking the turn's keys out of it, delivering its text as it streams, with
idempotency keys, each delivery recorded in the workflow before it is sent), running one
tool call (its outcome masked), and one call into the channel — and `TurnWorker`, the
Temporal worker that runs them beside the turn's workflow. The masking is the in-process
pumps' (`Secrets`, `StreamMask`): the workflow, its history and the result only ever see
masked values."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import attrs
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxRestrictions

from toolloop_fsm.attempts import Attempt
from toolloop_fsm.events import CHUNK_TYPES
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.host import LOOP_CLOCK
from toolloop_fsm.host import Channel
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.notice_budget import SEND_NOTICE
from toolloop_fsm.notice_budget import NoticeBudget
from toolloop_fsm.notice_budget import NoticeOutcome
from toolloop_fsm.pass_rules import flush_due
from toolloop_fsm.pass_rules import stream_budget_due
from toolloop_fsm.provider import Provider
from toolloop_fsm.pump.deliveries import post_notice
from toolloop_fsm.pump.deliveries import takes_idempotency_keys
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.pump.redaction import StreamMask
from toolloop_fsm.result import Notice
from toolloop_fsm.temporal._values import CALL_CHANNEL
from toolloop_fsm.temporal._values import DELIVERY_INTENT_SIGNAL
from toolloop_fsm.temporal._values import DESCRIBE_TURN
from toolloop_fsm.temporal._values import RECONCILE_TOOL
from toolloop_fsm.temporal._values import RUN_TOOL
from toolloop_fsm.temporal._values import STREAM_PASS
from toolloop_fsm.temporal._values import Catalogue
from toolloop_fsm.temporal._values import CatalogueRequest
from toolloop_fsm.temporal._values import ChannelAnswer
from toolloop_fsm.temporal._values import ChannelCall
from toolloop_fsm.temporal._values import DeliveryIntent
from toolloop_fsm.temporal._values import PassDelivery
from toolloop_fsm.temporal._values import PassInput
from toolloop_fsm.temporal._values import PassOutcome
from toolloop_fsm.temporal._values import PassProgress
from toolloop_fsm.temporal._values import Reconciled
from toolloop_fsm.temporal._values import ToolDescription
from toolloop_fsm.temporal._values import ToolInput
from toolloop_fsm.temporal._values import converter
from toolloop_fsm.temporal._values import pack_chunks
from toolloop_fsm.temporal._values import with_turn_converter
from toolloop_fsm.temporal._workflow import GenerationTurnWorkflow
from toolloop_fsm.tools import reconcile_call
from toolloop_fsm.tools import run_tool_handler

#: Providers made for an attempt are kept for its later passes (a scripted or stateful
#: provider answers an attempt's passes in turn), the most recent this many attempts.
_PROVIDERS_KEPT = 1024

#: Where a reconcile hook's failures are recorded, as a handler's are (docs/behaviour.md §3.9)
_log = logging.getLogger("toolloop_fsm.tools")

#: Modules the workflow sandbox takes from outside: the machines and what they import are
#: deterministic, import nothing asynchronous, and are loaded once per worker.
PASSED_THROUGH = (
    "toolloop_fsm",
    "transitions",
    "attrs",
    "attr",
    "cattrs",
    "fastjsonschema",
    "httpx",
    "httpcore",
    "anyio",
    "sniffio",
    "certifi",
    "pydantic",
    "pydantic_core",
)


class TurnActivities:
    """The activities of durable turns, over the host's registries."""

    def __init__(
        self,
        providers: Mapping[str, Attempt | Any],
        tools: ToolRegistry | Iterable[Tool],
        channels: Mapping[str, Channel],
    ) -> None:
        self.attempts: dict[str, Attempt] = {
            name: value if isinstance(value, Attempt) else Attempt(provider=value)
            for name, value in providers.items()
        }
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        for tool in self.tools:
            if not isinstance(tool.needs_approval, bool):
                # the gate runs in the workflow, which cannot call the worker's code
                raise ValueError(
                    f"tool {tool.name!r}: a durable turn takes needs_approval=True or False, "
                    "not a predicate (the workflow decides which calls wait, and it cannot "
                    "run the worker's code): split the tool, or approve in the tool itself"
                )
        self.channels = dict(channels)
        for name, channel in self.channels.items():
            missing = [
                m
                for m in ("send_text", "send_expression", "send_notice", "queue_front")
                if not callable(getattr(channel, m, None))
            ]
            if missing:
                raise TypeError(f"channel {name!r} is not a Channel: it lacks {missing}")
        self._providers: collections.OrderedDict[tuple[str, str, int | None], Provider] = (
            collections.OrderedDict()
        )

    # ------------------------------------------------------------------ describing a turn
    @activity.defn(name=DESCRIBE_TURN)
    async def describe_turn(self, ask: CatalogueRequest) -> Catalogue:
        """The chain's plans and the tools' descriptions, or what the registries lack."""
        unknown = [name for name in ask.attempts if name not in self.attempts]
        if unknown or not ask.attempts:
            known = ", ".join(sorted(self.attempts)) or "none"
            what = f"unknown providers {unknown}" if unknown else "an empty chain of providers"
            return Catalogue(problem=f"the turn names {what} (this worker has: {known})")
        if ask.channel not in self.channels:
            known = ", ".join(sorted(self.channels)) or "none"
            return Catalogue(
                problem=f"the turn names unknown channel {ask.channel!r} (this worker has: {known})"
            )
        names = self.tools.names if ask.tools is None else ask.tools
        missing = [name for name in names if self.tools.get(name) is None]
        if missing:
            known = ", ".join(self.tools.names) or "none"
            return Catalogue(
                problem=f"the turn names unknown tools {missing} (this worker has: {known})"
            )
        plans = []
        for index, name in enumerate(ask.attempts):
            attempt = self.attempts[name]
            if attempt.label is None:
                attempt = attrs.evolve(attempt, label=name)
            plans.append(attempt.plan(index, "user"))
        tools = []
        for name in names:
            tool = self.tools.get(name)
            assert tool is not None
            tools.append(
                ToolDescription(
                    tool.name,
                    tool.description,
                    dict(tool.parameters),
                    tool.requires_follow_up,
                    tool.timeout,
                    tool.replay,
                    tool.idempotent,
                    reconciles=tool.reconcile is not None,
                    sequential=tool.sequential,
                    repeatable=tool.repeatable,
                    needs_approval=tool.needs_approval is True,
                )
            )
        continuation = tuple(
            bool(getattr(self.attempts[name].provider, "continuation_style", False))
            for name in ask.attempts
        )
        return Catalogue(
            tuple(plans),
            tuple(tools),
            continuation=continuation,
            keyed_channel=takes_idempotency_keys(self.channels[ask.channel]),
        )

    # ------------------------------------------------------------------ the turn's keys
    def _chain_secrets(self, chain: Iterable[str], running: str | None) -> Secrets:
        """Every key of the turn's chain (the running attempt's among them), as the outer
        tier knows them in process (docs/behaviour.md §9.12, rule 1)."""
        names = dict.fromkeys((*chain, *((running,) if running is not None else ())))
        return Secrets(
            key for name in names if name in self.attempts for key in self.attempts[name].keys
        )

    # ------------------------------------------------------------------ a provider pass
    def _provider(self, keys_prefix: str | None, name: str, key_index: int | None) -> Provider:
        """The attempt's provider: made by the host's factory with the attempt's key on its
        first pass here, kept for its later passes (and its tools' outcomes)."""
        index = (keys_prefix or "", name, key_index)
        made = self._providers.get(index)
        if made is not None:
            self._providers.move_to_end(index)
            return made
        attempt = self.attempts[name]
        key = attempt.keys[key_index] if key_index is not None else None
        made = attempt.make_provider(key)
        self._providers[index] = made
        while len(self._providers) > _PROVIDERS_KEPT:
            self._providers.popitem(last=False)
        return made

    @activity.defn(name=STREAM_PASS)
    async def stream_pass(self, spec: PassInput) -> PassOutcome:
        """Stream one pass, delivering its text as the machine will (a delivery each time
        ``flush_chars`` are buffered, the rest when the stream ends), each delivery keyed
        ``prefix:seq`` and recorded in the workflow before it is sent. A try after a lost
        one starts from what the tries before it recorded (``spec.recorded``): that text is
        replayed as the pass's first chunks and becomes the provider's prefill."""
        secrets = self._chain_secrets(spec.chain, spec.provider)
        run = _Pass(spec, self.channels[spec.channel])
        if spec.started_at is not None:
            run.started_at = spec.started_at
        run.replay(spec.recorded)
        ticker = asyncio.create_task(run.heartbeat_every(spec.heartbeat_every))
        try:
            try:
                provider = self._provider(spec.keys_prefix, spec.provider, spec.key_index)
            except Exception as err:  # the host's factory: no fallback, like in-process
                message = f"the provider factory raised {type(err).__name__}: {err}"
                return PassOutcome((), (), "host_error", message=secrets.clean(message))
            return await run.stream(provider, secrets.with_provider(provider))
        except asyncio.CancelledError:
            if activity.is_worker_shutdown():
                raise  # the pass is tried again on another worker
            # a stop or a follow-up: what streamed so far is the pass's, for the machine
            return run.outcome("cancelled")
        finally:
            ticker.cancel()
            with contextlib.suppress(BaseException):
                await ticker

    # ------------------------------------------------------------------ a tool call
    @activity.defn(name=RUN_TOOL)
    async def run_tool(self, spec: ToolInput) -> ToolFinished:
        """Run one tool call (heartbeating while it runs, so that a lost worker is noticed)."""
        tool = self.tools.get(spec.name)
        if tool is None:
            return ToolFinished(spec.dispatch, ToolOutcomeKind.RAISED, error="unknown tool")
        ctx = _tool_context(spec)
        ticker = asyncio.create_task(_heartbeat_every(spec.heartbeat_every))
        try:
            event = await run_tool_handler(
                tool, spec.dispatch, dict(spec.arguments), ctx, deadline=spec.deadline
            )
        finally:
            ticker.cancel()
            with contextlib.suppress(BaseException):
                await ticker
        # what the tool said may quote a key: masked before it is recorded for the workflow
        event = self._tool_secrets(spec).masked_outcome(event)
        try:  # the outcome goes into the workflow's history as JSON
            json.dumps(converter.unstructure(event), allow_nan=False)
        except (TypeError, ValueError) as err:
            return ToolFinished(
                spec.dispatch,
                ToolOutcomeKind.RAISED,
                error=f"the tool's outcome cannot be recorded as JSON ({err})",
            )
        return event

    @activity.defn(name=RECONCILE_TOOL)
    async def reconcile_tool(self, spec: ToolInput) -> Reconciled:
        """Ask a tool's reconcile hook what really happened to a call cut off mid-run
        (docs/behaviour.md §3.9), bounded by ``spec.deadline`` (the policy's host-call
        budget); its answer is masked of the turn's keys like a run's outcome."""
        tool = self.tools.get(spec.name)
        if tool is None:
            return Reconciled()
        ctx = _tool_context(spec)
        answer = await reconcile_call(
            tool, spec.dispatch, dict(spec.arguments), ctx, budget=spec.deadline, clock=LOOP_CLOCK
        )
        if answer is None:
            return Reconciled()
        answer = self._tool_secrets(spec).masked_outcome(answer)
        try:  # the answer goes into the workflow's history as JSON
            json.dumps(converter.unstructure(answer), allow_nan=False)
        except (TypeError, ValueError) as err:
            _log.warning(
                "the reconcile hook of tool %s answered what cannot be recorded as JSON (%s); "
                "the call stays in doubt",
                spec.name,
                err,
            )
            return Reconciled()
        return Reconciled(answer)

    def _tool_secrets(self, spec: ToolInput) -> Secrets:
        """The keys a tool's outcome is masked of: the chain's, and the running provider's
        own (the provider its passes ran on; made here if this worker has not yet)."""
        secrets = self._chain_secrets(spec.chain, spec.provider)
        if spec.provider is None or spec.provider not in self.attempts:
            return secrets
        try:
            provider = self._provider(spec.keys_prefix, spec.provider, spec.key_index)
        except Exception:  # the factory failed its pass already: the chain's keys it is
            return secrets
        return secrets.with_provider(provider)

    # ------------------------------------------------------------------ the channel
    @activity.defn(name=CALL_CHANNEL)
    async def call_channel(self, call: ChannelCall) -> ChannelAnswer:
        """One call into the host's channel, bounded by ``timeout``; what went wrong is said
        in the answer (host code failing is the turn's business, not a retry's)."""
        channel = self.channels[call.channel]
        awaitable: Awaitable[Any] | None
        if call.method == "send_text":
            awaitable = _send(channel, call.text or "", None, call.key)
        elif call.method == "send_expression":
            awaitable = _send(channel, None, call.expression or "", call.key)
        elif call.method == "send_notice":
            assert call.notice is not None
            return await _post_notice(channel, call.notice, call)
        elif call.method == "queue_front":
            awaitable = channel.queue_front(call.text or "")
        elif call.method == "attempt_superseded":
            mark = getattr(channel, "attempt_superseded", None)
            awaitable = None if mark is None else mark(call.attempt, call.label, call.text or "")
        else:
            return ChannelAnswer(error=f"no channel method {call.method!r}")
        if awaitable is None:
            return ChannelAnswer()
        try:
            await asyncio.wait_for(awaitable, call.timeout)
        except TimeoutError:
            return ChannelAnswer(
                error=f"channel.{call.method} did not return within {call.timeout:g} s",
                timed_out=True,
            )
        except asyncio.CancelledError:
            raise
        except Exception as err:
            return ChannelAnswer(error=f"{type(err).__name__}: {err}")
        return ChannelAnswer()


def _tool_context(spec: ToolInput) -> ToolContext:
    """What the tool's handler, and its reconcile hook, are told of the call ``spec``."""
    return ToolContext(
        spec.name,
        spec.dispatch,
        spec.iteration,
        LOOP_CLOCK,
        frozenset(spec.disabled_enrichment_kinds),
        spec.idempotency_key,
    )


async def _post_notice(channel: Channel, notice: Notice, call: ChannelCall) -> ChannelAnswer:
    """A notice, as the in-process pumps post it (`post_notice`), within what its workflow's
    notice budget has left (``call.timeout``)."""
    outcome = await post_notice(channel, notice, NoticeBudget(call.timeout), LOOP_CLOCK, call.grace)
    if outcome is NoticeOutcome.GIVEN_UP:
        return ChannelAnswer(
            error=f"{SEND_NOTICE} did not return within {call.timeout:g} s; given up on",
            given_up=True,
        )
    if isinstance(outcome, KeyboardInterrupt | SystemExit):
        raise outcome  # the worker process is going down
    if isinstance(outcome, BaseException):
        return ChannelAnswer(error=f"{type(outcome).__name__}: {outcome}")
    return ChannelAnswer()


def _send(channel: Channel, text: str | None, expression: str | None, key: str | None) -> Any:
    if key is None or not takes_idempotency_keys(channel):
        if expression is not None:
            return channel.send_expression(expression)
        return channel.send_text(text or "")
    if expression is not None:
        return channel.send_expression(expression, idempotency_key=key)  # type: ignore[call-arg]
    return channel.send_text(text or "", idempotency_key=key)  # type: ignore[call-arg]


async def _heartbeat_every(seconds: float, details: Any = None) -> None:
    while True:
        if details is None:
            activity.heartbeat()
        else:
            activity.heartbeat(details())
        await asyncio.sleep(seconds)


class _Pass:
    """One try of a provider pass: the stream read under its deadlines, each chunk handed
    through the turn's `StreamMask` (as the in-process pump reads it), the text delivered by
    the machine's flush rule, the chunks kept (text merged between deliveries)."""

    def __init__(self, spec: PassInput, channel: Channel) -> None:
        self.spec = spec
        self.channel = channel
        self.mask: StreamMask | None = None  # the turn's keys', when it has any
        self.started_at = time.time()
        self.chunks: list[Chunk] = []
        self.delivered: list[PassDelivery] = []
        self.seq = spec.first_seq
        self.run: list[str] = []  # text not yet closed into a chunk
        self.buffered = 0  # text not yet delivered, as the machine counts it
        self.unsent: list[str] = []
        self.prefix = ""  # what a lost try delivered
        self.text_closed = False  # the lost try's stream had ended: no more text is the pass's

    def replay(self, recorded: tuple[PassDelivery, ...]) -> None:
        """Take what the lost tries recorded as delivered: the pass's first chunks, under the
        same numbers (the machine matches them), and the prefill the provider continues."""
        for delivery in recorded:
            self.chunks.append(TextDelta(delivery.text))
            self.delivered.append(delivery)
            self.prefix += delivery.text
            self.seq = delivery.seq + 1
        # a delivery shorter than the flush size is only ever made as the stream ends: the
        # pass had said all it says, and more text would join it in the machine's buffer
        # (one delivery under its number, with other text than the one recorded)
        closed = bool(recorded) and not flush_due(len(recorded[-1].text), self.spec.flush_chars)
        self.text_closed = closed

    def progress(self) -> Any:
        return converter.unstructure(PassProgress(self.started_at))

    async def heartbeat_every(self, seconds: float) -> None:
        await _heartbeat_every(seconds, self.progress)

    def outcome(
        self, ending: str, failure: StreamFailed | None = None, deadline: str | None = None
    ) -> PassOutcome:
        mask = self.mask
        if mask is not None and mask.held and ending != "delivery_failed":
            # text held back as a possible start of a key arrived all the same: it is the
            # pass's, before how it ended (the machine delivers it, under its own key); after
            # a refused delivery nothing more is sent, so it stays undelivered
            released = mask.release()
            if released is not None:
                self._keep(released)
        self._close_run()
        return PassOutcome(
            pack_chunks(self.chunks), tuple(self.delivered), ending, failure, deadline
        )

    def _close_run(self) -> None:
        if self.run:
            self.chunks.append(TextDelta("".join(self.run)))
            self.run = []

    async def stream(self, provider: Provider, secrets: Secrets) -> PassOutcome:
        spec = self.spec
        mask = self.mask = secrets.stream_mask() if secrets.keys else None
        request = spec.request
        if self.prefix:
            request = attrs.evolve(request, prefill=(request.prefill or "") + self.prefix)
        loop = asyncio.get_running_loop()
        # the pass's budgets count from its first try (a retry continues the same pass)
        begun = loop.time() - max(0.0, time.time() - self.started_at)
        if not await self._resend_last_recorded():
            return self.outcome("delivery_failed")
        try:
            stream = provider.stream(request)
        except Exception as err:
            return self.outcome("failed", secrets.masked_failure(err))
        iterator: AsyncIterator[Any] = aiter(stream)
        answered = bool(self.chunks)
        last = loop.time()
        try:
            while True:
                now = loop.time()
                kind, due = stream_budget_due(
                    now,
                    begun=begun,
                    answered_at=last if answered else None,
                    first_seconds=spec.first_token_timeout,
                    inactivity_seconds=spec.inactivity_timeout,
                    total_seconds=spec.max_pass_duration or None,
                )
                try:
                    chunk = await asyncio.wait_for(anext(iterator), max(0.0, due - now))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    return self.outcome("deadline", deadline=kind.value)
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    return self.outcome("failed", secrets.masked_failure(err))
                answered = True
                last = loop.time()
                if type(chunk) not in CHUNK_TYPES:
                    failure = StreamFailed(
                        f"the provider yielded {type(chunk).__name__}, not a chunk event",
                        kind="protocol",
                    )
                    return self.outcome("failed", failure)
                if mask is not None:
                    if mask.held:
                        released = mask.release_before(chunk)
                        if released is not None and not await self._take(released):
                            return self.outcome("delivery_failed")
                    chunk = mask.admit(chunk)
                    if chunk is None:
                        continue
                if not await self._take(chunk):
                    return self.outcome("delivery_failed")
            if mask is not None and mask.held:  # the held text goes before the end
                released = mask.release()
                if released is not None and not await self._take(released):
                    return self.outcome("delivery_failed")
            # the stream ran out: what is buffered is delivered, as the machine does
            if not await self._flush():
                return self.outcome("delivery_failed")
            return self.outcome("ended")
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _take(self, chunk: Chunk) -> bool:
        """Keep ``chunk`` and deliver what is buffered once it reaches the flush size;
        False when the channel refused it."""
        self._keep(chunk)
        if isinstance(chunk, TextDelta) and flush_due(self.buffered, self.spec.flush_chars):
            return await self._flush()
        return True

    def _keep(self, chunk: Chunk) -> None:
        if self.text_closed and isinstance(chunk, TextDelta):
            return
        if not isinstance(chunk, TextDelta):
            self._close_run()
            self.chunks.append(chunk)
            return
        self.run.append(chunk.text)
        self.unsent.append(chunk.text)
        self.buffered += len(chunk.text)

    async def _flush(self) -> bool:
        """Deliver the buffered text (unless the machine suppresses text); False when the
        channel refused it (the machine will end the turn on it)."""
        self._close_run()
        if self.buffered == 0:
            return True
        undelivered = "".join(self.unsent)
        self.unsent = []
        self.buffered = 0
        if self.spec.suppress_text:
            return True
        seq = self.seq
        self.seq += 1
        refused = await self._record(seq, undelivered)
        if refused is None:
            refused = await self._send(seq, undelivered)
        if refused is not None:
            self.delivered.append(refused)
            return False
        self.delivered.append(PassDelivery(seq, undelivered))
        return True

    async def _record(self, seq: int, text: str) -> PassDelivery | None:
        """Record the delivery in the workflow before it is sent: once the signal call
        returns, the server holds it, and a lost try's next one continues from it (and the
        key is never used for other text). The refused delivery if it could not be."""
        spec = self.spec
        info = activity.info()
        flow = activity.client().get_workflow_handle(
            info.workflow_id or "", run_id=info.workflow_run_id
        )
        intent = DeliveryIntent(spec.pass_id, seq, text)
        try:
            await asyncio.wait_for(
                flow.signal(DELIVERY_INTENT_SIGNAL, intent), spec.host_call_timeout
            )
        except TimeoutError:
            message = (
                f"the delivery could not be recorded within {spec.host_call_timeout:g} s, "
                "so it was not sent"
            )
            return PassDelivery(seq, text, message, timed_out=True)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            message = f"the delivery could not be recorded, so it was not sent: {err}"
            return PassDelivery(seq, text, message)
        return None

    async def _send(self, seq: int, text: str) -> PassDelivery | None:
        """Send a recorded delivery under its key; the refused delivery if the channel
        refused it or did not return in time."""
        spec = self.spec
        key = f"{spec.keys_prefix}:{seq}" if spec.keys_prefix is not None else None
        try:
            await asyncio.wait_for(_send(self.channel, text, None, key), spec.host_call_timeout)
        except TimeoutError:
            message = f"channel.send_text did not return within {spec.host_call_timeout:g} s"
            return PassDelivery(seq, text, message, timed_out=True)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            return PassDelivery(seq, text, f"{type(err).__name__}: {err}")
        return None

    async def _resend_last_recorded(self) -> bool:
        """A lost try's last recorded delivery is the only one that may not have reached the
        channel: a channel that takes keys is sent it again under its own key (it drops it
        if it has it). An unkeyed channel cannot tell, so it is counted delivered and not
        sent again. False when the channel refused it."""
        recorded = self.spec.recorded
        if not recorded or self.spec.keys_prefix is None:
            return True
        if not takes_idempotency_keys(self.channel):
            return True
        last = recorded[-1]
        refused = await self._send(last.seq, last.text)
        if refused is None:
            return True
        self.delivered[-1] = refused
        return False


class TurnWorker:
    """A Temporal worker for durable generation turns on ``task_queue``: it runs the turn's
    workflow and its activities over the host's registries — ``providers`` by name (an
    `Attempt`, which keeps its keys on the worker, or a provider or a factory called with
    each key), ``tools`` and ``channels`` by name. Run it with ``await worker.run()`` or as
    an ``async with`` block, whose end waits for the worker's whole shutdown (its polls
    and its running activities ended, its core finalized) before the code after it
    runs; ``worker_options`` go to `temporalio.worker.Worker`."""

    def __init__(
        self,
        client: Client,
        task_queue: str,
        *,
        providers: Mapping[str, Attempt | Any],
        tools: ToolRegistry | Iterable[Tool] = (),
        channels: Mapping[str, Channel],
        **worker_options: Any,
    ) -> None:
        self.activities = TurnActivities(providers, tools, channels)
        runner = SandboxedWorkflowRunner(
            restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSED_THROUGH)
        )
        self.worker = Worker(
            with_turn_converter(client),
            task_queue=task_queue,
            workflows=[GenerationTurnWorkflow],
            activities=[
                self.activities.describe_turn,
                self.activities.stream_pass,
                self.activities.run_tool,
                self.activities.reconcile_tool,
                self.activities.call_channel,
            ],
            workflow_runner=runner,
            **worker_options,
        )

    async def run(self) -> None:
        await self.worker.run()

    async def shutdown(self) -> None:
        await self.worker.shutdown()

    async def __aenter__(self) -> TurnWorker:
        await self.worker.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.__aexit__(*exc)  # type: ignore[arg-type]
