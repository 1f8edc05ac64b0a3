"""Structural checks of every machine declaration, computed from the declaration as a graph.

Each test runs for every machine registered in `toolloop_fsm.diagrams.DECLARATIONS`, so a
machine is covered the moment it is registered there. Guards are ignored when computing
reachability: these are properties of the declared graph, the property tests cover runs.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.diagrams import DECLARATIONS
from toolloop_fsm.diagrams import declaration
from toolloop_fsm.result import TurnStatus

PACKAGE_DIR = Path(inspect.getfile(importlib.import_module("toolloop_fsm"))).parent
NAMES = sorted(DECLARATIONS)


@pytest.fixture(params=NAMES)
def decl(request: pytest.FixtureRequest) -> MachineDeclaration:
    return declaration(request.param)


def _successors(decl: MachineDeclaration) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {state: set() for state in decl.state_names}
    for edge in decl.edges():
        graph[edge.source].add(edge.dest)
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in graph[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _groups(decl: MachineDeclaration) -> dict[tuple[str, str], list[tuple[str, ...]]]:
    """(source, trigger) → the condition tuples of its transitions, in the order tried."""
    groups: dict[tuple[str, str], list[tuple[str, ...]]] = {}
    for edge in decl.edges():
        groups.setdefault((edge.source, edge.trigger), []).append(edge.conditions)
    return groups


# --------------------------------------------------------------------------- the state set
def test_final_and_transient_states_are_declared_consistently(decl: MachineDeclaration) -> None:
    flagged_final = [s.name for s in decl.states if s.final]
    assert flagged_final == list(decl.final_states), "FINAL_STATES and 'final': True disagree"
    assert decl.initial not in decl.final_states
    assert decl.transient_states <= set(decl.state_names)
    assert not decl.transient_states & set(decl.final_states)
    assert decl.initial not in decl.transient_states, "the initial state waits for start()"
    assert len(set(decl.state_names)) == len(decl.state_names), "a state is declared twice"


def test_inner_initial_state_is_the_runtime_one() -> None:
    from toolloop_fsm.machine import ToolLoopMachine

    assert ToolLoopMachine().state == declaration("inner").initial


# --------------------------------------------------------------------------- graph shape
def test_every_state_is_reachable_from_the_initial_state(decl: MachineDeclaration) -> None:
    unreachable = set(decl.state_names) - _reachable(_successors(decl), decl.initial)
    assert not unreachable, f"{decl.name}: unreachable from {decl.initial}: {sorted(unreachable)}"


def test_every_state_can_reach_a_final_state(decl: MachineDeclaration) -> None:
    graph = _successors(decl)
    stuck = [s for s in decl.state_names if not _reachable(graph, s) & set(decl.final_states)]
    assert not stuck, f"{decl.name}: no path to a final state from {stuck}"


def test_final_states_have_no_outgoing_transitions(decl: MachineDeclaration) -> None:
    leaving = [e.label for e in decl.edges() if e.source in decl.final_states]
    assert not leaving, f"{decl.name}: final states with transitions: {leaving}"


def test_at_most_one_unconditional_transition_per_trigger_and_it_comes_last(
    decl: MachineDeclaration,
) -> None:
    # A guarded transition declared after an unconditional one (same source and trigger) can
    # never fire: transitions tries them in declaration order.
    dead = {key: conds for key, conds in _groups(decl).items() if any(not c for c in conds[:-1])}
    assert not dead, f"{decl.name}: transitions shadowed by an earlier unconditional one: {dead}"


def _transient_cases() -> list[object]:
    return list(_iter_transient_cases())


def _iter_transient_cases() -> Iterator[object]:
    for name in NAMES:
        for state in sorted(declaration(name).transient_states):
            yield pytest.param(name, state, id=f"{name}-{state}")


@pytest.mark.parametrize(("name", "state"), _transient_cases())
def test_transient_state_ends_with_an_unconditional_advance(name: str, state: str) -> None:
    """A decision point is left within the same feed(): its last `advance` transition must be
    unconditional, or a combination no guard foresaw leaves the machine stuck there."""
    advances = _groups(declaration(name)).get((state, "advance"), [])
    assert advances, f"{name}: transient state {state} declares no advance transition"
    assert advances[-1] == (), (
        f"{name}: the last advance from {state} is guarded by {advances[-1]}; "
        "add an unconditional fallback as the last advance transition"
    )


# --------------------------------------------------------------------------- guard order
#: docs/behaviour.md §2.4 (stream end → tool gate → text rules) and §4 (after a tool call),
#: per machine:
#: (source, trigger) → the guards in the order they must be tried; ``None`` = unconditional.
SPEC_GUARD_ORDER: dict[str, dict[tuple[str, str], list[str | None]]] = {
    "inner": {
        **{
            (source, "stream_ended"): [
                # a pass cut at a token or cost ceiling ends the turn, whatever it asked (§2.8)
                "pass_cut_at_token_budget",
                "pass_cut_at_cost_budget",
                # drafting: a pass cut at the held-prose ceiling is over, whatever it asked
                "draft_cut_at_length_limit",
                # a call without a name fails the whole batch (§3.10 rule 1)
                "batch_has_nameless_call",
                # the final answer pass called anyway (§3.12, §2.1): nothing of it runs
                "calls_after_tool_call_limit",
                "calls_at_iteration_ceiling",
                "call_pending",
                # drafting: without a call, held prose completes the response
                "completes_held_draft",
                # the final answer pass answered: the ending says the tools were withdrawn
                "answers_at_tool_call_limit",
                "answers_at_iteration_ceiling",
                "pass_has_text",
                "is_settled_after_tool",
                None,
            ]
            for source in ("awaiting_first_token", "streaming")
        },
        # the gate, for each call of the batch in emitted order (§3.10 rule 1)
        ("gating_call", "advance"): [
            "call_arguments_not_object",
            "call_arguments_truncated",
            "call_arguments_unparseable",
            "call_outside_allowlist",
            "call_already_recorded",
            # the tool checkpoint (§14.6), after the ledger: a reused call is not reviewed
            "call_rejected_before",
            "correction_cannot_be_approved",
            # the repeated-call guard (§3.11): after replay and standing rejections, before
            # a review
            "call_repeats_too_often",
            # the tool-call limit (§3.12): a call refused for its own reason takes none of it
            "call_over_tool_call_limit",
            # approval by a person (§3.13): after every refusal, before the checkpoint
            "call_needs_approval",
            "call_needs_checkpoint",
            None,
        ],
        # the batch's admitted calls run first; a batch with calls waiting then pauses
        ("next_call", "advance"): [
            "calls_left_at_gate",
            "calls_admitted",
            "calls_await_approval",
            None,
        ],
        # §2.1: the ceiling, the budgets, then the final answer pass (§3.12), then an
        # ordinary pass
        ("starting_pass", "advance"): [
            "iteration_ceiling_reached",
            # §2.8: a pass that would break a token or cost ceiling does not start
            "token_budget_reached",
            "cost_budget_reached",
            "final_answer_pass_due",
            None,
        ],
        # the batch's last outcome: a batch with calls waiting for approval pauses (§3.13)
        ("executing_tool", "tool_finished"): [
            "batch_finishes_awaiting_approval",
            "batch_finishes",
            None,
        ],
        ("executing_tool", "tool_deadline"): [
            "cut_off_call_is_settled",
            "batch_finishes_awaiting_approval",
            "batch_finishes",
            None,
        ],
        ("recording_tool_outcome", "advance"): [
            "consecutive_error_ceiling_reached",
            # drafting: a round that would end the turn completes the held response first
            "tool_round_completes_held_draft",
            "tool_asked_to_end_turn",
            "continuation_retries_exhausted",
            "should_end_after_pre_tool_text",
            None,
        ],
        ("checking_tool_outcome", "advance"): ["tool_requested_context_restart", None],
        ("completing_response", "advance"): [
            "no_pending_prose",
            "reviewer_unavailable",
            "reviews_exhausted",
            None,
        ],
        ("reviewing_draft", "review_returned"): [
            "draft_cut_at_length_limit",
            "verdict_passes",
            "verdict_unavailable",
            "revision_left",
            None,
        ],
        ("reviewing_call", "review_returned"): [
            "verdict_passes",
            "verdict_revises",
            "reviewing_correction",
            None,
        ],
    },
    "outer": {
        ("judging_attempt", "advance"): [
            "destination_unreachable",
            "attempt_is_final",
            "attempt_failed_in_host_code",
            # a budget reached is final: another model would spend more (§2.8 rule 6)
            "attempt_reached_a_budget",
            "another_key_for_this_model",
            "another_model_in_chain",
            "shared_route_may_be_admitted",
            None,
        ],
        ("admitting_shared_route", "admission_decided"): ["admission_granted", None],
        ("planning", "advance"): ["no_attempt_available", None],
    },
}


def _order_cases() -> list[object]:
    return list(_iter_order_cases())


def _iter_order_cases() -> Iterator[object]:
    for name, table in SPEC_GUARD_ORDER.items():
        for (source, trigger), expected in table.items():
            yield pytest.param(name, source, trigger, expected, id=f"{name}-{source}-{trigger}")


def _tried(decl: MachineDeclaration, source: str, trigger: str) -> list[tuple[str, ...]]:
    """The guards tried, in order, when ``trigger`` arrives in ``source``: its own guarded
    transitions, or — when it leads unconditionally into a transient decision state — that
    state's ``advance`` guards (the same decision, declared one step later)."""
    edges = [e for e in decl.edges() if (e.source, e.trigger) == (source, trigger)]
    assert edges, f"{decl.name}: no {trigger} transitions from {source}"
    only = edges[0]
    if (
        len(edges) == 1
        and not only.conditions
        and only.dest in decl.transient_states
        and (only.dest, "advance") != (source, trigger)
    ):
        return _tried(decl, only.dest, "advance")
    return [e.conditions for e in edges]


