"""`snapshot_from_json` on hostile text: real snapshots, taken by real turns of every kind (a
tool loop before its first pass and after a tool round, a delivery in flight, a drafted turn
after a revision, the tool checkpoint after a correction, a generation turn as its fallback
attempt starts and inside it, a chain with a cooling key), mutated — fields dropped,
duplicated and retyped, texts and lists swapped, records moved where other records belong,
deep nesting, huge texts and numbers, cut or corrupted text, bytes that are not UTF-8 — are
each read back as a snapshot (which then writes and reads back the same) or refused with a
`SnapshotError` of bounded length. No other exception ever comes out.

Under the ci profile the property runs `FUZZ_CI_EXAMPLES` mutations (seconds); the campaign
marked ``slow`` runs `FUZZ_CAMPAIGN_EXAMPLES` (or the profile's own count, if larger).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import event
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.test_snapshots import SMALL_FLUSH
from tests.test_snapshots import USER
from tests.test_snapshots import CountingTool
from tests.test_snapshots import weather_passes
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSnapshot
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm import snapshot_to_json
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.review import Finding
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.sansio import OfferSnapshot
from toolloop_fsm.sansio import ToolLoopMachine
from toolloop_fsm.snapshot import MAX_SNAPSHOT_ERROR_CHARS
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing.reviewer import ScriptedReviewer

#: Mutations per run under the ci profile: a few seconds on two shared cores.
FUZZ_CI_EXAMPLES = 300
#: Mutations of the campaign marked ``slow``.
FUZZ_CAMPAIGN_EXAMPLES = 2_000


def _profile_examples() -> int:
    return (settings.default or settings()).max_examples


def _ci_examples() -> int:
    """`FUZZ_CI_EXAMPLES` under the ci profile; any other profile's own count."""
    profile = os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    return FUZZ_CI_EXAMPLES if profile == "ci" else _profile_examples()


# --------------------------------------------------------------------------- the corpus
def _collect(saved: list[str]) -> Callable[[TurnSnapshot], None]:
    return lambda snapshot: saved.append(snapshot_to_json(snapshot))


def _tool_loop(saved: list[str]) -> None:
    asyncio.run(
        run_tool_loop(
            ScriptedProvider(weather_passes()),
            [CountingTool().tool()],
            RecordingChannel(),
            TurnRequest(USER, turn_id="fuzz-loop"),
            policy=SMALL_FLUSH,
            on_snapshot=_collect(saved),
        )
    )


def _in_flight(saved: list[str]) -> None:
    machine = ToolLoopMachine(SMALL_FLUSH, snapshots=True)
    machine.start(TurnRequest(USER, turn_id="fuzz-in-flight"))
    machine.feed(TextDelta("Let me look. "))
    machine.feed(FunctionCall("get_weather", {"city": "Oslo", "days": [1, 2, {"hourly": True}]}))
    for effect in machine.feed(StreamEnded()):
        if isinstance(effect, OfferSnapshot):
            saved.append(snapshot_to_json(TurnSnapshot(effect.snapshot)))


def _drafted(saved: list[str]) -> None:
    voice = Finding("voice", "the reply is flat", "answer warmly, in one sentence")
    passes: list[list[ScriptItem]] = [
        [TextDelta("Checking. "), FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("Sunny.")],
        [TextDelta("It is a lovely sunny day in Oslo!")],
    ]
    asyncio.run(
        run_tool_loop(
            ScriptedProvider(passes),
            [CountingTool().tool()],
            RecordingChannel(),
            TurnRequest(USER, turn_id="fuzz-drafted"),
            policy=LoopPolicy(drafting=True),
            reviewer=ScriptedReviewer([Revise([voice]), Pass()]),
            on_snapshot=_collect(saved),
        )
    )


def _checkpoint(saved: list[str]) -> None:
    wrong_city = Finding("tool_use", "the user asked about Oslo", "look up Oslo")
    passes: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Bergen"})],
        [FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("Sunny in Oslo.")],
    ]
    asyncio.run(
        run_tool_loop(
            ScriptedProvider(passes),
            [CountingTool().tool()],
            RecordingChannel(),
            TurnRequest(USER, turn_id="fuzz-checkpoint"),
            policy=LoopPolicy(review_tool_calls=True),
            reviewer=ScriptedReviewer([Revise([wrong_city])]),
            on_snapshot=_collect(saved),
        )
    )


