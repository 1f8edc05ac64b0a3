"""The usage estimate of passes without a usage report (docs/behaviour.md §2.2 rule 3): close
to the real token counts of English, CJK, emoji and code (tests/data/token_counts.json), and,
over long turns, each pass's input estimate is what its whole request carried, however the
request grew or was rewritten (tool rounds, context restarts, a revision's cleared
narration, a resumed turn, a tool set that shrinks), and a turn measures each history entry
and each tool schema once, not once a pass. Time is virtual (`VirtualClock`)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from tests.inner_kit import succeeds
from toolloop_fsm import ContextRestart
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import run_tool_loop
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.result import token_weight
from toolloop_fsm.result import tokens_of_weight
from toolloop_fsm.review import Finding
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.snapshot import snapshot_from_json
from toolloop_fsm.snapshot import snapshot_to_json
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing.reviewer import ScriptedReviewer
from toolloop_fsm.turn import canonical_call_key

LONG = LoopPolicy(max_function_call_iterations=200)


# --------------------------------------------------------------------------- real counts
#: sample texts and their real o200k_base token counts (the file's note says how they were
#: counted)
SAMPLES = json.loads(
    (Path(__file__).parent / "data" / "token_counts.json").read_text(encoding="utf-8")
)["samples"]
SAMPLE = {sample["name"]: sample for sample in SAMPLES}
#: how far the estimate may be from a real count, either way
TOLERANCE = 0.25


def _near(estimate: int, real: int) -> bool:
    return (1 - TOLERANCE) * real <= estimate <= (1 + TOLERANCE) * real


@pytest.mark.parametrize("sample", SAMPLES, ids=[sample["name"] for sample in SAMPLES])
def test_the_estimate_is_within_a_quarter_of_the_real_token_count(sample: dict[str, Any]) -> None:
    estimate = estimate_tokens(sample["text"])
    assert _near(estimate, sample["tokens"]), (
        f"{sample['name']}: estimated {estimate} tokens, the tokenizer counts {sample['tokens']}"
    )


@pytest.mark.parametrize("name", ["chinese_prose", "japanese_prose", "korean_prose", "emoji_only"])
def test_cjk_and_emoji_are_not_counted_at_four_characters_a_token(name: str) -> None:
    # what the estimate was before: a quarter of the characters, a third or less of the truth
    text, real = SAMPLE[name]["text"], SAMPLE[name]["tokens"]
    assert math.ceil(len(text) / 4) * 2.5 < real
    assert _near(estimate_tokens(text), real)


@given(st.text(), st.lists(st.integers(min_value=0)))
def test_the_weights_of_a_texts_pieces_add_up_to_the_weight_of_the_whole(
    text: str, cuts: list[int]
) -> None:
    points = sorted({cut % (len(text) + 1) for cut in cuts} | {0, len(text)})
    pieces = [text[start:end] for start, end in itertools.pairwise(points)]
    assert sum(map(token_weight, pieces)) == token_weight(text)


def test_a_lone_surrogate_is_weighed_not_refused() -> None:
    # JSON may carry one ("\ud83d" alone): text from outside is weighed whatever it holds
    assert estimate_tokens("\ud83d") >= 1


async def test_a_japanese_answer_without_a_usage_report_is_estimated_near_its_real_count() -> None:
    sample = SAMPLE["japanese_prose"]
    text: str = sample["text"]
    chunks = [TextDelta(text[i : i + 3]) for i in range(0, len(text), 3)]
    turn = scripted_turn([chunks])
    result = await run_turn(turn, [])
    assert result.status is TurnStatus.COMPLETED
    (entry,) = result.usage.entries
    assert entry.estimated
    assert entry.output_tokens == estimate_tokens(text)
    assert _near(entry.output_tokens, sample["tokens"])


# --------------------------------------------------------------------------- the oracle
def full_read_weight(request: ProviderRequest) -> int:
    """What a request gives the model to read, weighed afresh over the whole request: the
    estimate's rule as the engine computed it on every pass before it kept running counts."""
    read = token_weight(request.prefill or "")
    for message in request.context:
        read += _content_weight(message.get("content"))
    for entry in request.history:
        response = entry.response
        read += token_weight(entry.pre_tool_text or "")
        read += token_weight(canonical_call_key(entry.call.name, entry.call.arguments))
        read += token_weight(_json_text([response.data, response.message, response.reason]))
    for tool in request.tools:
        read += token_weight(tool.name) + token_weight(tool.description)
        read += token_weight(_json_text(tool.parameters))
    return read


