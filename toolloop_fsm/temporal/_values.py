"""The values that cross between the turn's workflow and its activities, and the cattrs-based
payload converter that carries them (and the turn's result) through Temporal."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
from attrs import field
from attrs import frozen
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.converter import BinaryNullPayloadConverter
from temporalio.converter import CompositePayloadConverter
from temporalio.converter import DataConverter
from temporalio.converter import EncodingPayloadConverter

from toolloop_fsm import provider as _provider
from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import Notice
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import converter as result_converter

#: The name the turn's workflow is registered under.
WORKFLOW_NAME = "toolloop_fsm.GenerationTurn"
#: The names of the turn's signals.
STOP_SIGNAL = "stop"
FOLLOW_UP_SIGNAL = "follow_up"
#: The signal that brings the host's decisions on the calls a paused turn waits on, and the
#: workflow's memo entries that say which they are and why the last decisions were refused
#: (docs/behaviour.md §3.13): a memo is read from the server, with no worker running.
DECIDE_SIGNAL = "decide"
APPROVAL_MEMO = "toolloop_fsm.approval"
REFUSED_MEMO = "toolloop_fsm.approval_refused"
#: The signal a pass sends (and awaits) before each delivery it makes.
DELIVERY_INTENT_SIGNAL = "delivery_intent"
#: The activities' names, as the workflow schedules them.
DESCRIBE_TURN = "toolloop_fsm.describe_turn"
STREAM_PASS = "toolloop_fsm.stream_pass"
RUN_TOOL = "toolloop_fsm.run_tool"
RECONCILE_TOOL = "toolloop_fsm.reconcile_tool"
CALL_CHANNEL = "toolloop_fsm.call_channel"


# --------------------------------------------------------------------------- the workflow
@frozen
class TurnInput:
    """What a durable turn is started with: the request, the chain of providers and the
    channel by their names in the worker's registries, the tools it may use (``None``: every
    tool the worker has), the policy, and how soon a lost worker is noticed."""

    request: TurnRequest
    attempts: tuple[str, ...]
    channel: str
    tools: tuple[str, ...] | None = None
    policy: TurnPolicy = field(factory=TurnPolicy)
    heartbeat_timeout: float = 10.0


# --------------------------------------------------------------------------- describing
@frozen
class CatalogueRequest:
    attempts: tuple[str, ...]
    tools: tuple[str, ...] | None
    channel: str


@frozen
class ToolDescription:
    """A tool as the workflow's machines know it: everything but its handler."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    requires_follow_up: bool = True
    timeout: float | None = None
    replay: str = "reuse"
    idempotent: bool = False
    #: the tool has a reconcile hook (it runs on a worker: docs/behaviour.md §3.9)
    reconciles: bool = False
    #: a barrier in a tool batch (docs/behaviour.md §3.10)
    sequential: bool = False
    #: exempt from the repeated-call guard (docs/behaviour.md §3.11)
    repeatable: bool = False
    #: every call waits for a person's approval (docs/behaviour.md §3.13)
    needs_approval: bool = False


@frozen
class Catalogue:
    """What the worker's registries hold for a turn: the chain's plans (never its keys) and
    the tools' descriptions; ``problem`` names what the registries lack instead."""

    plans: tuple[AttemptPlan, ...] = ()
    tools: tuple[ToolDescription, ...] = ()
    #: per attempt: whether its provider is continuation-style
    continuation: tuple[bool, ...] = ()
    problem: str | None = None
    #: the channel takes idempotency keys (it drops a delivery sent again under its key)
    keyed_channel: bool = False


# --------------------------------------------------------------------------- a provider pass
@frozen
class PassDelivery:
    """A delivery the pass made (or tried: ``error`` says why it failed)."""

    seq: int
    text: str
    error: str | None = None
    timed_out: bool = False