def _fallback(saved: list[str]) -> None:
    failing: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Oslo"})],
        [Fail(ProviderError("overloaded", kind="server", retryable=True))],
    ]
    answering: list[list[ScriptItem]] = [
        [FunctionCall("get_weather", {"city": "Oslo"})],
        [TextDelta("Sunny in Oslo.")],
    ]
    chain = [
        Attempt(ScriptedProvider(failing), label="A"),
        Attempt(ScriptedProvider(answering), label="B"),
    ]
    asyncio.run(
        run_generation_turn(
            chain,
            [CountingTool().tool()],
            RecordingChannel(),
            TurnRequest(USER, turn_id="fuzz-chain"),
            on_snapshot=_collect(saved),
        )
    )


def _cooling_key(saved: list[str]) -> None:
    limited = [
        [Fail(ProviderError("slow down", kind="rate_limit", retryable=True, retry_after=30.0))]
    ]
    chain = [
        Attempt(lambda _key: ScriptedProvider(limited), keys=("k-1", "k-2"), label="A"),
        Attempt(ScriptedProvider([[TextDelta("Hi")]]), label="B"),
    ]
    asyncio.run(
        run_generation_turn(
            chain,
            [],
            RecordingChannel(),
            TurnRequest(USER),
            policy=TurnPolicy(max_key_attempts_per_model=2),
            on_snapshot=_collect(saved),
        )
    )


@functools.cache
def corpus() -> tuple[str, ...]:
    """Every snapshot the turns above took, as the JSON text they were written as."""
    saved: list[str] = []
    for run in (_tool_loop, _in_flight, _drafted, _checkpoint, _fallback, _cooling_key):
        run(saved)
    return tuple(saved)


def test_the_corpus_holds_a_snapshot_of_every_kind() -> None:
    snapshots = [snapshot_from_json(text) for text in corpus()]
    loops = [s.loop for s in snapshots if s.loop is not None]
    assert any(s.chain is None for s in snapshots)
    assert any(s.chain is not None and s.loop is None for s in snapshots)
    assert any(s.chain is not None and s.loop is not None for s in snapshots)
    assert any(s.chain is not None and s.chain.failures for s in snapshots)
    assert any(s.chain is not None and s.chain.health for s in snapshots)
    assert any(loop.history for loop in loops)  # after a tool round
    assert any(loop.in_flight for loop in loops)
    assert any(loop.draft is not None and loop.draft.records for loop in loops)
    assert any(loop.draft is not None and loop.draft.tool_reviews for loop in loops)


def test_every_real_snapshot_restored_and_captured_again_is_the_same_snapshot() -> None:
    """Capture and restore carry every field across, both ways: a snapshot of each kind,
    restored as the machines' state and captured from it again, is equal to itself (the
    cooldowns, restored on the same clock, to the float)."""
    from toolloop_fsm.attempts import AttemptPlan
    from toolloop_fsm.host import ToolRegistry
    from toolloop_fsm.snapshot import policy_terms
    from toolloop_fsm.snapshot_capture import capture_chain
    from toolloop_fsm.snapshot_capture import capture_loop
    from toolloop_fsm.snapshot_capture import restore_chain
    from toolloop_fsm.snapshot_capture import restore_loop

    tool = CountingTool().tool()
    loop_policies = (
        LoopPolicy(),
        SMALL_FLUSH,
        LoopPolicy(drafting=True),
        LoopPolicy(review_tool_calls=True),
    )
    turn_policies = (TurnPolicy(), TurnPolicy(max_key_attempts_per_model=2))
    compared = 0
    for snapshot in map(snapshot_from_json, corpus()):
        if snapshot.loop is not None:
            loop = snapshot.loop
            (policy,) = [p for p in loop_policies if policy_terms(p) == loop.policy_terms]
            registry = ToolRegistry([tool] if loop.tools else [])
            assert capture_loop(restore_loop(loop, policy, registry)) == loop
            compared += 1
        if snapshot.chain is not None:
            chain = snapshot.chain
            (turn_policy,) = [p for p in turn_policies if policy_terms(p) == chain.policy_terms]
            state = restore_chain(
                chain,
                turn_policy,
                plans=[AttemptPlan(label) for label in chain.labels],
                shared=(),
                tool_specs=(tool.spec(),) if chain.tools else (),
                now=chain.now,
            )
            again = capture_chain(state)
            assert [entry.health.cooldown_until for entry in again.health] == pytest.approx(
                [entry.health.cooldown_until for entry in chain.health]
            )
            assert attrs.evolve(again, health=chain.health) == chain
            compared += 1
    assert compared > len(corpus())  # every snapshot, and the chain and loop of some


