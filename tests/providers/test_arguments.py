"""Tool-call argument decoding: complete, truncated (repaired, never invented), malformed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm.providers._arguments import decode_arguments

COMPLETE = [
    ('{"city": "Paris"}', {"city": "Paris"}),
    ('  {"a": [1, 2.5, -3e2, true, false, null]}  ', {"a": [1, 2.5, -300.0, True, False, None]}),
    ('{"s": "quote \\" slash \\\\ \\u00e9 \\ud83c\\udf0d"}', {"s": 'quote " slash \\ é 🌍'}),
    ("{}", {}),
    ('{"nested": {"deep": {"x": []}}}', {"nested": {"deep": {"x": []}}}),
]


@pytest.mark.parametrize(("text", "expected"), COMPLETE)
@pytest.mark.parametrize("cut", [False, True])
def test_complete_json_is_taken_as_is(text: str, expected: Any, cut: bool) -> None:
    assert decode_arguments(text, cut=cut) == (expected, False, None)


def test_blank_means_no_arguments_unless_cut() -> None:
    assert decode_arguments("", cut=False) == ({}, False, None)
    assert decode_arguments("  \n", cut=False) == ({}, False, None)
    assert decode_arguments("", cut=True) == ({}, True, None)


TRUNCATED = [
    # (cut-off text, repaired value): only the incomplete tail is dropped
    ("{", {}),
    ('{"', {}),
    ('{"ci', {}),
    ('{"city"', {}),
    ('{"city":', {}),
    ('{"city": ', {}),
    ('{"city": "Edinb', {}),
    ('{"city": "Edinburgh"', {"city": "Edinburgh"}),
    ('{"city": "Edinburgh",', {"city": "Edinburgh"}),
    ('{"city": "Edinburgh", "u', {"city": "Edinburgh"}),
    ('{"city": "Edinburgh", "units": "c', {"city": "Edinburgh"}),
    ('{"n": 12', {}),  # the number could have gone on: 123
    ('{"n": 12,', {"n": 12}),
    ('{"n": 12 ', {"n": 12}),
    ('{"n": -', {}),
    ('{"n": 1.', {}),
    ('{"n": 1.5e', {}),
    ('{"b": tr', {}),
    ('{"b": true', {"b": True}),
    ('{"b": null, "c": fal', {"b": None}),
    ('{"a": {"b": 1, "c', {"a": {"b": 1}}),
    ('{"a": {"b": 1, "c": [1, 2', {"a": {"b": 1, "c": [1]}}),
    ('{"a": {"b": 1, "c": [1, 2]', {"a": {"b": 1, "c": [1, 2]}}),
    ('{"a": [', {"a": []}),
    ('{"a": [{"x": "y"}, {"x": "z', {"a": [{"x": "y"}, {}]}),
    ('{"s": "escape \\', {}),
    ('{"s": "unicode \\u00', {}),
    ('{"s": "done", "t": "\\ud83c', {"s": "done"}),
    # the real max_tokens capture (anthropic__max-tokens-truncated-tool-json-padded.sse)
    (
        '{"city": "San Francisco", "state": "CA", "country": "United',
        {"city": "San Francisco", "state": "CA"},
    ),
    # the real finish-length capture (openai-chat__finish-length.sse) as arguments
    ('{"city":"San Francisco","temperature":63,"units":"f"', None),
]


@pytest.mark.parametrize(("text", "expected"), TRUNCATED)
@pytest.mark.parametrize("cut", [False, True])
def test_cut_off_json_is_repaired_by_dropping_the_tail(text: str, expected: Any, cut: bool) -> None:
    if expected is None:
        expected = json.loads(text + "}")
    assert decode_arguments(text, cut=cut) == (expected, True, None)


MALFORMED = [
    '{"a": nope}',
    '{"a": nope',
    '{"a": 1} trailing',
    '{"a": 1}}',
    '{"a" 1}',
    "{'a': 1}",
    '{"a": 01}',
    '{"a": "bad \\x escape"}',
    '{"a": "bad \\x',
    '{"a": 1,,',
    '{"a": 1 "b": 2',
    '{"a": [1 2',
    "not json",
    '{"a": "raw\ncontrol"}',
    '{"a": -x',
]


@pytest.mark.parametrize("text", MALFORMED)
@pytest.mark.parametrize("cut", [False, True])
def test_malformed_json_reports_the_json_error_and_keeps_raw_text(text: str, cut: bool) -> None:
    arguments, truncated, error = decode_arguments(text, cut=cut)
    assert (arguments, truncated) == (text, False)
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    assert error == str(expected.value)


def test_a_prefix_that_parses_is_not_mistaken_for_the_whole_call() -> None:
    # "12" parses as JSON, but as arguments text it is only the start of "123": the caller
    # decodes at the end, and a bare number is never an object the loop would run.
    assert decode_arguments('{"n": 12', cut=True) == ({}, True, None)


# ----------------------------------------------------------------------------- property
def _is_sub_object(part: Any, whole: Any) -> bool:
    """``part`` keeps a subset of ``whole``'s keys / a prefix of its items, recursively."""
    if isinstance(whole, dict):
        return isinstance(part, dict) and all(
            key in whole and _is_sub_object(value, whole[key]) for key, value in part.items()
        )
    if isinstance(whole, list):
        return (
            isinstance(part, list)
            and len(part) <= len(whole)
            and all(_is_sub_object(p, w) for p, w in zip(part, whole, strict=False))
        )
    return part == whole and type(part) is type(whole)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_objects = st.dictionaries(st.text(max_size=6), _json_values, max_size=5)


@settings(max_examples=100, deadline=None)
@given(
    obj=_objects,
    style=st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}]),
    data=st.data(),
)
def test_every_strict_prefix_is_truncated_and_invents_nothing(
    obj: dict[str, Any], style: dict[str, Any], data: st.DataObject
) -> None:
    text = json.dumps(obj, **style)
    assert decode_arguments(text, cut=True) == (obj, False, None)
    positions = data.draw(
        st.lists(st.integers(0, len(text) - 1), min_size=1, max_size=12, unique=True)
    )
    for position in positions:
        arguments, truncated, error = decode_arguments(text[:position], cut=True)
        assert error is None, (text[:position], error)
        assert truncated is True
        assert _is_sub_object(arguments, obj), (text[:position], arguments)
