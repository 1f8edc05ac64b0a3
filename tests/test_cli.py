"""The `toolloop-fsm` command, run for real in a subprocess (issue #5).

Every command runs as ``python -m toolloop_fsm …`` from the repository root; the demo and the
fuzzer's printed reproduce command also run through the installed ``toolloop-fsm`` console
script, to show both entry points behave the same.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import readme_example
from tests.serving import run_example
from tests.serving import serving
from toolloop_fsm import TextDelta
from toolloop_fsm import TurnRequest
from toolloop_fsm import generation
from toolloop_fsm import machine
from toolloop_fsm import run_tool_loop
from toolloop_fsm.declaration import declared_transition_ids
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import result_from_json
from toolloop_fsm.result import result_to_json
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

REPO = Path(__file__).resolve().parent.parent
DIAGRAMS = REPO / "diagrams"
CONSOLE_SCRIPT = Path(sys.executable).parent / "toolloop-fsm"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HYPOTHESIS_PROFILE", None)  # the fuzzer sets its own settings
    # this checkout's package and `tests`, wherever a script runs (an example runs in a
    # temporary directory), whatever copy of the package the environment has installed
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


def run(
    *args: str, console: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the command (``python -m toolloop_fsm`` or the console script) from the repo root."""
    if console:
        if not CONSOLE_SCRIPT.exists():
            pytest.skip(f"the toolloop-fsm console script is not installed at {CONSOLE_SCRIPT}")
        command = [str(CONSOLE_SCRIPT), *args]
    else:
        command = [sys.executable, "-m", "toolloop_fsm", *args]
    return subprocess.run(
        command,
        cwd=REPO,
        env=env if env is not None else _env(),
        capture_output=True,
        text=True,
        encoding="utf-8",
        check=False,
    )


def run_bytes(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "toolloop_fsm", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        check=False,
    )


