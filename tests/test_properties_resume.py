"""Property tests of durable turns: any drawn turn, cut at any of its stable points, written
to JSON, read back and resumed in a fresh machine, ends as the uninterrupted turn did — the
same status and reason, each tool run once in all (the runs before the cut and after it
together run exactly the tools the uninterrupted turn ran), and the same delivered text,
both in the result and on a channel that drops a delivery whose idempotency key it already
accepted. For the tool loop (`turn_scripts` × `loop_policies`) and the generation turn
(`generation_chains`).

The "crash" is the snapshot hook raising at the chosen stable point: the run ends there, as
a process that died right after persisting its snapshot. The world outside the process — the
tools' side effects (their run counts) and the channel's keys — survives it, so the resumed
run is given the same tools and channel and a provider that serves the passes not yet
asked for. Scripts with timed host signals are left out: a signal fires at a virtual instant
of one process's clock, which a resumed process does not share.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import assume
from hypothesis import event
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm import Attempt
from toolloop_fsm import SharedRoute
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnSnapshot
from toolloop_fsm import resume_generation_turn
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm import snapshot_to_json
from toolloop_fsm.attempts import AdmissionRequest
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.events import CHUNK_TYPES
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.sansio import KeyBook
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import Stragglers
from toolloop_fsm.testing import ToolExecution
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import build_tools
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing import turn_scripts
from toolloop_fsm.testing.chains import SHARED_TOOLS
from toolloop_fsm.testing.chains import ChainScript
from toolloop_fsm.testing.chains import KeyState
from toolloop_fsm.testing.chains import ModelScript
from toolloop_fsm.testing.chains import generation_chains

KIND_ITEMS = (Fail, Pause, *CHUNK_TYPES)
#: Each example runs a turn up to three times; kept small enough for the ci profile's
#: bound of ~20 s per test on two shared cores.
RESUME_EXAMPLES = 300
#: A generation turn costs more to run (several attempts, each its own tool loop).
CHAIN_RESUME_EXAMPLES = 250


class Crash(Exception):
    """The process died right after its snapshot hook persisted a snapshot."""


class _Provider(ScriptedProvider):
    """A scripted provider serving the drawn passes from ``first`` on (the passes a crashed
    run already asked for are not served again)."""

    def __init__(self, passes: Sequence[Sequence[Any]], first: int, **kwargs: Any) -> None:
        # a kind script's passes: the items a scripted provider plays (`_kind_world`)
        super().__init__(list(passes)[first:], **kwargs)
        self.first = first

    @property
    def asked(self) -> int:
        """The passes asked for in all, counting those served before the crash."""
        return self.first + len(self.requests)


@attrs.define
class LoopWorld:
    """What outlives a crashed process: the tools (with their run counts), the channel and
    the drawn script."""

    script: TurnScript
    policy: LoopPolicy
    channel: RecordingChannel
    tools: ToolRegistry
    executions: list[ToolExecution]
    stragglers: Stragglers


def _loop_world(script: TurnScript, policy: LoopPolicy) -> LoopWorld:
    clock = VirtualClock()
    executions: list[ToolExecution] = []
    stragglers = Stragglers()
    tools = build_tools(
        script, clock=clock, signals=TurnSignals(), executions=executions, stragglers=stragglers
    )
    channel = RecordingChannel(clock=clock, delivery_delay=script.delivery_delay)
    return LoopWorld(script, policy, channel, tools, executions, stragglers)


async def _run_loop(
    world: LoopWorld,
    *,
    resume: TurnSnapshot | None = None,
    first_pass: int = 0,
    on_snapshot: Callable[[TurnSnapshot, _Provider], None] | None = None,
) -> GenerationTurnResult:
    """One process's run: a fresh clock and provider, the world's tools and channel."""
    clock = VirtualClock()
    world.channel.clock = clock
    provider = _Provider(
        world.script.passes,
        first_pass,
        clock=clock,
        continuation_style=world.script.continuation_style,
    )
    hook = None if on_snapshot is None else (lambda snapshot: on_snapshot(snapshot, provider))
    try:
        if resume is not None:
            return await resume_tool_loop(
                resume,
                provider,
                world.tools,
                world.channel,
                policy=world.policy,
                clock=clock,
                on_snapshot=hook,
            )
        request = attrs.evolve(world.script.request(), turn_id="drawn-turn")
        return await run_tool_loop(
            provider,
            world.tools,
            world.channel,
            request,
            policy=world.policy,
            clock=clock,
            continuation_style=world.script.continuation_style,
            on_snapshot=hook,
        )
    finally:
        world.stragglers.release()


def _calls(executions: Sequence[ToolExecution]) -> list[tuple[str, Any]]:
    return [(e.name, e.arguments) for e in executions]


def _kind_world(script: TurnScript) -> bool:
    """Items a scripted provider plays (no hostile trickles or key echoes)."""
    return all(isinstance(item, KIND_ITEMS) for p in script.passes for item in p)


@settings(max_examples=RESUME_EXAMPLES)
@given(script=turn_scripts(), policy=loop_policies(), cut=st.integers(0, 1_000))
def test_a_tool_loop_cut_at_any_stable_point_and_resumed_ends_as_the_uninterrupted_one(
    script: TurnScript, policy: LoopPolicy, cut: int
) -> None:
    assume(not script.signals and script.provider_key is None and _kind_world(script))
    # a channel slower than the host-call budget fails by timing, which a resume shifts (a
    # delivery sent again gets its whole budget again)
    assume(script.delivery_delay < policy.host_call_timeout)
    # the uninterrupted turn, counting its stable points
    whole = _loop_world(script, policy)
    points: list[TurnSnapshot] = []
    expected = asyncio.run(_run_loop(whole, on_snapshot=lambda s, _p: points.append(s)))
    assert points, "every turn has a stable point before its first pass"
    # a turn with one stable point is cut before its pass: kept now and then, so that most
    # examples cut a turn after a tool round
    assume(len(points) > 1 or cut % 4 == 0)
    index = cut % len(points)
    event("cut after a tool round" if index else "cut before the first pass")

    # the same turn in a world of its own, crashed right after persisting snapshot `index`
    world = _loop_world(script, policy)
    persisted: list[tuple[str, int]] = []

    def persist(snapshot: TurnSnapshot, provider: _Provider) -> None:
        persisted.append((snapshot_to_json(snapshot), provider.asked))
        if len(persisted) > index:
            raise Crash

    with contextlib.suppress(Crash):
        asyncio.run(_run_loop(world, on_snapshot=persist))
    text, asked = persisted[-1]
    snapshot = snapshot_from_json(text)
    assert snapshot_to_json(snapshot) == text  # the JSON form round-trips
    resumed = asyncio.run(_run_loop(world, resume=snapshot, first_pass=asked))

    assert (resumed.status, resumed.reason) == (expected.status, expected.reason)
    assert _calls(world.executions) == _calls(whole.executions)
    assert resumed.iterations == expected.iterations
    assert resumed.history == expected.history
    loop = snapshot.loop
    assert loop is not None
    if loop.in_flight:
        # a delivery in flight at the cut is sent again and takes its whole delivery time
        # again: a resumed turn that ends sooner may abandon it (its settle budget runs out)
        # and what follows it. The user still sees no text twice, and nothing but what the
        # uninterrupted turn showed, in its order
        event("deliveries in flight at the cut, sent again")
        assert whole.channel.text.startswith(world.channel.text)
        counted = "".join(d.text for d in resumed.delivered if d.text is not None)
        assert world.channel.text.startswith(counted)
    else:
        # what the user saw: every text once, in order (the keyed channel dropped repeats)
        assert world.channel.text == whole.channel.text
        assert world.channel.expressions == whole.channel.expressions
        assert resumed.delivered_text == expected.delivered_text


# --------------------------------------------------------------------------- the outer tier
@attrs.define
class ChainWorld:
    """What outlives a crashed process in a generation turn: the passes each model and key
    has served (a factory makes a fresh provider per attempt, in every process), the tools'
    runs, the channel, and the host's key book."""

    script: ChainScript
    channel: RecordingChannel
    runs: list[tuple[str, Any]]
    key_book: KeyBook
    #: per (model, key index): how many of its passes were asked for
    served: dict[tuple[int, int | None], int] = attrs.field(factory=dict)


