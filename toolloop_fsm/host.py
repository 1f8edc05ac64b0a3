"""What the host provides: its channel, its tools, its signals, its clock, and the request.

These are protocols and small values; the host implements `Channel` and the tools'
handlers, and may pass its own `Clock`.
"""

from __future__ import annotations

import difflib
import json
import re
import threading
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from attrs import define
from attrs import field
from attrs import frozen
from attrs import validators as check

from toolloop_fsm.conversation import check_context
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.messages import DEFAULT_MAX_HELD_MESSAGES
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.messages import HeldMessagesFull
from toolloop_fsm.policy import as_optional_frozenset
from toolloop_fsm.policy import as_tuple
from toolloop_fsm.policy import collection_of
from toolloop_fsm.policy import flag
from toolloop_fsm.policy import name_text
from toolloop_fsm.policy import of_type
from toolloop_fsm.policy import positive_count
from toolloop_fsm.policy import positive_seconds
from toolloop_fsm.provider import ToolSpec

if TYPE_CHECKING:
    import asyncio
from toolloop_fsm.result import Notice

_optional_text = of_type(str, type(None))


@frozen
class TurnRequest:
    """What the host asks for: the conversation ``context`` (provider-neutral message dicts;
    a turn's own messages, `toolloop_fsm.conversation.turn_messages`, are added as they are),
    the tools this turn may use (``None`` = every registered tool), and an assistant
    ``prefill`` to continue from. ``turn_id`` names the turn for idempotency keys (a host
    that may resume a turn after a crash gives it one it keeps)."""

    context: Sequence[Mapping[str, Any]] = field(
        converter=as_tuple, validator=[collection_of(Mapping), lambda _r, _a, v: check_context(v)]
    )
    tools_allowed: frozenset[str] | None = field(
        default=None, converter=as_optional_frozenset, validator=check.optional(collection_of(str))
    )
    prefill: str | None = field(default=None, validator=_optional_text)
    thought_log_owner: str = field(default="default", validator=of_type(str))
    max_output: int | None = field(default=None, validator=check.optional(positive_count))
    #: the turn's stable identity: with the sequence of each delivery, the idempotency key a
    #: channel may drop a repeated delivery by (``None``: a fresh id per turn)
    turn_id: str | None = field(default=None, validator=check.optional(name_text))
    #: the host's id of the conversation (thread, session) this turn belongs to: the
    #: telemetry's ``gen_ai.conversation.id`` (``None``: none is recorded)
    conversation_id: str | None = field(default=None, validator=check.optional(name_text))


@frozen
class ToolResult:
    """What a tool handler returns.

    ``message`` is shown to the model beside ``data``; ``end_turn`` ends the turn after this
    tool; ``delivered`` says the tool itself already answered the user; ``expression`` is an
    expression (e.g. a sticker id) to deliver; ``context_restart`` asks for an enhanced
    context restart (docs/behaviour.md §5).
    """

    success: bool = field(default=True, validator=flag)
    data: Any = None
    message: str | None = field(default=None, validator=_optional_text)
    end_turn: bool = field(default=False, validator=flag)
    delivered: bool = field(default=False, validator=flag)
    expression: str | None = field(default=None, validator=_optional_text)
    context_restart: ContextRestart | None = field(
        default=None, validator=of_type(ContextRestart, type(None))
    )


@frozen
class ToolContext:
    """Handed to each tool handler: which turn and dispatch it runs in, and the turn's clock."""

    tool_name: str
    dispatch: int
    iteration: int
    clock: Clock
    #: enrichment kinds a context restart already used this turn: an enrichment tool skips
    #: them (a video already transcribed is not transcribed again)
    disabled_enrichment_kinds: frozenset[str] = frozenset()
    #: the call's stable identity, ``turn_id:occurrence``: the same whenever this call of the
    #: turn runs, in a resumed turn too. A tool with a side effect keys it on this to act
    #: once when a snapshot is resumed twice (docs/behaviour.md §3.13)
    idempotency_key: str | None = None


def call_idempotency_key(turn_id: str | None, occurrence: str) -> str | None:
    """A call's `ToolContext.idempotency_key`: its turn and its ledger occurrence, the
    identity a replay and a resume reuse (``None`` for a turn without an id)."""
    return None if turn_id is None else f"{turn_id}:{occurrence}"