def _content_weight(content: Any) -> int:
    if isinstance(content, str):
        return token_weight(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += token_weight(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += token_weight(part["text"])
        return total
    return 0


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


def assert_each_estimate_read_its_whole_request(
    result: GenerationTurnResult, requests: Sequence[ProviderRequest], first_pass: int = 1
) -> None:
    """Every pass's ledger entry is a marked estimate whose input is the estimate of its whole
    request (``first_pass``: the pass number of ``requests[0]``)."""
    entries = [entry for entry in result.usage.entries if entry.iteration >= first_pass]
    assert len(entries) == len(requests)
    for entry, request in zip(entries, requests, strict=True):
        assert entry.estimated
        assert entry.input_tokens == tokens_of_weight(full_read_weight(request)), (
            f"pass {entry.iteration}"
        )


# --------------------------------------------------------------------------- same estimates
async def test_a_long_turn_with_context_restarts_estimates_every_pass_from_its_whole_request() -> (
    None
):
    # 60 rounds; every tenth call restarts the context (a message appended to it, no history
    # entry); the memory tool, once it succeeds, is no longer offered (the tool set shrinks)
    passes: list[list[ScriptItem]] = []
    for i in range(60):
        name = "watch" if i % 10 == 9 else "update_short_term_memory" if i == 30 else "lookup"
        passes.append([TextDelta(f"step {i}. "), FunctionCall(name, {"q": f"x{i}", "n": i})])
    passes.append([ThoughtDelta("done"), TextDelta("All done.")])
    turn = scripted_turn(passes)
    restart = ContextRestart({"role": "system", "content": [{"type": "text", "text": "more"}]})
    tools = [
        make_tool("lookup", turn.executions, turn.clock),
        make_tool("watch", turn.executions, turn.clock, succeeds(context_restart=restart)),
        make_tool("update_short_term_memory", turn.executions, turn.clock),
    ]
    # the memory tool is followed up (left out of the suppress set): after its visible text
    # it would otherwise end the turn at once (docs/behaviour.md §4.6)
    policy = attrs.evolve(LONG, suppress_followup_after_pre_tool_text=())
    result = await run_turn(turn, tools, policy=policy)
    assert result.status is TurnStatus.COMPLETED
    requests = turn.provider.requests
    assert len(requests) == 61
    assert len(requests[-1].history) == 54  # the six restarts left no history entry
    assert len(requests[-1].context) == 7
    assert len(requests[-1].tools) == 2  # the memory tool stopped being offered
    assert_each_estimate_read_its_whole_request(result, requests)


async def test_messages_without_text_add_nothing_to_the_estimate() -> None:
    # a host's context carries the model's earlier messages without text (``content`` None)
    # and image-only parts: they give the model no text to read, so they add nothing (a
    # tool call must be followed by its response: `TurnRequest` refuses one that is not)
    tool_call_message: dict[str, Any] = {"role": "assistant", "content": None}
    image: dict[str, Any] = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "x"}}],
    }
    go_on: dict[str, Any] = {"role": "user", "content": "go on"}
    context = [*USER, *[tool_call_message] * 8, image, go_on]
    turn = scripted_turn([[FunctionCall("lookup", {"q": "x"})], [TextDelta("Done.")]])
    tools = [make_tool("lookup", turn.executions, turn.clock)]

    result = await run_turn(turn, tools, policy=LONG, request=TurnRequest(context))

    assert result.status is TurnStatus.COMPLETED
    assert_each_estimate_read_its_whole_request(result, turn.provider.requests)
    assert full_read_weight(turn.provider.requests[0]) == full_read_weight(
        attrs.evolve(turn.provider.requests[0], context=(*USER, go_on))
    )


async def test_an_estimate_after_a_revision_reads_the_history_without_the_cleared_narration() -> (
    None
):
    passes: list[list[ScriptItem]] = [
        [TextDelta(f"Checking {i}. "), FunctionCall("lookup", {"city": f"c{i}"})] for i in range(8)
    ]
    passes += [
        [TextDelta("21 degrees.")],
        [FunctionCall("lookup", {"city": "c0"})],  # the replacement: reused from the ledger
        [TextDelta("It's a lovely 21 °C everywhere!")],
    ]
    turn = scripted_turn(passes)
    reviewer = ScriptedReviewer(
        [Revise([Finding("voice", "flat", "warmer")]), Pass()], clock=turn.clock
    )
    result = await run_tool_loop(
        turn.provider,
        [make_tool("lookup", turn.executions, turn.clock)],
        turn.channel,
        TurnRequest(USER),
        policy=LoopPolicy(drafting=True),
        clock=turn.clock,
        reviewer=reviewer,
    )
    assert result.reason == "draft_passed"
    requests = turn.provider.requests
    # the revision rewrote every history entry (narration cleared) and added an instruction
    assert requests[8].history[0].pre_tool_text == "Checking 0. "
    assert all(entry.pre_tool_text is None for entry in requests[9].history)
    assert len(requests[9].context) == len(requests[8].context) + 1
    authors = [entry for entry in result.usage.entries if entry.source == "author"]
    assert len(authors) == len(requests)
    for entry, request in zip(authors, requests, strict=True):
        assert entry.input_tokens == tokens_of_weight(full_read_weight(request))


