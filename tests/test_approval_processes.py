"""The approval round trip across processes (docs/behaviour.md §3.13), over real HTTP against
``toolloop-fsm serve``: one process runs the turn until it waits and writes its snapshot; a
second, the approver, reads it and writes a signed decision; a third resumes the turn from
the two files. The tool's side effect goes to a file-backed ledger keyed by
``ctx.idempotency_key``: resumed twice, by two processes, the payment is made once and both
give the same result. A decision changed on its way is refused by the resuming process.

Run as ``python -m tests.test_approval_processes ROLE URL DIRECTORY`` it is one of those
processes (``turn``, ``approve``, ``resume``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import processes
from tests.serving import serving

REPO = Path(__file__).resolve().parents[1]
KEY = b"approver's key"
QUESTION = "Send Bob 50 and tell me the weather in Oslo."


# --------------------------------------------------------------------------- the processes
def _tools(directory: Path) -> list[Any]:
    from toolloop_fsm import Tool
    from toolloop_fsm import ToolContext
    from toolloop_fsm import ToolResult

    bank = directory / "bank.json"

    async def send_money(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        # the bank keys each payment on the call's identity: a second run of it pays nothing
        paid = json.loads(bank.read_text()) if bank.exists() else {}
        assert ctx.idempotency_key is not None
        if ctx.idempotency_key not in paid:
            paid[ctx.idempotency_key] = arguments
            bank.write_text(json.dumps(paid))
        with (directory / "runs.log").open("a") as log:
            log.write(f"send_money {arguments['amount']} pid={os.getpid()}\n")
        return ToolResult(data=dict(arguments))

    async def get_weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        with (directory / "runs.log").open("a") as log:
            log.write(f"get_weather pid={os.getpid()}\n")
        return ToolResult(data={"city": arguments["city"], "temp_c": 4})

    schema = {"type": "object"}
    return [
        Tool("send_money", "Send money.", schema, send_money, needs_approval=True),
        Tool("get_weather", "The weather.", schema, get_weather),
    ]


async def _role(role: str, url: str, directory: Path) -> None:
    from toolloop_fsm import TurnRequest
    from toolloop_fsm import result_to_json
    from toolloop_fsm import resume_tool_loop
    from toolloop_fsm import run_tool_loop
    from toolloop_fsm import snapshot_from_json
    from toolloop_fsm.approvals import Decision
    from toolloop_fsm.decisions import pending_approvals
    from toolloop_fsm.providers import OpenAICompatibleProvider
    from toolloop_fsm.testing import RecordingChannel

    provider = OpenAICompatibleProvider(url, "steady-2")
    if role == "turn":
        request = TurnRequest([{"role": "user", "content": QUESTION}], turn_id="pay-7")
        paused = await run_tool_loop(provider, _tools(directory), RecordingChannel(), request)
        assert paused.approval is not None, paused.status
        (directory / "snapshot.json").write_text(paused.approval.snapshot)
    elif role == "approve":
        [pending] = pending_approvals(snapshot_from_json((directory / "snapshot.json").read_text()))
        decision = pending.approve(arguments={**pending.arguments, "amount": 30}, key=KEY)
        (directory / "decision.json").write_text(decision.to_json())
    else:
        snapshot = snapshot_from_json((directory / "snapshot.json").read_text())
        decision = Decision.from_json((directory / "decision.json").read_text())
        result = await resume_tool_loop(
            snapshot,
            provider,
            _tools(directory),
            RecordingChannel(),
            decisions=[decision],
            approval_key=KEY,
        )
        print(result_to_json(result))


# --------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    with serving(REPO, _env()) as url:
        yield url


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def _run(role: str, url: str, directory: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tests.test_approval_processes", role, url, str(directory)]
    with processes.running(
        processes.start(
            command,
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    ) as proc:
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_turn_paused_in_one_process_is_approved_in_another_and_resumed_in_a_third(
    served: str, tmp_path: Path
) -> None:
    from toolloop_fsm import TurnStatus
    from toolloop_fsm import result_from_json

    _ok(_run("turn", served, tmp_path))
    assert (tmp_path / "runs.log").read_text().splitlines()[0].startswith("get_weather")
    _ok(_run("approve", served, tmp_path))
    first = result_from_json(_ok(_run("resume", served, tmp_path)))
    second = result_from_json(_ok(_run("resume", served, tmp_path)))
    assert first.status is TurnStatus.COMPLETED
    assert first.final_text == "Sent 30 € to Bob. It's 4 °C in Oslo."
    assert [dict(e.call.arguments) for e in first.history] == [
        {"to": "Bob", "amount": 30},
        {"city": "Oslo"},
    ]
    # two processes resumed one snapshot with one decision: the same result, one payment
    assert (second.status, second.final_text, second.history) == (
        first.status,
        first.final_text,
        first.history,
    )
    paid = json.loads((tmp_path / "bank.json").read_text())
    assert list(paid.values()) == [{"to": "Bob", "amount": 30}]
    runs = (tmp_path / "runs.log").read_text().splitlines()
    assert [line.split()[0] for line in runs] == ["get_weather", "send_money", "send_money"]
    # the weather call of the paused batch never ran again


def test_a_decision_changed_on_its_way_is_refused_by_the_resuming_process(
    served: str, tmp_path: Path
) -> None:
    _ok(_run("turn", served, tmp_path))
    _ok(_run("approve", served, tmp_path))
    decision = json.loads((tmp_path / "decision.json").read_text())
    decision["arguments"]["amount"] = 3000
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    refused = _run("resume", served, tmp_path)
    assert refused.returncode != 0
    assert "ApprovalError" in refused.stderr and "bad signature" in refused.stderr
    assert not (tmp_path / "bank.json").exists()


if __name__ == "__main__":
    asyncio.run(_role(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