#: A tool's handler: an ``async def`` (awaited on the event loop) or a plain function (run in
#: a worker thread); it is called with the tool's own copy of the arguments and a `ToolContext`
ToolHandler = Callable[[dict[str, Any], ToolContext], Awaitable[ToolResult] | ToolResult]
Redactor = Callable[[Mapping[str, Any]], Mapping[str, Any]]
#: A tool's reconcile hook: asked, with the call's arguments and a `ToolContext`, what really
#: happened to a call cut off mid-run; an ``async def`` or a plain function, as a handler. A
#: `ToolResult` is the call's outcome; ``None`` says it cannot tell (docs/behaviour.md §3.9)
ToolReconciler = Callable[
    [dict[str, Any], ToolContext], Awaitable[ToolResult | None] | ToolResult | None
]
#: Whether one call of a tool must wait for a person's approval, given its arguments
#: (`Tool.needs_approval`); plain and quick: it runs inside the machine's step
ApprovalPredicate = Callable[[Mapping[str, Any]], bool]


REPLAY_MODES = ("reuse", "rerun")

TOOL_NAME_RULE = "^[a-zA-Z0-9_-]{1,64}$"
"""What a tool's name may be: the rule the OpenAI and Anthropic APIs hold a function's name to,
checked when the tool is made rather than when a provider refuses the whole request."""
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _tool_name(_instance: object, _attribute: Any, value: str) -> None:
    if _TOOL_NAME.fullmatch(value) is None:
        raise ValueError(
            f"Tool name {value!r} would be refused by the providers: a tool's name must match "
            f"{TOOL_NAME_RULE} (1 to 64 ASCII letters, digits, underscores and hyphens)"
        )


@frozen
class Tool:
    """A tool the model may call. ``timeout`` overrides the policy's tool deadline;
    ``redact`` prepares arguments for storage in notices.

    ``replay`` says what happens when a replay (a key rotation, a model fallback, a context
    restart) asks for a call this turn already completed: ``"reuse"`` (the default) hands
    back the recorded outcome, so a side effect never happens twice; ``"rerun"`` runs the
    tool again, for read-only tools whose fresh answer matters (a clock, a status poll). A
    deliberate repeat inside one attempt runs, within the repeated-call guard's allowance.

    ``name`` must match `TOOL_NAME_RULE` (``^[a-zA-Z0-9_-]{1,64}$``); another is refused
    here, naming it, since a provider would refuse every request offering it.

    ``parameters`` is the arguments' JSON schema: a call's arguments are checked against it
    before the handler runs (it is compiled on the tool's first dispatch and kept). The
    handler may be ``async def`` or a plain function, which runs in a worker thread.

    ``idempotent`` says that running the tool twice with the same arguments does no more
    than running it once. A durable turn (`toolloop_fsm.temporal`) retries only such a tool
    when the worker running it is lost; any other tool is reported to the model as failed
    with an unknown outcome instead of being run again.

    ``reconcile`` settles a call cut off mid-run — its worker lost, or its handler ignoring
    its cancellation past ``cancel_grace`` — before the model is told anything: it is given
    the call's arguments and a `ToolContext` and returns the `ToolResult` of what really
    happened (looked up: did the payment go through?), which becomes the call's outcome and
    is recorded like a run's, or ``None`` when it cannot tell (the model is then told the
    outcome is unknown). Such a call is named in the result's ``in_doubt_calls`` either way.

    ``sequential`` makes the tool a barrier in a batch of calls (docs/behaviour.md §3.10):
    the calls emitted before it finish first, it runs alone, then the rest go on. For a tool
    that must not overlap with others (it reads what they write, or holds a lock).

    ``repeatable`` exempts the tool from the repeated-call guard (`LoopPolicy.
    max_identical_calls`, docs/behaviour.md §3.11): for a tool whose identical calls are
    meant to give new answers (a die, a status poll).

    ``needs_approval`` makes a call wait for a person (docs/behaviour.md §3.13): ``True`` for
    every call, or a predicate given the call's arguments that says whether this one must
    wait (a transfer over some amount). A call that waits does not run; the turn ends
    ``awaiting_approval`` once the rest of its batch has run, and resumes with the host's
    decisions. A predicate that raises makes the call wait.
    """

    name: str = field(validator=[of_type(str), _tool_name])
    description: str = field(validator=of_type(str))
    parameters: Mapping[str, Any] = field(validator=of_type(Mapping))
    handler: ToolHandler = field(eq=False, validator=check.is_callable())
    requires_follow_up: bool = field(default=True, validator=flag)
    timeout: float | None = field(default=None, validator=check.optional(positive_seconds))
    redact: Redactor | None = field(
        default=None, eq=False, validator=check.optional(check.is_callable())
    )
    replay: str = field(default="reuse")
    idempotent: bool = field(default=False, validator=flag)
    reconcile: ToolReconciler | None = field(default=None, eq=False, kw_only=True)
    sequential: bool = field(default=False, validator=flag, kw_only=True)
    repeatable: bool = field(default=False, validator=flag, kw_only=True)
    needs_approval: bool | ApprovalPredicate = field(default=False, eq=False, kw_only=True)
    #: ``parameters`` as canonical JSON: the key its compiled validator is kept under
    schema_key: str = field(init=False, eq=False, repr=False)

    @schema_key.default
    def _canonical_parameters(self) -> str:
        if not isinstance(self.parameters, Mapping):
            return ""  # the type validator says what is wrong
        try:
            return json.dumps(
                self.parameters, sort_keys=True, separators=(",", ":"), allow_nan=False
            )
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"Tool {self.name!r}: parameters must be a JSON schema made of JSON values ({err})"
            ) from None

    @reconcile.validator
    def _check_reconcile(self, _attribute: Any, value: object) -> None:
        if value is not None and not callable(value):
            raise TypeError(
                f"Tool {self.name!r}: reconcile must be a function taking (arguments, ctx) "
                f"and returning a ToolResult or None, or None; got {type(value).__name__}"
            )

    @needs_approval.validator
    def _check_needs_approval(self, _attribute: Any, value: object) -> None:
        if not isinstance(value, bool) and not callable(value):
            raise TypeError(
                f"Tool {self.name!r}: needs_approval must be True, False or a function taking "
                f"the call's arguments and returning a bool; got {type(value).__name__}"
            )

    @replay.validator
    def _check_replay(self, _attribute: Any, value: object) -> None:
        if value not in REPLAY_MODES:
            raise ValueError(f"Tool.replay must be 'reuse' or 'rerun', got {value!r}")

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