@pytest.mark.parametrize(("name", "source", "trigger", "expected"), _order_cases())
def test_guards_are_tried_in_spec_order(
    name: str, source: str, trigger: str, expected: list[str | None]
) -> None:
    conditions = _tried(declaration(name), source, trigger)
    for conds in conditions:
        assert len(conds) <= 1, f"{name}: {source}/{trigger} combines guards {conds}"
    tried = [conds[0] if conds else None for conds in conditions]
    assert tried == expected


# --------------------------------------------------------------------------- rule of the house
def test_every_guard_is_a_function_in_a_guards_module(decl: MachineDeclaration) -> None:
    assert decl.guards
    for guard in decl.guards:
        assert inspect.isfunction(guard), f"{decl.name}: guard {guard!r} is not a function"
        assert guard.__module__.startswith("toolloop_fsm.guards."), (
            f"{decl.name}: guard {guard.__name__} lives in {guard.__module__}, "
            "not toolloop_fsm.guards.*"
        )


def test_every_action_is_a_function_in_a_states_module(decl: MachineDeclaration) -> None:
    assert decl.actions
    for action in decl.actions:
        assert inspect.isfunction(action), f"{decl.name}: action {action!r} is not a function"
        assert action.__module__.startswith("toolloop_fsm.states."), (
            f"{decl.name}: action {action.__name__} lives in {action.__module__}, "
            "not toolloop_fsm.states.*"
        )


