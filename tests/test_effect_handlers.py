"""The effect-handler contract: a table missing a handler for an effect class of its tier, or
holding one for a class the tier never emits, is refused as it is built, naming the classes;
the tiers together cover every `Effect` class (each shell's own table is checked in
tests/test_shell_tables.py)."""

from __future__ import annotations

import typing

import pytest

from toolloop_fsm.effect_handlers import INNER_EFFECTS
from toolloop_fsm.effect_handlers import OUTER_EFFECTS
from toolloop_fsm.effect_handlers import EffectHandlers
from toolloop_fsm.effect_handlers import ShellEffectHandlers
from toolloop_fsm.effect_handlers import handled
from toolloop_fsm.effect_handlers import handled_by
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import StartAttempt


def test_the_two_tiers_cover_every_effect_class() -> None:
    assert set(INNER_EFFECTS) | set(OUTER_EFFECTS) == set(typing.get_args(Effect))


def test_a_table_missing_a_handler_is_refused_naming_the_classes() -> None:
    entries = [handled(cls, lambda effect: None) for cls in INNER_EFFECTS if cls is not Deliver]
    with pytest.raises(TypeError, match=r"^the test shell has no handler for Deliver$"):
        EffectHandlers("the test shell", INNER_EFFECTS, entries)


def test_a_table_with_a_handler_its_tier_never_emits_is_refused() -> None:
    entries = [handled(cls, lambda effect: None) for cls in INNER_EFFECTS]
    entries.append(handled(StartAttempt, lambda effect: None))
    with pytest.raises(TypeError, match=r"handlers for StartAttempt, which its tier never"):
        EffectHandlers("the test shell", INNER_EFFECTS, entries)


def test_a_table_carries_out_each_effect_by_its_own_handler() -> None:
    done: list[str] = []

    def note(effect: object) -> None:
        done.append(type(effect).__name__)

    entries = [handled(cls, note) for cls in OUTER_EFFECTS]
    table = EffectHandlers("the test shell", OUTER_EFFECTS, entries)
    table(Finish(result=typing.cast(typing.Any, None)))
    assert done == ["Finish"]
    assert table.handles() == frozenset(OUTER_EFFECTS)


def test_a_shell_class_table_missing_a_handler_is_refused_naming_the_classes() -> None:
    def note(shell: list[str], effect: object) -> None:
        shell.append(type(effect).__name__)

    entries = [handled_by(cls, note) for cls in OUTER_EFFECTS if cls is not StartAttempt]
    with pytest.raises(TypeError, match=r"^the test shell has no handler for StartAttempt$"):
        ShellEffectHandlers("the test shell", OUTER_EFFECTS, entries)


def test_a_shell_class_table_carries_out_each_effect_by_the_shell_it_is_given() -> None:
    def note(shell: list[str], effect: object) -> None:
        shell.append(type(effect).__name__)

    table = ShellEffectHandlers[list[str], None](
        "the test shell", OUTER_EFFECTS, [handled_by(cls, note) for cls in OUTER_EFFECTS]
    )
    first: list[str] = []
    second: list[str] = []
    table(first, Finish(result=typing.cast(typing.Any, None)))
    assert (first, second) == (["Finish"], [])
    assert table.handles() == frozenset(OUTER_EFFECTS)