@frozen
class PassInput:
    """One provider pass: which provider (by name, and the index of its key), which channel,
    the request, and what the pass needs to deliver exactly as the machine will: the
    delivery key prefix, the sequence number of the pass's first delivery, the flush size
    and whether text is suppressed; and the turn's chain by name, whose keys (with the
    provider's own) the worker masks out of the stream before it delivers or reports it.

    ``pass_id`` names the pass in the deliveries it records (`DeliveryIntent`) before it
    sends them. A try after a lost one carries what the tries before it recorded
    (``recorded``, the text the channel may have shown: it is the pass's first chunks and
    the prefill) and when the first try began (``started_at``, its budgets count from it)."""

    provider: str
    key_index: int | None
    channel: str
    keys_prefix: str | None
    request: ProviderRequest
    first_seq: int
    flush_chars: int
    suppress_text: bool
    first_token_timeout: float
    inactivity_timeout: float
    max_pass_duration: float | None
    host_call_timeout: float
    heartbeat_every: float
    chain: tuple[str, ...] = ()
    pass_id: str = ""
    recorded: tuple[PassDelivery, ...] = ()
    started_at: float | None = None


@frozen
class DeliveryIntent:
    """A delivery a pass is about to make, recorded in the workflow's history before the
    channel is sent it: what a lost pass's next try continues from."""

    pass_id: str
    seq: int
    text: str


@frozen
class PassProgress:
    """What a pass heartbeats, for liveness only: when its first try began. What it
    delivered is recorded before each send (`DeliveryIntent`), never in a heartbeat, which
    the SDK throttles."""

    started_at: float


#: How a pass ended: its stream ran out, failed, missed a deadline, was cancelled (a stop or
#: a follow-up), the channel refused a delivery, or it could not start (the host's provider
#: factory raised).
PASS_ENDINGS = ("ended", "failed", "deadline", "cancelled", "delivery_failed", "host_error")


@frozen
class PassOutcome:
    """A pass's chunks, compactly (`pack_chunks`; text merged between deliveries), what it
    delivered, and how it ended."""

    chunks: tuple[tuple[Any, ...], ...]
    delivered: tuple[PassDelivery, ...]
    ending: str
    failure: StreamFailed | None = None
    deadline: str | None = None
    message: str | None = None


# --------------------------------------------------------------------------- tools, channel
@frozen
class ToolInput:
    """One tool call, and whose keys the worker masks out of what the tool returns: the
    turn's chain by name and the running attempt's provider (its name, key and delivery key
    prefix, as in `PassInput`)."""

    name: str
    dispatch: int
    iteration: int
    arguments: Mapping[str, Any]
    disabled_enrichment_kinds: frozenset[str]
    deadline: float
    heartbeat_every: float
    chain: tuple[str, ...] = ()
    provider: str | None = None
    key_index: int | None = None
    keys_prefix: str | None = None
    #: the call's `ToolContext.idempotency_key`
    idempotency_key: str | None = None


@frozen
class Reconciled:
    """A reconcile hook's answer for a call in doubt: its outcome, or ``None`` (it cannot
    tell, failed, or overran its budget)."""

    finished: ToolFinished | None = None


@frozen
class ChannelCall:
    """One call into the host's channel: a delivery (``key`` is its idempotency key), a
    notice, the stop message, or the mark of a superseded attempt, bounded by ``timeout``
    (for a notice: what is left of the turn's notice budget; one that overruns it has
    ``grace`` to stop)."""

    channel: str
    method: str
    text: str | None = None
    expression: str | None = None
    key: str | None = None
    notice: Notice | None = None
    attempt: int = 0
    label: str = ""
    timeout: float = 30.0
    grace: float = 0.0


@frozen
class ChannelAnswer:
    """What a channel call came to: ``error`` says what went wrong; ``timed_out``, that it
    did not return in time; ``given_up``, that a notice overran its budget and was given up
    on (it ends nothing)."""

    error: str | None = None
    timed_out: bool = False
    given_up: bool = False


# --------------------------------------------------------------------------- chunks
def pack_chunks(chunks: list[Chunk]) -> tuple[tuple[Any, ...], ...]:
    """Chunks as short tuples (a pass's chunks travel in the workflow's history)."""
    packed: list[tuple[Any, ...]] = []
    for chunk in chunks:
        if isinstance(chunk, TextDelta):
            packed.append(("t", chunk.text))
        elif isinstance(chunk, ThoughtDelta):
            packed.append(("r", chunk.text, chunk.signature))
        elif isinstance(chunk, UsageReport):
            packed.append(
                ("u", chunk.input_tokens, chunk.output_tokens, chunk.cumulative, chunk.estimated)
            )
        elif isinstance(chunk, FunctionCall):
            data = dict(chunk.provider_data) if chunk.provider_data is not None else None
            packed.append(
                (
                    "c",
                    chunk.name,
                    chunk.arguments,
                    chunk.call_id,
                    chunk.truncated,
                    chunk.parse_error,
                    data,
                )
            )
        elif isinstance(chunk, FinishReason):
            packed.append(("f", chunk.kind.value, chunk.raw))
        elif isinstance(chunk, SceneMetadata):
            packed.append(("s", chunk.text))
        else:
            raise TypeError(f"not a chunk event: {type(chunk).__name__}")
    return tuple(packed)


