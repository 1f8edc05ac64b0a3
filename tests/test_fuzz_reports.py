"""What a fuzz report says when something breaks (`toolloop-fsm fuzz`, docs/invariants.md
§13): where the policy's own code raised, a factory that raises as a failure, a rule's
non-bool answer, the examples apart from the shrink runs, the transitions that never fired."""

from __future__ import annotations

import re

import pytest

from tests.fuzz_policies import BROKEN
from tests.fuzz_report_policies import ANSWERS_NO
from toolloop_fsm import LoopPolicy
from toolloop_fsm import machine
from toolloop_fsm.cli import main
from toolloop_fsm.fuzz import FuzzReport
from toolloop_fsm.fuzz import fuzz

RULE_LINE = 'return text.split()[1].endswith(".")'


@pytest.fixture(scope="module")
def broken_report() -> FuzzReport:
    return fuzz(BROKEN, examples=200, seed=1)


def test_a_rule_that_raises_is_reported_at_its_file_and_line(broken_report: FuzzReport) -> None:
    failure = broken_report.failure
    assert failure is not None
    assert failure.message == "IndexError: list index out of range"
    # the user's frames only: none of the library's, asyncio's or Hypothesis's
    assert [(f.file, f.function) for f in failure.frames] == [
        ("tests/fuzz_policies.py", "second_word_ends_sentence")
    ]
    (frame,) = failure.frames
    assert frame.source == RULE_LINE
    with open("tests/fuzz_policies.py", encoding="utf-8") as source:
        assert source.read().splitlines()[frame.line - 1].strip() == RULE_LINE


def test_the_cli_prints_where_the_rule_raised(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fuzz", "--policy", "tests.fuzz_policies:BROKEN", "--examples", "200"])
    out = capsys.readouterr().out
    assert code == 1
    report = out[out.index("FAILED") :].splitlines()
    assert report[0] == "FAILED: IndexError: list index out of range"
    assert re.fullmatch(r"  at tests/fuzz_policies\.py:\d+ in second_word_ends_sentence", report[1])
    assert report[2] == f"    {RULE_LINE}"


def test_a_policy_factory_that_raises_is_a_failed_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "tests.fuzz_report_policies:make_policy_from_settings"
    code = main(["fuzz", "--policy", spec, "--examples", "20"])
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.out + captured.err
    lines = captured.out.splitlines()
    failed = lines.index("FAILED: ValueError: invalid literal for int() with base 10: 'twenty'")
    assert re.fullmatch(
        r"  at tests/fuzz_report_policies\.py:\d+ in make_policy_from_settings", lines[failed + 1]
    )
    assert lines[failed + 2] == '    ceiling = int("twenty")'
    assert f"the policy factory {spec} raised before any turn ran" in captured.out


def test_a_rule_answering_a_word_fails_the_run_naming_the_answer() -> None:
    failure = fuzz(ANSWERS_NO, examples=200, seed=1).failure
    assert failure is not None
    assert failure.message.startswith("ExitRuleError: LoopPolicy.end_after_pre_tool_text says_no")
    assert "returned 'no' (a str), not a bool" in failure.message
    assert "fuzz_report_policies.py:" in failure.message


def test_examples_count_the_turns_asked_for_and_shrink_runs_apart(
    broken_report: FuzzReport,
) -> None:
    # the failing turn is found within the 200 asked for; shrinking it reruns turns that are
    # not examples
    assert 1 <= broken_report.examples <= 200
    assert broken_report.shrink_runs > 0


def test_the_cli_counts_examples_and_shrink_runs_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["fuzz", "--policy", "tests.fuzz_policies:BROKEN", "--examples", "200"])
    first = capsys.readouterr().out.splitlines()[0]
    found = re.search(r": (\d+) examples \(and (\d+) shrink runs\) in ", first)
    assert found is not None, first
    assert 1 <= int(found.group(1)) <= 200 and int(found.group(2)) > 0


def test_a_passing_run_counts_exactly_the_examples_asked_for() -> None:
    report = fuzz(LoopPolicy(), examples=150, seed=2)
    assert report.failure is None
    assert (report.examples, report.shrink_runs) == (150, 0)


def test_the_report_names_the_transitions_that_never_fired(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = fuzz(LoopPolicy(), examples=40, seed=1)
    declared = machine.DECLARATION.transition_ids
    assert report.unfired == tuple(t for t in declared if t not in report.fired)
    assert report.unfired and len(report.unfired) == len(declared) - report.coverage[0]
    main(["fuzz", "--examples", "40", "--seed", "1"])
    out = capsys.readouterr().out
    heading = f"never fired ({len(report.unfired)}):"
    assert heading in out
    listed = out[out.index(heading) :].splitlines()[1 : 1 + len(report.unfired)]
    assert [line.strip() for line in listed] == list(report.unfired)


def test_a_policy_module_that_raises_on_import_is_a_failed_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["fuzz", "--policy", "tests.fuzz_unbuildable_policy:NO_PASSES"])
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.out + captured.err
    lines = captured.out.splitlines()
    assert lines[0] == "FAILED: ValueError: 'max_function_call_iterations' must be >= 1: 0"
    assert re.fullmatch(r"  at tests/fuzz_unbuildable_policy\.py:\d+ in <module>", lines[1])
    # attrs, which validated the value, is not the policy's code; nor is the library
    assert lines[2] == "    NO_PASSES = LoopPolicy(max_function_call_iterations=0)"
    assert lines[3] == ""
    assert "importing tests.fuzz_unbuildable_policy raised before any turn ran" in captured.out