def test_an_endings_readers_are_functions_in_a_guards_module(decl: MachineDeclaration) -> None:
    # an ending carried over from the run reads its status and reason as a guard reads: purely
    readers = [
        reader
        for t in decl.transitions
        if t.ends is not None
        for reader in (t.ends.status_of, t.ends.reason_of)
        if reader is not None
    ]
    for reader in readers:
        assert inspect.isfunction(reader) and reader.__module__.startswith("toolloop_fsm.guards.")


def test_names_are_unique_within_a_declaration(decl: MachineDeclaration) -> None:
    # the diagrams and the trace name guards and actions by their function's name
    for functions in (decl.guards, decl.actions):
        names = [fn.__name__ for fn in functions]
        assert len(names) == len(set(names))
    assert len(set(decl.transition_ids)) == len(decl.transition_ids)


# --------------------------------------------------------------------------- declared endings
def test_every_way_into_the_settle_step_declares_its_ending(decl: MachineDeclaration) -> None:
    """An exit names its ending where it happens: no transition reaches the shared settle step
    from outside it without one, and none that declares one leads anywhere else."""
    settle = decl.settle_states
    assert settle, f"{decl.name} declares no settle step"
    undeclared = [
        e.ident
        for e in decl.edges()
        if e.dest in settle and e.source not in settle and e.transition.ends is None
    ]
    assert not undeclared, f"{decl.name}: into the settle step without an ending: {undeclared}"
    astray = [e.ident for e in decl.edges() if e.transition.ends and e.dest not in settle]
    assert not astray, f"{decl.name}: an ending that skips the settle step: {astray}"