def unpack_chunks(packed: tuple[tuple[Any, ...], ...]) -> list[Chunk]:
    chunks: list[Chunk] = []
    for item in packed:
        tag = item[0]
        if tag == "t":
            chunks.append(TextDelta(item[1]))
        elif tag == "r":
            chunks.append(ThoughtDelta(item[1], item[2]))
        elif tag == "u":
            chunks.append(UsageReport(item[1], item[2], item[3], item[4]))
        elif tag == "c":
            chunks.append(FunctionCall(item[1], item[2], item[3], item[4], item[5], item[6]))
        elif tag == "f":
            chunks.append(FinishReason(FinishKind(item[1]), item[2]))
        elif tag == "s":
            chunks.append(SceneMetadata(item[1]))
        else:
            raise ValueError(f"a packed chunk has an unknown tag {tag!r}")
    return chunks


# --------------------------------------------------------------------------- the converter
# `ProviderRequest` names its history's type only for type checkers (the provider contract
# does not import the result module): resolved here, where both are imported
attrs.resolve_types(ProviderRequest, {"ToolHistoryEntry": ToolHistoryEntry, **vars(_provider)})

#: The result's converter (attrs values, enums, frozensets; a result's exception is never
#: stored): chunk tuples hold JSON values of any shape and come back as they went.
converter: cattrs.Converter = result_converter.copy()


def _is_policy(kind: Any) -> bool:
    return kind is LoopPolicy or kind is TurnPolicy


def _unstructure_policy(policy: LoopPolicy | TurnPolicy) -> dict[str, Any]:
    return {
        f.name: converter.unstructure(getattr(policy, f.name)) for f in attrs.fields(type(policy))
    }


def _structure_loop(data: Mapping[str, Any], _type: Any) -> LoopPolicy:
    return LoopPolicy(**data)


def _structure_turn(data: Mapping[str, Any], _type: Any) -> TurnPolicy:
    fields = dict(data)
    fields["loop"] = _structure_loop(fields["loop"], LoopPolicy)
    return TurnPolicy(**fields)


# The policies go field by field, through their own validators: a generated hook would
# resolve their annotations in place, changing the classes a host sees
# (registered by predicate: registering an attrs class by itself resolves it too)
converter.register_unstructure_hook_func(_is_policy, _unstructure_policy)
converter.register_structure_hook_func(lambda kind: kind is LoopPolicy, _structure_loop)
converter.register_structure_hook_func(lambda kind: kind is TurnPolicy, _structure_turn)


class CattrsJSONPayloadConverter(EncodingPayloadConverter):
    """JSON payloads of attrs values (and plain JSON values), unstructured and structured by
    the library's cattrs converter: a result comes back as the `GenerationTurnResult` it was."""

    @property
    def encoding(self) -> str:
        return "json/plain"

    def to_payload(self, value: Any) -> Payload | None:
        data = json.dumps(
            converter.unstructure(value), separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")
        return Payload(metadata={"encoding": self.encoding.encode()}, data=data)

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        value = json.loads(payload.data.decode("utf-8"))
        if type_hint is None or type_hint is Any:
            return value
        return converter.structure(value, type_hint)


class TurnPayloadConverter(CompositePayloadConverter):
    """``None`` as Temporal's null payload, everything else as cattrs JSON."""

    def __init__(self) -> None:
        super().__init__(BinaryNullPayloadConverter(), CattrsJSONPayloadConverter())


#: The data converter a client and a worker running durable turns use.
DATA_CONVERTER = DataConverter(payload_converter_class=TurnPayloadConverter)


def with_turn_converter(client: Client) -> Client:
    """``client``, or a client on the same connection with `DATA_CONVERTER` when it has
    another data converter."""
    if client.data_converter.payload_converter_class is TurnPayloadConverter:
        return client
    config = client.config()
    config["data_converter"] = DATA_CONVERTER
    return Client(**config)