async def test_a_resumed_turn_estimates_its_passes_from_the_whole_history_it_resumed_with() -> None:
    clock = VirtualClock()
    executions = Executions()
    passes: list[list[ScriptItem]] = [
        [TextDelta(f"r{i} "), FunctionCall("lookup", {"q": i})] for i in range(12)
    ]
    passes.append([TextDelta("Done.")])
    saved: list[TurnSnapshot] = []
    tool = make_tool("lookup", executions, clock)
    await run_tool_loop(
        ScriptedProvider(passes, clock=clock),
        [tool],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        policy=LONG,
        clock=clock,
        on_snapshot=saved.append,
    )
    snapshot = snapshot_from_json(snapshot_to_json(saved[7]))  # 7 rounds in, before pass 8
    assert snapshot.loop is not None and len(snapshot.loop.history or ()) == 7
    provider = ScriptedProvider(passes[7:], clock=clock)
    resumed = await resume_tool_loop(
        snapshot, provider, [tool], RecordingChannel(clock=clock), policy=LONG, clock=clock
    )
    assert resumed.status is TurnStatus.COMPLETED
    assert_each_estimate_read_its_whole_request(resumed, provider.requests, first_pass=8)


# --------------------------------------------------------------------------- linear work
class Measured:
    """A value that is not JSON: the estimate writes it as its ``str``, so each ``str`` of
    it is one time the estimate measured the tool result holding it."""

    def __init__(self) -> None:
        self.measured = 0

    def __str__(self) -> str:
        self.measured += 1
        return "measured"


class MeasuredSchema(dict[str, Any]):
    """A tool's parameters that count each time they are written as JSON (the encoder asks a
    dict subclass for its items). The count starts once the tool is built (building it
    checks the schema)."""

    measured = 0

    def items(self) -> Any:
        self.measured += 1
        return super().items()


def counting_tool(name: str, in_results: Measured, schema: MeasuredSchema) -> Tool:
    async def lookup(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"q": arguments.get("q"), "seen": in_results})

    schema["type"] = "object"
    tool = Tool(name, "looks up", schema, lookup)
    schema.measured = 0
    return tool


async def _long_turn(rounds: int, in_results: Measured, in_schema: MeasuredSchema) -> None:
    passes: list[list[ScriptItem]] = [
        [TextDelta("."), FunctionCall("lookup", {"q": i})] for i in range(rounds)
    ]
    turn = scripted_turn([*passes, [TextDelta("Done.")]])
    result = await run_turn(turn, [counting_tool("lookup", in_results, in_schema)], policy=LONG)
    assert result.status is TurnStatus.COMPLETED
    assert len(result.usage.entries) == rounds + 1 and result.usage.has_estimates


async def test_a_99_round_turn_without_usage_reports_measures_each_tool_result_once() -> None:
    results_measured: dict[int, int] = {}
    schemas_measured: dict[int, int] = {}
    for rounds in (10, 99):
        in_results, in_schema = Measured(), MeasuredSchema()
        await _long_turn(rounds, in_results, in_schema)
        results_measured[rounds] = in_results.measured
        schemas_measured[rounds] = in_schema.measured
    # each result once, when the first request carries it (not again in each later pass)
    assert results_measured == {10: 10, 99: 99}
    assert schemas_measured == {10: 1, 99: 1}  # the tool set never changed


async def test_a_tool_set_that_shrinks_mid_turn_has_its_schemas_measured_once_per_set() -> None:
    in_results, lookup_schema, memory_schema = Measured(), MeasuredSchema(), MeasuredSchema()
    passes: list[list[ScriptItem]] = [
        [FunctionCall("update_short_term_memory" if i == 5 else "lookup", {"q": i})]
        for i in range(20)
    ]
    turn = scripted_turn([*passes, [TextDelta("Done.")]])
    tools = [
        counting_tool("lookup", in_results, lookup_schema),
        counting_tool("update_short_term_memory", Measured(), memory_schema),
    ]
    result = await run_turn(turn, tools, policy=LONG)
    assert result.status is TurnStatus.COMPLETED
    assert len(turn.provider.requests[-1].tools) == 1  # the memory tool is no longer offered
    assert (lookup_schema.measured, memory_schema.measured) == (2, 1)


async def test_a_tool_result_changed_after_it_was_returned_is_estimated_as_first_sent() -> None:
    # a tool that hands out one list and keeps appending to it, against one that hands out
    # a copy each time: each result is measured as the first request carrying it showed it
    async def estimates(copies: bool) -> list[int]:
        seen: list[str] = []

        async def lookup(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
            seen.append(f"result {arguments['q']} " * 20)
            return ToolResult(data=list(seen) if copies else seen)

        passes: list[list[ScriptItem]] = [[FunctionCall("lookup", {"q": i})] for i in range(6)]
        turn = scripted_turn([*passes, [TextDelta("Done.")]])
        tool = Tool("lookup", "looks up", {"type": "object"}, lookup)
        result = await run_turn(turn, [tool], policy=LONG)
        assert result.status is TurnStatus.COMPLETED
        return [entry.input_tokens for entry in result.usage.entries]

    assert await estimates(copies=False) == await estimates(copies=True)
