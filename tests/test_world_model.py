"""The kit's world model (`toolloop_fsm.testing.world`): every event it says may come is one
the machine takes, its draws stay inside its finite alphabet, the calls of a tool batch run
and time out each on their own, and a tool cut off at its deadline still owes its outcome —
the timeout, or in doubt."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartStream
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import CHUNK_TYPES
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import build_tools
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing.world import CHUNK_KINDS
from toolloop_fsm.testing.world import Happening
from toolloop_fsm.testing.world import World

TOOLS = build_tools(TurnScript(), clock=VirtualClock(), signals=TurnSignals(), executions=[])
REQUEST = TurnRequest([{"role": "user", "content": "hello"}])
#: How deep the exhaustive walk goes: every sequence of this many moves from the start.
DEPTH = 3


def _replayed(policy: LoopPolicy, events: list[object], tools: ToolRegistry = TOOLS) -> Any:
    machine = ToolLoopMachine(policy, tools=tools)
    world = World()
    world.take(machine.start(REQUEST))
    for event in events:
        effects = machine.feed(event)  # raises InvalidEvent if the world offered it wrongly
        world.fed(event)
        world.take(effects)
    return machine, world


def test_every_move_the_world_offers_is_one_the_machine_takes_to_three_moves_deep() -> None:
    """An exhaustive walk over the finite alphabet: each path is replayed on a fresh
    machine, so a move the machine refuses fails the test with its path."""
    for policy in (
        LoopPolicy(),
        LoopPolicy(delivery_flush_chars=1, max_function_call_iterations=1),
    ):
        paths: list[list[object]] = [[]]
        walked = 0
        for _ in range(DEPTH):
            longer = []
            for path in paths:
                machine, world = _replayed(policy, path)
                if machine.is_finished:
                    continue
                longer += [[*path, move] for move in world.moves()]
            for path in longer:
                try:
                    _replayed(policy, path)
                except InvalidEvent as refused:
                    raise AssertionError(f"the world offered a refused move: {path}") from refused
            walked += len(longer)
            paths = longer
        assert walked > 1_000, walked  # the walk is not vacuous


def test_the_world_s_copy_moves_on_alone() -> None:
    world = World()
    world.take([RunTool(1, "get_weather", {}, "k")])
    branch = world.copy()
    branch.take([CancelTool(1)])
    assert Happening.TOOL_FINISHED in world.enabled()
    assert Happening.TOOL_FINISHED not in branch.enabled()


@given(policy=loop_policies(), data=st.data())
def test_every_drawn_event_is_one_the_world_names_among_its_moves(
    policy: LoopPolicy, data: st.DataObject
) -> None:
    machine = ToolLoopMachine(policy, tools=TOOLS)
    world = World()
    world.take(machine.start(REQUEST))
    for _ in range(60):
        if machine.is_finished:
            break
        enabled = world.enabled()
        moves = world.moves()
        event = world.draw_event(data)
        if isinstance(event, CHUNK_TYPES):
            # chunks come from the kit's wider `chunks()` menu; their kinds are the alphabet's
            assert Happening.CHUNK in enabled
            assert type(event) in {type(chunk) for chunk in CHUNK_KINDS.values()}
        else:
            assert event in moves, (event, enabled)
        effects = machine.feed(event)
        world.fed(event)
        world.take(effects)


def test_a_tool_cut_off_at_its_deadline_owes_its_outcome_and_may_end_in_doubt() -> None:
    def pay(_arguments: dict[str, Any], _context: ToolContext) -> ToolResult:
        raise AssertionError("the machine never runs a handler")

    def look_up(_arguments: dict[str, Any], _context: ToolContext) -> None:
        return None  # nobody can tell

    tools = ToolRegistry([Tool("pay", "pay", {"type": "object"}, pay, reconcile=look_up)])
    policy = LoopPolicy()
    call = FunctionCall("pay", {})
    machine, world = _replayed(policy, [call, StreamEnded()], tools)
    assert machine.state == "executing_tool"
    (token,) = world.tool_tokens
    effects = machine.feed(DeadlineExpired(DeadlineKind.TOOL, token))
    world.fed(DeadlineExpired(DeadlineKind.TOOL, token))
    world.take(effects)
    assert any(isinstance(e, CancelTool) and e.cut_off for e in effects), effects
    assert Happening.TOOL_FINISHED in world.enabled()  # the cut-off call still owes it
    timed_out, in_doubt = world.events(Happening.TOOL_FINISHED)
    assert isinstance(timed_out, ToolFinished) and isinstance(in_doubt, ToolFinished)
    assert (timed_out.in_doubt, timed_out.error) == (False, "timed out after 300 s")
    assert in_doubt.in_doubt
    effects = machine.feed(in_doubt)
    world.fed(in_doubt)
    world.take(effects)
    # the machine takes it and goes on: the model is told the call failed, a pass streams
    assert machine.state == "awaiting_first_token"
    (start,) = [e for e in effects if isinstance(e, StartStream)]
    (entry,) = start.request.history
    assert entry.call.name == "pay" and not entry.response.success
    assert Happening.TOOL_FINISHED not in world.enabled()


def test_every_running_call_of_a_batch_may_finish_or_time_out_on_its_own() -> None:
    world = World()
    world.take(
        [
            RunTool(1, "get_weather", {}, "k1", position=0),
            ArmDeadline(DeadlineKind.TOOL, 7, 300.0),
            RunTool(2, "search", {}, "k2", position=1),
            ArmDeadline(DeadlineKind.TOOL, 8, 4.0),
        ]
    )
    finishing = {e.dispatch for e in world.events(Happening.TOOL_FINISHED)}  # type: ignore[attr-defined]
    assert finishing == {1, 2}
    assert set(world.events(Happening.DEADLINE)) == {
        DeadlineExpired(DeadlineKind.TOOL, 7),
        DeadlineExpired(DeadlineKind.TOOL, 8),
    }
    # the second call times out: its sibling still runs, and may still finish
    world.fed(DeadlineExpired(DeadlineKind.TOOL, 8))
    world.take([CancelTool(2)])
    assert {e.dispatch for e in world.events(Happening.TOOL_FINISHED)} == {1}  # type: ignore[attr-defined]
    world.fed(ToolFinished(1, ToolOutcomeKind.SUCCEEDED))
    world.take([ClearDeadline(DeadlineKind.TOOL, 7)])
    assert Happening.TOOL_FINISHED not in world.enabled()
    assert Happening.DEADLINE not in world.enabled()
    # a call reported finished twice is one the machine must refuse
    assert ToolFinished(1, ToolOutcomeKind.SUCCEEDED) in world.illegal_events("executing_tool")


def test_a_pass_with_several_calls_runs_them_all_at_once_in_the_world() -> None:
    calls = [FunctionCall("get_weather", {"city": "Oslo"}), FunctionCall("send_sticker", {})]
    machine, world = _replayed(LoopPolicy(), [TextDelta("Both. "), *calls, StreamEnded()])
    assert machine.state == "executing_tool"
    assert len(world.running) == 2 and len(world.tool_tokens) == 2
    for dispatch in list(world.running):
        finished = ToolFinished(dispatch, ToolOutcomeKind.SUCCEEDED)
        effects = machine.feed(finished)
        world.fed(finished)
        world.take(effects)
    assert machine.state == "awaiting_first_token"
    assert not world.running and not world.tool_tokens