def assert_clean_error(proc: subprocess.CompletedProcess[str], command: str) -> str:
    """Exit 2, one line on stderr naming the command, no traceback anywhere."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"toolloop-fsm {command}: ")
    return lines[0]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def summary(stdout: str) -> str:
    """The result summary the demo ends with (deterministic, unlike the live trace)."""
    return stdout[stdout.index("\nResult\n") :]


# ----------------------------------------------------------------------------- demo
@pytest.fixture(scope="module")
def demo() -> subprocess.CompletedProcess[str]:
    return run("demo")


@pytest.fixture(scope="module")
def saved_demo(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    path = tmp_path_factory.mktemp("demo") / "run.json"
    return run("demo", "--save-trace", str(path), console=True), path


def test_demo_runs_a_turn_with_a_fallback_and_both_tools(
    demo: subprocess.CompletedProcess[str],
) -> None:
    assert demo.returncode == 0, demo.stderr
    assert "Traceback" not in demo.stderr
    out = demo.stdout
    assert "embedded OpenAI-compatible server at http://127.0.0.1:" in out
    # the rate-limited first model is superseded before anything is delivered, then steady-2
    superseded = out.index("⟲ attempt 1 (swift-1) superseded")
    assert superseded < out.index("✉ delivered")
    assert "swift-1: error (rate_limit)" in out  # the fallback notice says why
    assert "attempt 1     swift-1 (key #0): superseded after provider_error" in out
    assert "attempt 2     steady-2 (key #0): completed" in out
    # every transition is printed as it happens, both tiers
    assert "→ judging_attempt --advance--> advancing_model" in out
    assert "→ awaiting_first_token --text_delta--> streaming" in out
    # both tools ran once each and succeeded
    assert re.findall(r"^  tool +(\w+)\(.*\) → ok$", out, re.MULTILINE) == [
        "get_weather",
        "update_short_term_memory",
    ]
    # the reply was delivered, piece by piece, and adds up to the reply in the summary
    delivered = re.findall(r"^  ✉ delivered (.*)$", out, re.MULTILINE)
    assert len(delivered) >= 2
    reply = re.search(r"^  reply +(.*)$", out, re.MULTILINE)
    assert reply is not None
    assert "21 °C" in reply.group(1) and "Paris" in reply.group(1)
    assert "".join(map(ast.literal_eval, delivered)) == ast.literal_eval(reply.group(1))
    assert re.search(r"^  status +completed\b", out, re.MULTILINE)


def test_demo_with_drafting_shows_nothing_until_a_revised_reply_passes_its_review() -> None:
    proc = run("demo", "--drafting")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # the first draft is sent back, a replacement is written, and only that one is delivered
    revise = out.index("reviewer: revise — voice:")
    assert out.index("→ reviewing_draft --review_returned--> revising") > revise
    passed = out.index("reviewer: pass")
    first_delivery = out.index("✉ delivered")
    assert revise < passed < first_delivery
    assert "forecast for Paris" not in out[first_delivery:]  # no word of the first draft shown
    delivered = re.findall(r"^  ✉ delivered (.*)$", out, re.MULTILINE)
    reply = re.search(r"^  reply +(.*)$", out, re.MULTILINE)
    assert reply is not None
    assert "".join(map(ast.literal_eval, delivered)) == ast.literal_eval(reply.group(1))
    assert re.search(r"^  status +completed \(draft_passed\)$", out, re.MULTILINE)
    # the tools ran once each, the revision reused them
    assert re.findall(r"^  tool +(\w+)\(.*\) → ok$", out, re.MULTILINE) == [
        "get_weather",
        "update_short_term_memory",
    ]


def test_fuzz_with_drafting_fuzzes_reviewed_turns_and_covers_the_review_states() -> None:
    proc = run("fuzz", "--drafting", "--examples", "150", "--seed", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no invariant broke" in proc.stdout
    fired = re.search(r"transition coverage: (\d+)/(\d+)", proc.stdout)
    plain = run("fuzz", "--examples", "150", "--seed", "3")
    fired_plain = re.search(r"transition coverage: (\d+)/(\d+)", plain.stdout)
    assert fired is not None and fired_plain is not None
    assert int(fired.group(1)) > int(fired_plain.group(1))  # the review states are reached


def test_demo_drafting_needs_a_server_not_the_scripted_provider() -> None:
    proc = run("demo", "--drafting", "--scripted")
    assert proc.returncode == 2
    assert "--drafting needs a server" in proc.stderr


def test_console_script_demo_behaves_like_python_m(
    demo: subprocess.CompletedProcess[str],
    saved_demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    console, _path = saved_demo
    assert console.returncode == demo.returncode == 0, console.stderr
    assert summary(console.stdout) == summary(demo.stdout)


def test_demo_saves_a_result_that_loads(
    saved_demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, path = saved_demo
    assert proc.returncode == 0, proc.stderr
    result = result_from_json(path.read_text(encoding="utf-8"))
    assert isinstance(result, GenerationTurnResult)
    assert result.status is TurnStatus.COMPLETED
    assert [(a.label, a.superseded) for a in result.attempts] == [
        ("swift-1", True),
        ("steady-2", False),
    ]
    assert [entry.call.name for entry in result.history] == [
        "get_weather",
        "update_short_term_memory",
    ]
    assert repr(result.delivered_text) in proc.stdout
    assert result.trace[0].state == "ready" and result.trace[-1].next_state == "completed"
    # the demo's keys never reach the saved file
    assert "demo-key" not in path.read_text(encoding="utf-8")


def test_trace_prints_the_saved_turn_as_tables(
    saved_demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _proc, path = saved_demo
    proc = run("trace", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("status: completed")
    assert "attempt 1 — swift-1: error (superseded)" in out
    assert "attempt 2 — steady-2: completed" in out
    header = re.compile(r"^#\s+state\s+event\s+next state\s+guard\s+time \(s\)$", re.MULTILINE)
    assert len(header.findall(out)) == 3  # the outer trace and one per attempt
    for outer_state in ("planning", "judging_attempt", "advancing_model", "finishing"):
        assert re.search(rf"^\d+\s+{outer_state}\s", out, re.MULTILINE), outer_state
    for inner_state in ("awaiting_first_token", "streaming", "executing_tool", "building_result"):
        assert re.search(rf"^\d+\s+{inner_state}\s", out, re.MULTILINE), inner_state


def test_trace_shows_the_guard_and_the_time_of_each_step(tmp_path: Path) -> None:
    async def turn() -> GenerationTurnResult:
        clock = VirtualClock()
        provider = ScriptedProvider([[Pause(2.5), TextDelta("Hello.")]], clock=clock)
        return await run_tool_loop(
            provider,
            [],
            RecordingChannel(clock=clock),
            TurnRequest([{"role": "user", "content": "hi"}]),
            clock=clock,
        )

    saved = tmp_path / "turn.json"
    saved.write_text(result_to_json(asyncio.run(turn())), encoding="utf-8")
    proc = run("trace", str(saved))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^1\s+ready\s+start\s+starting_pass\s+0\.000$", out, re.MULTILINE)
    # the first chunk came 2.5 s into the turn; the guard that fired is named
    assert re.search(
        r"^\d+\s+awaiting_first_token\s+text_delta\s+streaming\s+2\.500$", out, re.MULTILINE
    )
    assert re.search(
        r"^\d+\s+ending_pass\s+advance\s+building_result\s+pass_has_text\s+2\.500$",
        out,
        re.MULTILINE,
    )


def test_trace_of_a_turn_saved_before_steps_had_times_leaves_the_time_blank(
    tmp_path: Path,
) -> None:
    steps = [{"state": "ready", "event": "start", "next_state": "starting_pass"}]
    saved = tmp_path / "old.json"
    saved.write_text(json.dumps(steps), encoding="utf-8")
    proc = run("trace", str(saved))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^1\s+ready\s+start\s+starting_pass$", proc.stdout, re.MULTILINE)


def test_demo_against_a_closed_port_says_it_cannot_reach_it() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    proc = run("demo", "--base-url", url, "--model", "x")
    line = assert_clean_error(proc, "demo")
    assert line.startswith(f"toolloop-fsm demo: cannot reach {url}")


def test_demo_base_url_needs_a_model() -> None:
    proc = run("demo", "--base-url", "http://127.0.0.1:1/v1")
    line = assert_clean_error(proc, "demo")
    assert "--base-url" in line and "--model" in line


def test_demo_names_an_unset_api_key_variable() -> None:
    env = _env()
    env.pop("NOT_SET_VAR", None)
    proc = run("demo", "--api-key-env", "NOT_SET_VAR", env=env)
    line = assert_clean_error(proc, "demo")
    assert "NOT_SET_VAR" in line and "not set" in line


# ----------------------------------------------------------------------------- serve
def _readme_example() -> str:
    return readme_example(REPO, "## Running a turn")


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """``toolloop-fsm serve --port 0`` running in the background; yields its base URL."""
    with serving(REPO, _env()) as url:
        yield url


#: What the README example's user types: three turns of one conversation
CHAT = "Weather in Paris?\nAnd in London?\nThanks!\n"


def test_the_readme_chat_bot_holds_a_three_turn_conversation_against_toolloop_fsm_serve(
    served: str, tmp_path: Path
) -> None:
    example = _readme_example()
    assert "http://127.0.0.1:8765/v1" in example  # the README points at `serve`'s default
    assert len(example.splitlines()) <= 97  # the host example stays short
    source = example.replace("http://127.0.0.1:8765/v1", served)
    proc = run_example(source, tmp_path, _env(), stdin=CHAT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "21 °C and clear in Paris" in out  # the model's answer, printed by ConsoleChannel
    assert "21 °C and clear in London" in out  # the second turn's question, answered
    # each turn completed, and the context grew by what the turn added (the system message
    # and each user message, then per turn: two passes, each with its text and call, and the
    # two responses)
    endings = re.findall(r"^\[completed pre_tool_text_suffices, (\d+) messages", out, re.MULTILINE)
    assert endings == ["6", "11", "16"], out
    assert "asked about the weather in London" in out  # the silent tool's note


def _run_served_example(heading: str, served: str, tmp_path: Path) -> str:
    """Run the README's example under ``heading`` against the background ``serve`` (the
    README points it at `serve`'s default address); its output."""
    example = readme_example(REPO, heading)
    assert "http://127.0.0.1:8765/v1" in example
    source = example.replace("http://127.0.0.1:8765/v1", served)
    proc = run_example(source, tmp_path, _env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_readme_drafting_example_revises_once_against_toolloop_fsm_serve(
    served: str, tmp_path: Path
) -> None:
    out = _run_served_example("## Drafting and the tool checkpoint", served, tmp_path)
    assert "Good news" in out and "Let me check" not in out  # only the replacement was shown
    assert " completed draft_passed" in out, out
    assert re.findall(r"^  (pass|revise) ", out, re.MULTILINE) == ["revise", "pass"]


def test_the_readme_batch_example_runs_every_call_of_the_batch_against_toolloop_fsm_serve(
    served: str, tmp_path: Path
) -> None:
    out = _run_served_example("## Tool batches", served, tmp_path)
    assert "ran: ['Paris', 'London', 'Rome']" in out, out
    positions = re.findall(r"^  (\d): (\w+) (.*)$", out, re.MULTILINE)
    assert positions == [
        ("0", "get_weather", "{'city': 'Paris'}"),
        ("1", "get_weather", "{'city': 'London'}"),
        ("2", "get_weather", "{'city': 'Rome'}"),
        ("0", "update_short_term_memory", "{'note': 'asked about Paris, London, Rome'}"),
    ]
    # the model answered every city, from the three answers of one request
    assert "Paris: 20 °C, clear; London: 20 °C, clear; Rome: 20 °C, clear." in out
    assert "completed pre_tool_text_suffices 4" in out


def test_the_readme_limit_example_answers_with_two_of_three_calls_against_toolloop_fsm_serve(
    served: str, tmp_path: Path
) -> None:
    out = _run_served_example("## Limits on a turn", served, tmp_path)
    assert "ran: ['Paris', 'London']" in out, out  # the third call of the batch never ran
    answers = re.findall(r"^  (\w+): (\w+)$", out, re.MULTILINE)
    assert answers == [("Paris", "ok"), ("London", "ok"), ("Rome", "tool_call_limit")]
    # the final answer pass was offered no tools, and answered with the two forecasts
    assert "London: 20 °C, clear; Rome: not looked up." in out
    assert "completed answered_at_tool_call_limit 2" in out


def test_the_readme_approval_example_pauses_and_runs_the_edited_call_against_toolloop_fsm_serve(
    served: str, tmp_path: Path
) -> None:
    out = _run_served_example("## Approvals: calls that wait for a person", served, tmp_path)
    assert "awaiting_approval [('send_money', {'to': 'Bob', 'amount': 50})]" in out, out
    assert out.count("sent 20 to Bob") == 1 and "sent 50" not in out
    assert "Sent 20 € to Bob. It's 20 °C in Paris." in out
    assert "completed [{'to': 'Bob', 'amount': 20}, {'city': 'Paris'}]" in out


def test_the_readme_message_modes_example_steers_and_queues_against_toolloop_fsm_serve(
    served: str, tmp_path: Path
) -> None:
    out = _run_served_example(
        "## Messages during a turn: interrupt, steer, queue", served, tmp_path
    )
    assert "Let me check the forecast for Paris. Let me check the forecast for London." in out
    assert "It's 20 °C and clear in London" in out and "It's 20 °C and clear in Rome" in out
    taken = re.findall(r"^  (\w+) after pass (\d+): (.*)$", out, re.MULTILINE)
    assert taken == [
        ("steer", "1", "Actually, how is it in London?"),
        ("queue", "3", "Thanks! And Rome?"),
    ], out
    assert "completed ['Paris', 'London', 'Rome']" in out


def test_the_readme_example_prints_why_a_turn_failed(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    source = _readme_example().replace("http://127.0.0.1:8765/v1", url)
    proc = run_example(source, tmp_path, _env(), stdin=CHAT)
    assert "[error provider_error, 2 messages" in proc.stdout, proc.stdout + proc.stderr
    assert "connect" in proc.stdout.lower(), proc.stdout  # the error message, not just a status


def test_serve_answers_the_models_route(served: str) -> None:
    import httpx

    listed = httpx.get(f"{served}/models", timeout=None).json()  # no wall-clock limit
    assert {m["id"] for m in listed["data"]} == {"swift-1", "steady-2"}


# ----------------------------------------------------------------------------- diagram
@pytest.mark.parametrize("which", ["inner", "outer"])
def test_mermaid_diagram_equals_the_committed_file(which: str) -> None:
    proc = run_bytes("diagram", which)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (DIAGRAMS / f"{which}.mmd").read_bytes()


def test_dot_diagram_written_to_a_file_equals_the_committed_file(tmp_path: Path) -> None:
    target = tmp_path / "inner.dot"
    proc = run("diagram", "inner", "--format", "dot", "-o", str(target))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert target.read_bytes() == (DIAGRAMS / "inner.dot").read_bytes()


def test_svg_without_graphviz_names_what_to_install() -> None:
    # only the interpreter's own directory on PATH: no `dot` to be found
    proc = run(
        "diagram", "inner", "--format", "svg", env=_env(PATH=str(Path(sys.executable).parent))
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "Graphviz" in proc.stderr
    assert proc.stdout == ""


def test_highlight_colours_the_states_the_saved_turn_visited(
    saved_demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _proc, path = saved_demo
    visited = {
        s
        for step in result_from_json(path.read_text()).trace
        for s in (step.state, step.next_state)
    }
    proc = run("diagram", "outer", "--highlight", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "classDef s_trace" in proc.stdout
    classes = dict(re.findall(r"^  class (\w+) (s_\w+)$", proc.stdout, re.MULTILINE))
    assert {state for state, cls in classes.items() if cls.startswith("s_trace")} == visited
    assert not classes["rotating_key"].startswith("s_trace")  # one key per model: never rotated
    assert proc.stdout != (DIAGRAMS / "outer.mmd").read_text(encoding="utf-8")


def test_highlight_with_a_file_that_is_not_json_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a trace\n", encoding="utf-8")
    proc = run("diagram", "outer", "--highlight", str(bad))
    assert_clean_error(proc, "diagram")
    assert proc.stdout == ""


def test_highlight_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a trace\n", encoding="utf-8")
    proc = run("diagram", "outer", "--highlight", str(bad))
    assert str(bad) in proc.stderr


@pytest.mark.parametrize("command", ["diagram", "trace"])
def test_json_that_is_not_a_trace_is_a_clean_error(command: str, tmp_path: Path) -> None:
    bad = tmp_path / "numbers.json"
    bad.write_text("[1, 2]\n", encoding="utf-8")
    args = (
        ("diagram", "outer", "--highlight", str(bad))
        if command == "diagram"
        else ("trace", str(bad))
    )
    assert_clean_error(run(*args), command)


@pytest.mark.parametrize("command", ["diagram", "trace"])
@pytest.mark.parametrize(
    "content",
    ['{"status": 5}\n', '{"status": "completed", "trace": [{"state": 1}]}\n', "{}\n"],
    ids=["status-only", "bad-step", "empty-object"],
)
def test_an_object_that_is_not_a_saved_result_is_a_clean_error(
    command: str, content: str, tmp_path: Path
) -> None:
    bad = tmp_path / "object.json"
    bad.write_text(content, encoding="utf-8")
    args = (
        ("diagram", "outer", "--highlight", str(bad))
        if command == "diagram"
        else ("trace", str(bad))
    )
    line = assert_clean_error(run(*args), command)
    assert str(bad) in line


@pytest.mark.parametrize(
    "args",
    [
        ("diagram", "inner", "-o", "{missing}/inner.mmd"),
        ("demo", "--scripted", "--save-trace", "{missing}/result.json"),
    ],
    ids=["diagram-output", "demo-save-trace"],
)
def test_writing_into_a_missing_directory_is_a_clean_error(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "such"
    proc = run(*(arg.format(missing=missing) for arg in args))
    line = assert_clean_error(proc, args[0])
    assert str(missing) in line


def test_scripted_demo_saves_its_result_too(tmp_path: Path) -> None:
    target = tmp_path / "scripted.json"
    proc = run("demo", "--scripted", "--save-trace", str(target))
    assert proc.returncode == 0, proc.stderr
    result = result_from_json(target.read_text(encoding="utf-8"))
    assert result.status is TurnStatus.COMPLETED


def test_output_piped_into_a_closed_reader_ends_quietly() -> None:
    command = [sys.executable, "-m", "toolloop_fsm", "demo", "--scripted"]
    with subprocess.Popen(
        command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()  # like `| head -1`: read one line, then hang up
        proc.stdout.close()
        stderr = proc.stderr.read().decode("utf-8")
        proc.wait()
    assert "Traceback" not in stderr, stderr
    assert proc.returncode != 0 or stderr == ""


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    proc = run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"toolloop-fsm {version('toolloop-fsm')}"


# ----------------------------------------------------------------------------- fuzz
def _coverage(out: str) -> tuple[int, int]:
    found = re.search(r"^transition coverage: (\d+)/(\d+)\b", out, re.MULTILINE)
    assert found is not None, out
    return int(found.group(1)), int(found.group(2))


def test_fuzz_default_policy_passes() -> None:
    proc = run("fuzz", "--examples", "60", "--seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b60 examples in [\d.]+ s, [\d,]+ examples/s$", proc.stdout, re.MULTILINE)
    fired, declared = _coverage(proc.stdout)
    assert declared == len(declared_transition_ids(machine.TRANSITIONS))
    assert 0 < fired <= declared
    assert "no invariant broke" in proc.stdout
    assert "FAILED" not in proc.stdout


def test_fuzz_says_an_example_is_a_whole_turn_and_counts_exactly_the_turns_asked() -> None:
    proc = run("fuzz", "--examples", "150", "--seed", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b150 examples in [\d.]+ s, [\d,]+ examples/s$", proc.stdout, re.MULTILINE)
    assert re.search(
        r"^an example is one whole simulated turn, generated, run and checked \(Hypothesis "
        r"drew them as compact seeds, up to \d+ per Hypothesis example\)$",
        proc.stdout,
        re.MULTILINE,
    )
    again = run("fuzz", "--examples", "150", "--seed", "2")
    assert _coverage(again.stdout) == _coverage(proc.stdout)  # --seed reproduces the run


def test_fuzz_outer_tier_passes() -> None:
    proc = run("fuzz", "--tier", "outer", "--examples", "40", "--seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(outer tier)" in proc.stdout and "examples/s" in proc.stdout
    fired, declared = _coverage(proc.stdout)
    assert declared == len(declared_transition_ids(generation.TRANSITIONS))
    assert 0 < fired <= declared


def _failure_report(out: str) -> str:
    """From ``FAILED`` up to (not including) the reproduce line: message, trace, example."""
    return out[out.index("FAILED") : out.index("reproduce with:")]


@pytest.fixture(scope="module")
def broken() -> subprocess.CompletedProcess[str]:
    return run("fuzz", "--policy", "tests.fuzz_policies:BROKEN", "--examples", "200", "--seed", "1")


def test_fuzz_finds_the_broken_guard_and_prints_the_shortest_trace(
    broken: subprocess.CompletedProcess[str],
) -> None:
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "Traceback" not in broken.stdout + broken.stderr
    out = broken.stdout
    assert "\nFAILED: IndexError: list index out of range\n" in out
    table = out[out.index("shortest failing trace") :]
    assert re.search(r"^#\s+state\s+event\s+next state$", table, re.MULTILINE)
    # the shrunk turn: text, a tool call, and the broken rule consulted after the tool
    assert re.search(r"^\d+\s+ready\s+start\s+starting_pass$", table, re.MULTILINE)
    assert re.search(r"^\d+\s+checking_tool_outcome\s+advance\s+\w+$", table, re.MULTILINE)
    assert re.search(r"^reproduce with: toolloop-fsm fuzz .*--seed 1\b", out, re.MULTILINE)


def _reproduce_command(out: str) -> list[str]:
    found = re.search(r"^reproduce with: (.+)$", out, re.MULTILINE)
    assert found is not None, out
    command = shlex.split(found.group(1))
    assert command[0] == "toolloop-fsm"
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"the toolloop-fsm console script is not installed at {CONSOLE_SCRIPT}")
    return [str(CONSOLE_SCRIPT), *command[1:]]


def test_the_printed_reproduce_command_fails_the_same_way(
    broken: subprocess.CompletedProcess[str],
) -> None:
    command = _reproduce_command(broken.stdout)
    proc = subprocess.run(
        command,
        cwd=REPO,
        env=_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        encoding="utf-8",
        check=False,
    )
    assert proc.returncode == broken.returncode == 1, proc.stdout + proc.stderr
    assert _failure_report(proc.stdout) == _failure_report(broken.stdout)


def test_the_printed_reproduce_command_works_verbatim(
    broken: subprocess.CompletedProcess[str],
) -> None:
    proc = subprocess.run(
        _reproduce_command(broken.stdout),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        encoding="utf-8",
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_fuzz_takes_a_policy_factory(broken: subprocess.CompletedProcess[str]) -> None:
    proc = run(
        "fuzz", "--policy", "tests.fuzz_policies:make_broken", "--examples", "200", "--seed", "1"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _failure_report(proc.stdout) == _failure_report(broken.stdout)
    assert "--policy tests.fuzz_policies:make_broken" in proc.stdout


def test_fuzz_names_a_policy_that_hangs_instead_of_hanging_itself() -> None:
    proc = run(
        "fuzz",
        "--policy",
        "tests.fuzz_policies:HANGS",
        "--examples",
        "30",
        "--seed",
        "1",
        "--time-limit",
        "0.5",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    failed = proc.stdout[proc.stdout.index("FAILED") :].splitlines()[0]
    assert "0.5 s time limit" in failed
    assert "fuzz_policies.py" in failed and "in wait_for_ever" in failed


def test_fuzz_progress_shows_the_total_and_an_eta() -> None:
    proc = run("fuzz", "--examples", "40", "--seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\d+/40 examples, [\d,]+/s, ETA \d+ s", proc.stderr), proc.stderr


def test_fuzz_with_zero_examples_is_a_clean_error() -> None:
    line = assert_clean_error(run("fuzz", "--examples", "0"), "fuzz")
    assert "--examples" in line


def test_fuzz_with_an_unimportable_policy_is_a_clean_error() -> None:
    proc = run("fuzz", "--policy", "nosuchmodule:x")
    line = assert_clean_error(proc, "fuzz")
    assert "nosuchmodule" in line and "import" in line
    assert proc.stdout == ""