# --------------------------------------------------------------------------- mutations
#: Stands for a value the mutation writes as raw text (nesting or numbers JSON cannot build).
_RAW = "\x00raw\x00"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (the root excluded), parents before children."""
    found: list[tuple[Any, ...]] = []
    children = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in children:
        found.append((*path, key))
        found.extend(_paths(child, (*path, key)))
    return found


def _at(document: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        document = document[key]
    return document


@st.composite
def mutated_snapshots(draw: st.DrawFn) -> tuple[str | bytes, str]:
    """A real snapshot's text, mutated one to three times, and the last mutation's name."""
    text = draw(st.sampled_from(corpus()))
    document = json.loads(text)
    raw: list[str] = []
    kind = "none"
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(document)
        if not paths:  # everything dropped already
            break
        path = draw(st.sampled_from(paths))
        parent, key = _at(document, path[:-1]), path[-1]
        value = parent[key]
        kind = draw(
            st.sampled_from(
                [
                    "drop",
                    "duplicate",
                    "retype",
                    "text for list",
                    "list for text",
                    "record moved",
                    "deep nesting",
                    "huge text",
                    "huge number",
                    "null",
                ]
            )
        )
        if kind == "drop":
            del parent[key]
        elif kind == "duplicate":
            if isinstance(parent, list):
                parent.insert(key, value)
            else:
                parent[draw(st.sampled_from([f"{key}_copy", "surprise", ""]))] = value
        elif kind == "retype":
            parent[key] = draw(json_values)
        elif kind == "text for list":
            parent[key] = draw(st.text(max_size=40)) if isinstance(value, list | dict) else [value]
        elif kind == "list for text":
            parent[key] = list(value) if isinstance(value, str) else [[value]]
        elif kind == "record moved":
            records = [p for p in paths if isinstance(_at(document, p), dict)] or [path]
            parent[key] = json.loads(json.dumps(_at(document, draw(st.sampled_from(records)))))
        elif kind == "null":
            parent[key] = None
        else:
            if kind == "deep nesting":
                depth = draw(st.sampled_from([63, 65, 1_000, 200_000]))
                opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
                inner = "1" if opener.startswith("{") else ""
                raw.append(opener * depth + inner + closer * depth)
            elif kind == "huge text":
                raw.append(json.dumps("é" * draw(st.sampled_from([10_000, 1_000_000]))))
            else:
                raw.append(draw(st.sampled_from(["1" * 5_000, "1e999", "-0", "1" * 4_000])))
            parent[key] = _RAW
    written = json.dumps(document, ensure_ascii=draw(st.booleans()))
    for piece in raw:
        written = written.replace(json.dumps(_RAW), piece, 1)
    damage = draw(st.sampled_from(["none", "none", "cut", "corrupt", "bytes", "bad bytes"]))
    if damage == "cut":
        written = written[: draw(st.integers(0, len(written)))]
    elif damage == "corrupt":
        at = draw(st.integers(0, len(written)))
        written = written[:at] + draw(st.sampled_from(list('[]{}",:\\\x00'))) + written[at:]
    elif damage in ("bytes", "bad bytes"):
        encoded = written.encode("utf-8", "surrogatepass")
        if damage == "bad bytes":
            at = draw(st.integers(0, len(encoded)))
            encoded = encoded[:at] + b"\xff\xfe" + encoded[at:]
        return encoded, f"{kind}, {damage}"
    return written, f"{kind}, {damage}"


def _read_or_refuse(case: tuple[str | bytes, str]) -> None:
    text, kind = case
    event(kind)
    try:
        snapshot = snapshot_from_json(text)
    except SnapshotError as err:
        event("refused")
        assert 0 < len(str(err)) <= MAX_SNAPSHOT_ERROR_CHARS
        return
    event("read")
    written = snapshot_to_json(snapshot)
    assert snapshot_to_json(snapshot_from_json(written)) == written


@settings(max_examples=_ci_examples())
@given(case=mutated_snapshots())
def test_a_mutated_real_snapshot_is_read_or_refused_with_a_bounded_snapshot_error(
    case: tuple[str | bytes, str],
) -> None:
    _read_or_refuse(case)


@pytest.mark.slow
@settings(max_examples=max(FUZZ_CAMPAIGN_EXAMPLES, _profile_examples()))
@given(case=mutated_snapshots())
def test_a_campaign_of_mutated_snapshots_never_gets_past_a_snapshot_error(
    case: tuple[str | bytes, str],
) -> None:
    _read_or_refuse(case)
