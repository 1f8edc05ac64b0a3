"""Tool batches on a real Temporal dev server (docs/behaviour.md §3.10, issue 24 rule 6):
the calls of one pass run at once, each its own activity; a call's deadline cuts that call
only; a stop mid-batch keeps the finished calls and cancels the running ones; a worker lost
mid-batch keeps a finished call's outcome, reports a call not marked idempotent unknown and
runs an idempotent one again; and a finished batch's history replays without a
nondeterminism error.

Run as ``python -m tests.temporal.test_batches ADDRESS TASK_QUEUE DIRECTORY`` it is the worker
process the lost-worker test kills: the suite's host tools (`tests.temporal.hosts`) and a
model that asks for three of them in one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.temporal.conftest import WorkerProcesses
from tests.temporal.hosts import FileChannel
from tests.temporal.hosts import StagedProvider
from tests.temporal.hosts import host_tools
from tests.temporal.hosts import read_records
from toolloop_fsm import Attempt
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.result import converter
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import real_time_limit

pytest.importorskip("temporalio")

from temporalio.client import Client
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxRestrictions

from tests.temporal.turns import LOOK_AGAIN
from tests.temporal.turns import POLICY
from tests.temporal.turns import start_turn
from toolloop_fsm.temporal import DATA_CONVERTER
from toolloop_fsm.temporal import TurnHandle
from toolloop_fsm.temporal import TurnWorker
from toolloop_fsm.temporal._values import RUN_TOOL
from toolloop_fsm.temporal._worker import PASSED_THROUGH
from toolloop_fsm.temporal._workflow import GenerationTurnWorkflow

#: The real-time watchdog of each test (a turn that hangs fails instead of blocking the run).
LIMIT = 60.0
REQUEST = TurnRequest([{"role": "user", "content": "How is the weather in Oslo and Paris?"}])
ANY_PLACE = {"type": "object", "properties": {"city": {"type": "string"}}}


def two_calls(first: str, second: str, closing: str) -> list[list[ScriptItem]]:
    """A pass asking for ``first`` (Oslo, ``c1``) and ``second`` (Paris, ``c2``) at once,
    then a pass of text."""
    return [
        [
            TextDelta("Checking both. "),
            FunctionCall(first, {"city": "Oslo"}, "c1"),
            FunctionCall(second, {"city": "Paris"}, "c2"),
            UsageReport(12, 9),
        ],
        [TextDelta(closing), UsageReport(40, 6)],
    ]


@attrs.frozen
class RunningTurn:
    """A durable turn on ``task_queue`` whose worker runs in the test's process."""

    turn: TurnHandle
    provider: ScriptedProvider
    channel: RecordingChannel


@contextlib.asynccontextmanager
async def running_turn(
    client: Client, task_queue: str, script: list[list[ScriptItem]], tools: list[Tool]
) -> AsyncIterator[RunningTurn]:
    """Start the turn with an in-process worker playing ``script`` with ``tools``; the body
    runs under the test's real-time watchdog, and the worker stops when it ends."""
    provider = ScriptedProvider(script)
    channel = RecordingChannel()
    async with TurnWorker(
        client,
        task_queue,
        providers={"main": Attempt(lambda key: provider)},
        tools=tools,
        channels={"chat": channel},
    ):
        turn = await start_turn(client, task_queue, REQUEST)
        async with real_time_limit(LIMIT):
            yield RunningTurn(turn, provider, channel)


async def calls_taken_in(turn: TurnHandle, count: int) -> None:
    """Wait until ``count`` tool calls' activities have completed in the turn's history and a
    later workflow task has taken them in: the workflow has then seen their outcomes."""
    while True:
        tool_calls: set[int] = set()
        done, taken = 0, 0
        async for event in turn.handle.fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                scheduled = event.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == RUN_TOOL:
                    tool_calls.add(event.event_id)
            elif event.HasField("activity_task_completed_event_attributes"):
                completed = event.activity_task_completed_event_attributes
                done += completed.scheduled_event_id in tool_calls
            elif event.HasField("workflow_task_completed_event_attributes"):
                taken = done
        if taken >= count:
            return
        await asyncio.sleep(LOOK_AGAIN)


async def replay(turn: TurnHandle) -> WorkflowHistory:
    """Replay the finished turn's history on a fresh replayer (as a worker taking it over
    would): a nondeterministic workflow raises."""
    history = await turn.handle.fetch_history()
    runner = SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSED_THROUGH)
    )
    replayer = Replayer(
        workflows=[GenerationTurnWorkflow], data_converter=DATA_CONVERTER, workflow_runner=runner
    )
    await replayer.replay_workflow(history)
    return history