def test_the_settle_step_leaves_only_for_the_terminal_state_the_ending_names(
    decl: MachineDeclaration,
) -> None:
    """Out of the settle step, each final state is taken by the guard that reads it off the
    decided ending, and every status an ending names is a final state it can take."""
    finals = set(decl.final_states)
    routes = {e.dest for e in decl.edges() if e.source in decl.settle_states and e.dest in finals}
    named = {s.value for t in decl.transitions if t.ends for s in t.ends.statuses}
    assert named <= routes == finals
    assert finals <= {status.value for status in TurnStatus}


def test_every_terminal_state_is_the_ending_of_some_exit(
    decl: MachineDeclaration,
) -> None:
    named = {s.value for t in decl.transitions if t.ends for s in t.ends.statuses}
    assert named == set(decl.final_states)


def test_every_trace_note_is_written_by_an_action_of_its_state(decl: MachineDeclaration) -> None:
    for note in decl.notes:
        writers = {e.transition.do for e in decl.edges() if e.source == note.state}
        assert note.written_by in writers, f"{decl.name}: {note.event} is noted by no action"


# --------------------------------------------------------------------------- imports
FORBIDDEN_EXTERNAL = {"asyncio", "httpx", "httpx_sse", "anyio", "trio"}


def _sans_io_files() -> list[Path]:
    files = sorted((PACKAGE_DIR / "guards").glob("*.py"))
    files += sorted((PACKAGE_DIR / "states").glob("*.py"))
    for name in NAMES:
        module = importlib.import_module(declaration(name).source_module)
        files.append(Path(inspect.getfile(module)))
    return files


def _module_name(path: Path, root: Path = PACKAGE_DIR.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    path: Path, root: Path = PACKAGE_DIR.parent, *, at_import_time: bool = False
) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every runtime import in ``path`` (``if TYPE_CHECKING:``
    blocks skipped; relative imports resolved). ``at_import_time`` also skips imports inside
    function bodies, which run only when called."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if at_import_time and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names]))
        for inner in ast.iter_child_nodes(node):
            visit(inner)

    visit(tree)
    return found


def _violations(module: str, names: list[str]) -> list[str]:
    top = module.split(".")[0]
    bad: list[str] = []
    if top in FORBIDDEN_EXTERNAL:
        bad.append(module)
    if module == "toolloop_fsm.pump" or module.startswith("toolloop_fsm.pump."):
        bad.append(module)
    if module == "toolloop_fsm":
        # the package facade re-exports the pump and the adapters
        bad.append(f"from toolloop_fsm import {', '.join(names)}")
    if module == "toolloop_fsm.providers":
        # the adapters' package: the contract the machines use is `toolloop_fsm.provider`
        bad.append(f"from toolloop_fsm.providers import {', '.join(names)}" if names else module)
    if module.startswith("toolloop_fsm.providers."):
        bad.append(module)
    return bad


@pytest.mark.parametrize("path", _sans_io_files(), ids=lambda p: _module_name(p))
def test_sans_io_modules_import_no_io(path: Path) -> None:
    """The dependency rule (docs/design.md §2): nothing in guards/, states/ or the machines
    imports asyncio, httpx, a provider adapter or the pump (checked on the source, so an unused
    import counts too)."""
    bad = [v for module, names in _imports(path) for v in _violations(module, names)]
    assert not bad, f"{_module_name(path)} imports {bad}"