class ToolRegistry:
    """The host's tools by name."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        if isinstance(tools, Tool | str | Mapping) or not isinstance(tools, Iterable):
            raise TypeError(
                f"a ToolRegistry takes a collection of Tool values, got {type(tools).__name__}"
            )
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise TypeError(f"a ToolRegistry holds Tool values, got {type(tool).__name__}")
            if tool.name in self._tools:
                raise ValueError(f"tool {tool.name!r} is registered twice")
            self._tools[tool.name] = tool
        self._specs = {name: tool.spec() for name, tool in self._tools.items()}
        # built once, shared by every turn that offers the whole registry
        self._names = tuple(self._tools)
        self._all_specs = tuple(self._specs.values())

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def spec(self, name: str) -> ToolSpec | None:
        """The tool as exposed to a provider (built once per registry)."""
        return self._specs.get(name)

    def specs(self, names: tuple[str, ...]) -> tuple[ToolSpec, ...]:
        """The specs of the registered tools among ``names``, in their order (`names` itself:
        every spec, one tuple for all the turns offering them)."""
        if names is self._names:
            return self._all_specs
        return tuple(spec for name in names if (spec := self._specs.get(name)) is not None)

    def __iter__(self) -> Any:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def closest_name(self, name: str) -> str | None:
        found = difflib.get_close_matches(name, list(self._tools), n=1, cutoff=0.5)
        return found[0] if found else None


@runtime_checkable
class Channel(Protocol):
    """Where the turn delivers. Every method may raise; the turn then ends ``error``."""

    async def send_text(self, text: str) -> None: ...

    async def send_expression(self, expression: str) -> None: ...

    async def send_notice(self, notice: Notice) -> None: ...

    async def queue_front(self, stop_message: str) -> None: ...


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class Clock(Protocol):
    """Where time comes from. `toolloop_fsm.testing.VirtualClock` is the test clock."""

    def now(self) -> float: ...

    def call_later(
        self, delay: float, callback: Callable[..., None], *args: Any
    ) -> TimerHandle: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The real clock: the running asyncio loop's monotonic time and timers.

    asyncio's default loop reads `time.monotonic`, so `now` reads it directly (it runs once
    per streamed chunk).
    """

    now = staticmethod(time.monotonic)

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> TimerHandle:
        import asyncio

        return asyncio.get_running_loop().call_later(delay, callback, *args)

    async def sleep(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(seconds)


class DestinationUnreachable(Exception):
    """Raised by a host's channel (or reported with `TurnSignals.report_unreachable`) when the
    turn's destination cannot be reached: the generation turn ends ``skipped``."""


#: The real clock is stateless: one instance serves every turn.
LOOP_CLOCK = LoopClock()


@define
class TurnSignals:
    """The host's signals to a running turn: ``request_stop`` is the /kill command (with an
    optional message to queue first); a new user message arrives in one of three modes
    (docs/behaviour.md §8.5): ``interrupt`` (the turn yields to it, today's ``follow_up``),
    ``steer`` (it joins the context at the next pass boundary and the turn goes on) and
    ``queue`` (it is answered once the turn would end, in one more pass);
    ``report_unreachable`` says the destination is gone.

    A turn holds at most ``max_held_messages`` steered and queued messages: one more raises
    `HeldMessagesFull` at the call and is not held. The turn that ends takes its messages
    out of ``held`` (its result says which it answered and which it did not), so one signals
    object can serve a whole conversation.

    Every method is safe to call from any task *and from any thread*: a call made outside
    the turn's event loop changes the flags under a lock and hands the wake-up to the loop
    with ``call_soon_threadsafe``. A stop is consumed by the turn that honours it.
    """

    stop_requested: bool = False
    stop_message: str | None = None
    follow_ups: int = 0
    unreachable: bool = False
    max_held_messages: int = field(default=DEFAULT_MAX_HELD_MESSAGES, validator=positive_count)
    #: the steered and queued messages given to the running (or next) turn, in order
    held: list[HeldMessage] = field(factory=list)
    _listeners: list[tuple[asyncio.AbstractEventLoop | None, Callable[[], None]]] = field(
        factory=list, repr=False
    )
    _lock: threading.Lock = field(factory=threading.Lock, repr=False, eq=False)

    def request_stop(self, stop_message: str | None = None) -> None:
        with self._lock:
            self.stop_requested = True
            if stop_message is not None:
                self.stop_message = stop_message
        self._notify()

    def follow_up(self) -> None:
        """A new user message arrived: the turn yields to it (the ``interrupt`` mode)."""
        with self._lock:
            self.follow_ups += 1
        self._notify()

    def interrupt(self) -> None:
        """A new user message the turn yields to (`follow_up`)."""
        self.follow_up()

    def steer(self, text: str) -> HeldMessage:
        """A user message that joins the running turn's context at its next pass boundary
        (after the running tool batch, or once the pass streaming ends); the turn goes on."""
        return self._hold(HeldMessage("steer", text))

    def queue(self, text: str) -> HeldMessage:
        """A user message the running turn answers once it would end, in one more pass
        (bounded by its ceilings)."""
        return self._hold(HeldMessage("queue", text))

    def release_held(self, messages: Iterable[HeldMessage]) -> None:
        """Forget ``messages``: the turn that held them has ended (the turns call this)."""
        gone = {id(message) for message in messages}
        with self._lock:
            self.held[:] = [message for message in self.held if id(message) not in gone]

    def _hold(self, message: HeldMessage) -> HeldMessage:
        with self._lock:
            if len(self.held) >= self.max_held_messages:
                raise HeldMessagesFull(message, self.max_held_messages)
            self.held.append(message)
        self._notify()
        return message

    def consume_stop(self) -> None:
        """Forget a stop that a turn honoured, so that the next turn run with these signals
        is not stopped by it (the turns call this themselves)."""
        with self._lock:
            self.stop_requested = False
            self.stop_message = None

    def report_unreachable(self) -> None:
        """The destination cannot be reached: the generation turn ends ``skipped``."""
        with self._lock:
            self.unreachable = True
        self._notify()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` on every signal, in the event loop this is called from."""
        self._listeners.append((_running_loop(), listener))

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners[:] = [entry for entry in self._listeners if entry[1] != listener]

    def _notify(self) -> None:
        here = _running_loop()
        for loop, listener in tuple(self._listeners):
            if loop is None or loop is here:
                listener()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(listener)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    # asyncio is imported where it is used: the sans-IO core imports host.py
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