def response_text(result: GenerationTurnResult, position: int) -> str:
    [entry] = [e for e in result.history if e.position == position]
    return json.dumps(converter.unstructure(entry.response))


# ---------------------------------------------------------------------- running at once
class Meeting:
    """Two weather stations that each answer only once the other has started: a turn whose
    calls ran one after the other never gets both answers."""

    def __init__(self) -> None:
        self.started = {"Oslo": asyncio.Event(), "Paris": asyncio.Event()}

    def tools(self) -> list[Tool]:
        async def station(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
            city = arguments["city"]
            self.started[city].set()
            other = "Paris" if city == "Oslo" else "Oslo"
            await self.started[other].wait()
            return ToolResult(data={"city": city, "sky": "clear", "dispatch": ctx.dispatch})

        # the deadline bounds a batch run one call at a time: its first call times out
        return [
            Tool("oslo_weather", "Weather in Oslo.", ANY_PLACE, station, timeout=10.0),
            Tool("paris_weather", "Weather in Paris.", ANY_PLACE, station, timeout=10.0),
        ]


async def meeting_turn(client: Client, task_queue: str) -> tuple[RunningTurn, GenerationTurnResult]:
    """The turn whose two weather calls each wait for the other, run to its end."""
    script = two_calls("oslo_weather", "paris_weather", "Clear in both.")
    async with running_turn(client, task_queue, script, Meeting().tools()) as running:
        return running, await running.turn.result()


async def test_two_calls_of_one_pass_run_at_once_and_are_answered_in_emitted_order(
    client: Client, task_queue: str
) -> None:
    running, result = await meeting_turn(client, task_queue)

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Clear in both."
    assert [(e.position, e.call.name, e.call.call_id) for e in result.history] == [
        (0, "oslo_weather", "c1"),
        (1, "paris_weather", "c2"),
    ]
    assert [e.response.success for e in result.history] == [True, True]
    assert [e.response.data["city"] for e in result.history] == ["Oslo", "Paris"]
    assert [e.response.data["dispatch"] for e in result.history] == [1, 2]  # one each
    assert [e.pre_tool_text for e in result.history] == ["Checking both. ", None]
    assert running.channel.text == "Checking both. Clear in both."
    # the model's next request answered both calls
    assert len(running.provider.requests[1].history) == 2


# ---------------------------------------------------------------------- one call's deadline
class Stations:
    """A station that answers at once and one that never answers (it records that it was
    cancelled)."""

    def __init__(self) -> None:
        self.hanging_started = asyncio.Event()
        self.hanging_cancelled = asyncio.Event()
        self.quick_answered = asyncio.Event()

    def tools(self, hanging_timeout: float | None = None) -> list[Tool]:
        async def quick(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
            self.quick_answered.set()
            return ToolResult(data={"city": arguments["city"], "sky": "rain"})

        async def hanging(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
            self.hanging_started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.hanging_cancelled.set()
                raise
            raise AssertionError("a station that never answers answered")

        return [
            Tool("quick_weather", "Weather, at once.", ANY_PLACE, quick),
            Tool("stuck_weather", "Weather, never.", ANY_PLACE, hanging, timeout=hanging_timeout),
        ]


async def test_one_calls_deadline_cuts_only_that_call_and_its_sibling_answers(
    client: Client, task_queue: str
) -> None:
    stations = Stations()
    script = two_calls("stuck_weather", "quick_weather", "Rain in Paris.")
    tools = stations.tools(hanging_timeout=1.0)
    async with running_turn(client, task_queue, script, tools) as running:
        result = await running.turn.result()
        await stations.hanging_cancelled.wait()  # the cut call was cancelled on its worker

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Rain in Paris."
    cut, sibling = result.history
    assert (cut.position, cut.call.call_id, cut.response.success) == (0, "c1", False)
    assert "timed out after 1 s" in response_text(result, 0)
    assert (sibling.position, sibling.call.call_id, sibling.response.success) == (1, "c2", True)
    assert sibling.response.data == {"city": "Paris", "sky": "rain"}
    assert "timed out" not in response_text(result, 1)
    assert result.abandoned_calls == ()
    await replay(running.turn)


# ---------------------------------------------------------------------- a stop mid-batch
async def test_a_stop_mid_batch_keeps_the_finished_call_and_cancels_the_running_one(
    client: Client, task_queue: str
) -> None:
    stations = Stations()
    script = two_calls("quick_weather", "stuck_weather", "never said")
    async with running_turn(client, task_queue, script, stations.tools()) as running:
        await stations.hanging_started.wait()
        # the quick call's outcome is in the workflow's hands before the stop arrives
        await calls_taken_in(running.turn, 1)
        await running.turn.stop("Stopped, as you asked.")
        result = await running.turn.result()
        await stations.hanging_cancelled.wait()  # the running call heard of the stop

    assert (result.status, result.reason) == (TurnStatus.STOPPED_BY_USER, "stopped_during_tool")
    assert result.finished_calls == ("quick_weather",)
    assert result.history == ()  # nothing of the batch was shown to a model
    assert running.channel.queued_front == ["Stopped, as you asked."]
    assert len(running.provider.requests) == 1  # no pass after the stop
    assert result.delivered_text == "Checking both. "
    await replay(running.turn)


# ---------------------------------------------------------------------- a lost worker
#: The lost-worker turn: one pass asking for a note (done at once), a charge (not
#: idempotent, no reconcile hook) and a city lookup (idempotent), the last two waiting for
#: the ``release`` file; then a pass of text.
LOST_BATCH = (
    (
        TextDelta("On it. "),
        FunctionCall("record", {"note": "n1"}, "c1"),
        FunctionCall("charge", {"cents": 500}, "c2"),
        FunctionCall("lookup", {"city": "Oslo"}, "c3"),
        UsageReport(10, 9),
    ),
    (TextDelta("Noted, and Oslo found; the charge is unclear."), UsageReport(40, 9)),
)


class BatchProvider(StagedProvider):
    """A `StagedProvider` whose script is one pass per tool batch answered so far (a batch
    opens at position 0), not one per call: a fresh process continues the same turn."""

    def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
        batches = sum(1 for entry in request.history if entry.position == 0)
        items = self.script[batches] if batches < len(self.script) else ()
        return self._play(items, request.prefill or "")


@pytest.fixture
def batch_workers(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> Iterator[WorkerProcesses]:
    """Worker processes of this module (``python -m tests.temporal.test_batches``)."""
    module = "tests.temporal.test_batches"
    with WorkerProcesses(temporal_address, task_queue, tmp_path, module) as processes:
        yield processes


async def executions_number(path: Path, count: int) -> None:
    """Wait until another process has written ``count`` whole records to ``path``."""
    while len(read_records(path)) < count or not path.read_text(encoding="utf-8").endswith("\n"):
        await asyncio.sleep(LOOK_AGAIN)


async def test_a_worker_lost_mid_batch_keeps_the_finished_call_and_settles_each_running_one(
    client: Client, batch_workers: WorkerProcesses, tmp_path: Path
) -> None:
    first = batch_workers.start()
    turn = await start_turn(
        client,
        batch_workers.task_queue,
        TurnRequest(REQUEST.context, turn_id="batch-turn"),
        attempts=["batch"],
        channel="files",
        tools=["record", "charge", "lookup"],
    )
    executions = tmp_path / "executions.jsonl"
    async with real_time_limit(LIMIT):
        await executions_number(executions, 3)  # every call started; two of them wait
        # the note's outcome is in the history (only it can have finished)
        await calls_taken_in(turn, 1)
        batch_workers.kill(first)
        (tmp_path / "release").touch()  # a second run of any call would finish at once
        batch_workers.start()
        result = await turn.result()

    ran = sorted(json.dumps(r, sort_keys=True) for r in read_records(executions))
    assert ran == sorted(
        json.dumps(r, sort_keys=True)
        for r in (
            {"tool": "record", "note": "n1"},  # finished: never run again
            {"tool": "charge", "cents": 500},  # in doubt: never run again
            {"tool": "lookup", "city": "Oslo"},  # idempotent: run again on the next worker
            {"tool": "lookup", "city": "Oslo"},
        )
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Noted, and Oslo found; the charge is unclear."
    note, charge, lookup = result.history
    assert [e.position for e in result.history] == [0, 1, 2]
    assert (note.call.call_id, note.response.success, note.response.data) == (
        "c1",
        True,
        {"saved": "n1"},
    )
    assert (charge.call.call_id, charge.response.success) == ("c2", False)
    assert "unknown" in response_text(result, 1)
    assert "not run again" in response_text(result, 1)
    assert (lookup.call.call_id, lookup.response.success, lookup.response.data) == (
        "c3",
        True,
        {"latitude": 59.9},
    )
    # the charge was the batch's second call, dispatched second
    assert result.in_doubt_calls == (
        InDoubtCall("charge", 2, "c2", InDoubtCause.WORKER_LOST, reconciled=False),
    )
    await replay(turn)


# ---------------------------------------------------------------------- replaying a batch
async def test_a_finished_batch_turn_replays_from_its_history_without_a_nondeterminism_error(
    client: Client, task_queue: str
) -> None:
    running, result = await meeting_turn(client, task_queue)
    assert result.status is TurnStatus.COMPLETED

    history = await replay(running.turn)
    run_tools = [
        event
        for event in history.events
        if event.HasField("activity_task_scheduled_event_attributes")
        and event.activity_task_scheduled_event_attributes.activity_type.name == RUN_TOOL
    ]
    assert len(run_tools) == 2  # one activity per call of the batch


async def _serve(address: str, task_queue: str, directory: Path) -> None:
    client = await Client.connect(address, data_converter=DATA_CONVERTER)
    worker = TurnWorker(
        client,
        task_queue,
        providers={"batch": Attempt(lambda key: BatchProvider(directory, LOST_BATCH))},
        tools=host_tools(directory),
        channels={"files": FileChannel(directory)},
        # a workflow task left on a killed worker's sticky queue moves on after this
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    )
    async with worker:
        await asyncio.Event().wait()  # until the test kills the process


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], Path(sys.argv[3])))


# ---------------------------------------------------------------------- the repeated-call guard
async def durable_result(
    client: Client,
    task_queue: str,
    provider: ScriptedProvider,
    tools: list[Tool],
    policy: TurnPolicy,
) -> GenerationTurnResult:
    """The result of a durable turn under ``policy``, its worker in the test's process."""
    async with TurnWorker(
        client,
        task_queue,
        providers={"main": Attempt(lambda key: provider)},
        tools=tools,
        channels={"chat": RecordingChannel()},
    ):
        turn = await start_turn(client, task_queue, REQUEST, policy=policy)
        async with real_time_limit(LIMIT):
            return await turn.result()


async def test_the_repeat_allowance_and_a_repeatable_tool_cross_to_the_workflow(
    client: Client, task_queue: str
) -> None:
    """`LoopPolicy.max_identical_calls` and `Tool.repeatable` reach the workflow's machines:
    the repeated weather call is refused, the repeated die roll runs (docs/behaviour.md
    §3.11)."""
    rolls: list[int] = []
    weathers: list[str] = []

    async def weather(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        weathers.append(arguments["city"])
        return ToolResult(data={"city": arguments["city"], "sky": "clear"})

    async def roll(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        rolls.append(len(rolls) + 1)
        return ToolResult(data=len(rolls))

    tools = [
        Tool("get_weather", "Weather.", ANY_PLACE, weather),
        Tool("roll_die", "A die.", {"type": "object"}, roll, repeatable=True),
    ]
    script: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Oslo"}), FunctionCall("roll_die", {})],
        [FunctionCall("get_weather", {"city": "Oslo"}), FunctionCall("roll_die", {})],
        [TextDelta("Clear, and a two.")],
    ]
    policy = attrs.evolve(POLICY, loop=attrs.evolve(POLICY.loop, max_identical_calls=1))
    result = await durable_result(client, task_queue, ScriptedProvider(script), tools, policy)

    assert result.status is TurnStatus.COMPLETED
    assert weathers == ["Oslo"] and rolls == [1, 2]
    responses = [entry.response for entry in result.history]
    assert [r.success for r in responses] == [True, True, False, True]
    assert "repeats an identical call of 'get_weather'" in (responses[2].reason or "")
    assert '"sky": "clear"' in (responses[2].reason or "")


async def test_the_tool_call_limit_crosses_to_the_workflow_and_its_final_pass_asks_for_no_call(
    client: Client, task_queue: str
) -> None:
    """`LoopPolicy.max_tool_calls` reaches the workflow's machines: one call of the batch
    runs, the other is refused, and the pass activity asks the model for no call
    (docs/behaviour.md §3.12)."""
    ran: list[str] = []

    async def weather(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        ran.append(arguments["city"])
        return ToolResult(data={"city": arguments["city"], "sky": "clear"})

    tools = [
        Tool("oslo_weather", "Weather in Oslo.", ANY_PLACE, weather),
        Tool("paris_weather", "Weather in Paris.", ANY_PLACE, weather),
    ]
    policy = attrs.evolve(POLICY, loop=attrs.evolve(POLICY.loop, max_tool_calls=1))
    provider = ScriptedProvider(two_calls("oslo_weather", "paris_weather", "Clear in Oslo."))
    result = await durable_result(client, task_queue, provider, tools, policy)

    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")
    assert ran == ["Oslo"] and result.tool_dispatches == 1
    assert [e.response.status for e in result.history] == [None, "tool_call_limit"]
    assert [r.tools_withdrawn for r in provider.requests] == [False, True]