def test_import_checker_sees_violations(tmp_path: Path) -> None:
    # The check above is only as good as its parser: feed it each kind of violation.
    source = (
        "import asyncio\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import httpx\n"
        "def f():\n    from ..pump import EventPump\n"
        "from toolloop_fsm.providers.anthropic import AnthropicProvider\n"
        "from toolloop_fsm.provider import ProviderRequest\n"
        "from toolloop_fsm.providers import ToolSpec\n"
        "from toolloop_fsm import run_tool_loop\n"
    )
    probe = tmp_path / "toolloop_fsm" / "states" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source, encoding="utf-8")
    found = [v for m, n in _imports(probe, tmp_path) for v in _violations(m, n)]
    assert found == [
        "asyncio",
        "toolloop_fsm.pump",
        "toolloop_fsm.providers.anthropic",
        "from toolloop_fsm.providers import ToolSpec",
        "from toolloop_fsm import run_tool_loop",
    ]


def _internal_closure(start: list[Path]) -> dict[str, list[str]]:
    """Every toolloop_fsm module reached from ``start`` by runtime imports (package
    ``__init__``s of subpackages included, since importing ``a.b.c`` runs ``a/b/__init__``;
    the root facade excluded, it is the public surface above every layer) → the chain that
    reached it."""
    chains: dict[str, list[str]] = {_module_name(p): [_module_name(p)] for p in start}
    queue = deque(start)
    while queue:
        path = queue.popleft()
        here = _module_name(path)
        for module, names in _imports(path, at_import_time=True):
            if not module.startswith("toolloop_fsm."):
                chains.setdefault(module, [*chains[here], module])
                continue
            targets = [module]
            parts = module.split(".")
            targets += [".".join(parts[:i]) for i in range(2, len(parts))]
            targets += [f"{module}.{n}" for n in names]
            for target in targets:
                rel = Path(*target.split("."))
                for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
                    file = PACKAGE_DIR.parent / candidate
                    if file.exists() and target not in chains:
                        chains[target] = [*chains[here], target]
                        queue.append(file)
    return chains


def test_sans_io_modules_do_not_pull_in_io_transitively() -> None:
    chains = _internal_closure(_sans_io_files())
    bad = {
        module: " -> ".join(chain)
        for module, chain in chains.items()
        if _violations(module, []) and not module.startswith("from ") and module != "toolloop_fsm"
    }
    assert not bad, "\n".join(bad.values())


#: The root's names: what a host names to run turns — what it calls, builds, implements
#: (tools, channels, providers, reviewers) and compares a result with (docs/design.md §2).
#: A name added here or taken away is a decision about the public API, made on purpose.
ROOT_NAMES = frozenset(
    {
        # running, resuming, durable turns
        "run_tool_loop",
        "run_generation_turn",
        "resume_tool_loop",
        "resume_generation_turn",
        "TurnSnapshot",
        "snapshot_to_json",
        "snapshot_from_json",
        # what a host builds
        "TurnRequest",
        "TurnSignals",
        "LoopPolicy",
        "TurnPolicy",
        "Attempt",
        "SharedRoute",
        "tool",
        "Tool",
        "ToolContext",
        "ToolRegistry",
        "ToolResult",
        "ContextRestart",
        # the ready channels, and the messages a turn added to the conversation
        "CallbackChannel",
        "ConsoleChannel",
        "CollectingChannel",
        "turn_messages",
        # what it implements: a channel, a provider and the chunks it yields, a reviewer
        "Channel",
        "DestinationUnreachable",
        "Provider",
        "ProviderError",
        "ProviderRequest",
        "TextDelta",
        "ThoughtDelta",
        "FunctionCall",
        "UsageReport",
        "FinishReason",
        "FinishKind",
        "Reviewer",
        "ReviewPacket",
        "Pass",
        "Revise",
        "Unavailable",
        "Finding",
        "ModelReviewer",
        # what it reads a result by
        "GenerationTurnResult",
        "TurnStatus",
        "result_to_json",
        "result_from_json",
    }
)
#: Where each name that left the root lives: what only a driver of the machines needs is
#: in `toolloop_fsm.sansio`; a record a host only reads lives with its kind.
MOVED_FROM_THE_ROOT = {
    "ToolLoopMachine": "toolloop_fsm.sansio",
    "GenerationTurnMachine": "toolloop_fsm.sansio",
    "InvalidEvent": "toolloop_fsm.sansio",
    "TraceStep": "toolloop_fsm.sansio",
    "Notice": "toolloop_fsm.sansio",
    "KeyBook": "toolloop_fsm.sansio",
    "AttemptRecord": "toolloop_fsm.result",
    "Delivered": "toolloop_fsm.result",
    "InDoubtCall": "toolloop_fsm.result",
    "ToolHistoryEntry": "toolloop_fsm.result",
    "UsageLedger": "toolloop_fsm.result",
    "ExitView": "toolloop_fsm.policy",
    "AdmissionRequest": "toolloop_fsm.attempts",
    "Clock": "toolloop_fsm.host",
    # a host runs on the real clock without naming it; a provider reads its request's tools
    # as attributes; scene metadata is a rare chunk; an in-doubt call's cause is read off it
    "LoopClock": "toolloop_fsm.host",
    "ToolSpec": "toolloop_fsm.provider",
    "SceneMetadata": "toolloop_fsm.events",
    "InDoubtCause": "toolloop_fsm.result",
}