class _SlotProvider(ScriptedProvider):
    """One attempt's provider: serves its model and key's passes from where the world's
    earlier providers for them left off."""

    def __init__(
        self, world: ChainWorld, slot: tuple[int, int | None], passes: Any, **kwargs: Any
    ) -> None:
        super().__init__(passes, **kwargs)
        self.world = world
        self.slot = slot

    def stream(self, request: ProviderRequest) -> Any:
        served = self.world.served.get(self.slot, 0)
        self.world.served[self.slot] = served + 1
        self.requests.append(request)
        return self._play(self.passes[served] if served < len(self.passes) else ())


def _chain_world(script: ChainScript) -> ChainWorld:
    models = (*script.models, *(script.shared.models if script.shared is not None else ()))
    book: KeyBook = {}
    for model in models:
        for index, key in enumerate(model.keys):
            if key.state is KeyState.COOLING:
                book[(model.label, index)] = KeyHealth(cooldown_until=1e9)
            elif key.state is KeyState.RETIRED:
                book[(model.label, index)] = KeyHealth(retired=True)
    return ChainWorld(script, RecordingChannel(), [], book)


def _chain_tools(world: ChainWorld) -> list[Tool]:
    def make(name: str) -> Tool:
        async def handler(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
            world.runs.append((name, arguments))
            expression = "sticker:wave" if name == "send_sticker" else None
            return ToolResult(
                data={"tool": name, "args": arguments},
                message=f"{name} done",
                expression=expression,
            )

        return Tool(name, f"the shared {name} tool", {"type": "object"}, handler)

    return [make(name) for name in SHARED_TOOLS]


async def _run_chain(
    world: ChainWorld,
    *,
    resume: TurnSnapshot | None = None,
    on_snapshot: Callable[[TurnSnapshot], None] | None = None,
) -> GenerationTurnResult:
    """One process's run of the drawn chain: a fresh clock and fresh providers (made by the
    factories as each attempt starts), the world's tools, channel and key book."""
    clock = VirtualClock()
    world.channel.clock = clock
    script = world.script

    def attempt_of(index: int, model: ModelScript) -> Attempt:
        def factory(key: str | None) -> ScriptedProvider:
            key_index = next(i for i, k in enumerate(model.keys) if k.key == key) if key else None
            passes = model.attempt_for(key_index).passes(
                key, echo_key=False, call_prefix=f"call_{model.label}_{key_index}_"
            )
            return _SlotProvider(world, (index, key_index), passes, clock=clock)

        keys = tuple(k.key for k in model.keys)
        return Attempt(factory, keys=keys, label=model.label, tool_calling=model.tool_calling)

    attempts = [attempt_of(i, m) for i, m in enumerate(script.models)]
    shared_route = None
    if script.shared is not None:
        shared = script.shared
        offset = len(script.models)

        async def admit(_request: AdmissionRequest) -> bool:
            if shared.delay > 0:
                await clock.sleep(shared.delay)
            return shared.admit

        shared_route = SharedRoute(
            tuple(attempt_of(offset + i, m) for i, m in enumerate(shared.models)), admit
        )
    tools = _chain_tools(world)
    options: dict[str, Any] = {
        "policy": script.policy,
        "clock": clock,
        "shared_route": shared_route,
        "key_book": world.key_book,
        "on_snapshot": on_snapshot,
    }
    if resume is not None:
        return await resume_generation_turn(resume, attempts, tools, world.channel, **options)
    request = attrs.evolve(script.request(), turn_id="drawn-chain")
    return await run_generation_turn(attempts, tools, world.channel, request, **options)


@settings(max_examples=CHAIN_RESUME_EXAMPLES)
@given(script=generation_chains(), cut=st.integers(0, 1_000))
def test_a_generation_turn_cut_at_any_stable_point_and_resumed_ends_as_the_uninterrupted_one(
    script: ChainScript, cut: int
) -> None:
    # no timed signals, and no channel that breaks on its n-th delivery (a count that a
    # crashed process's deliveries would shift)
    assume(not script.signals and script.broken_delivery is None)
    whole = _chain_world(script)
    points: list[TurnSnapshot] = []
    expected = asyncio.run(_run_chain(whole, on_snapshot=points.append))
    assume(points)  # a chain whose every key is cooling or retired starts no attempt
    assume(any(s.loop is not None and s.loop.iterations > 0 for s in points) or cut % 4 == 0)
    index = cut % len(points)
    cut_at = points[index]
    if cut_at.loop is None:
        event("cut as an attempt starts")
    elif cut_at.loop.iterations == 0:
        event("cut before an attempt's first pass")
    else:
        event("cut after a tool round of an attempt")
    if cut_at.chain is not None and cut_at.chain.attempts > 1:
        event("cut in a fallback attempt")

    world = _chain_world(script)
    persisted: list[str] = []

    def persist(snapshot: TurnSnapshot) -> None:
        persisted.append(snapshot_to_json(snapshot))
        if len(persisted) > index:
            raise Crash

    with contextlib.suppress(Crash):
        asyncio.run(_run_chain(world, on_snapshot=persist))
    snapshot = snapshot_from_json(persisted[-1])
    assert snapshot_to_json(snapshot) == persisted[-1]
    resumed = asyncio.run(_run_chain(world, resume=snapshot))

    assert (resumed.status, resumed.reason) == (expected.status, expected.reason)
    assert world.runs == whole.runs  # each tool ran once in all, as uninterrupted
    assert resumed.delivered_text == expected.delivered_text
    assert world.channel.text == whole.channel.text
    assert world.channel.expressions == whole.channel.expressions
    assert [(a.label, a.status, a.reason) for a in resumed.attempts] == [
        (a.label, a.status, a.reason) for a in expected.attempts
    ]
    assert resumed.attempt_failures == expected.attempt_failures
    assert resumed.credential_source == expected.credential_source