def test_the_package_root_exports_exactly_the_pinned_host_names_and_at_most_45() -> None:
    import toolloop_fsm

    assert len(ROOT_NAMES) <= 45
    names = set(toolloop_fsm.__all__)
    assert len(toolloop_fsm.__all__) == len(names)
    assert names == ROOT_NAMES, (
        f"added: {sorted(names - ROOT_NAMES)}, taken away: {sorted(ROOT_NAMES - names)}"
    )


def test_every_name_that_left_the_root_is_importable_from_its_new_home() -> None:
    import toolloop_fsm

    for name, home in MOVED_FROM_THE_ROOT.items():
        assert not hasattr(toolloop_fsm, name), f"{name} is still at the root"
        assert hasattr(importlib.import_module(home), name), f"{name} is not in {home}"
        if home == "toolloop_fsm.sansio":
            assert name in importlib.import_module(home).__all__, name


def test_the_package_root_holds_what_a_host_needs_and_sansio_the_rest() -> None:
    import toolloop_fsm
    import toolloop_fsm.sansio as sansio

    # reviewing: the protocol, what it is shown, what it answers, and the ready reviewer
    reviewing = {
        "Reviewer",
        "ReviewPacket",
        "Pass",
        "Revise",
        "Unavailable",
        "Finding",
        "ModelReviewer",
    }
    assert reviewing <= set(toolloop_fsm.__all__), reviewing - set(toolloop_fsm.__all__)
    # durable turns: the snapshot, its JSON form, and the two ways to resume a turn
    durable = {
        "TurnSnapshot",
        "snapshot_to_json",
        "snapshot_from_json",
        "resume_tool_loop",
        "resume_generation_turn",
    }
    assert durable <= set(toolloop_fsm.__all__), durable - set(toolloop_fsm.__all__)
    assert {name for name in toolloop_fsm.__all__ if not hasattr(toolloop_fsm, name)} == set()
    assert {name for name in sansio.__all__ if not hasattr(sansio, name)} == set()
    # every event the machines take and every effect they return is in the sans-IO module
    from toolloop_fsm import effects
    from toolloop_fsm import events

    for module in (events, effects):
        public = {
            name
            for name, value in vars(module).items()
            if isinstance(value, type)
            and value.__module__ == module.__name__
            and not name.startswith("_")
        }
        assert public <= set(sansio.__all__), public - set(sansio.__all__)


#: The optional extras' third-party packages, and the one module of the package that may use
#: each (a host without the extra imports everything else).
EXTRA_PACKAGES = {"temporalio": "toolloop_fsm.temporal", "opentelemetry": "toolloop_fsm.otel"}


def test_only_an_extras_own_module_imports_its_package() -> None:
    """``toolloop-fsm`` installs without its extras: only `toolloop_fsm.temporal` imports
    temporalio, only `toolloop_fsm.otel` imports OpenTelemetry."""
    bad = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = _module_name(path)
        for imported, _names in _imports(path):
            owner = EXTRA_PACKAGES.get(imported.split(".")[0])
            if owner is not None and module != owner and not module.startswith(owner + "."):
                bad.append(f"{module} imports {imported}")
    assert not bad, bad


def test_importing_the_package_loads_no_extra() -> None:
    code = "import sys, toolloop_fsm, toolloop_fsm.sansio, toolloop_fsm.testing; " + (
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('temporalio', "
        "'opentelemetry')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE_DIR.parent,
    ).stdout.strip()
    assert loaded == "[]"
