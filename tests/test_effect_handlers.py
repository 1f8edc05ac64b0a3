"""The effect-handler contract: each tier's protocol names one method per effect class its
machine emits, after the class; a shell that leaves one out is refused as its table is built,
naming the classes; the tiers together cover every `Effect` class (each shell's own table is
checked in tests/test_shell_tables.py)."""

from __future__ import annotations

import re
import typing
from collections.abc import Callable

import pytest

from toolloop_fsm.effect_handlers import INNER_EFFECTS
from toolloop_fsm.effect_handlers import OUTER_EFFECTS
from toolloop_fsm.effect_handlers import EffectHandlers
from toolloop_fsm.effect_handlers import InnerEffectShell
from toolloop_fsm.effect_handlers import OuterEffectShell
from toolloop_fsm.effect_handlers import ShellEffectHandlers
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartAttempt


def _method_name(effect_class: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", effect_class.__name__).lower()


def _noting(done: list[str]) -> Callable[[object, object], None]:
    def note(shell: object, effect: object) -> None:
        done.append(type(effect).__name__)

    return note


def _shell_class(
    protocol: type, tier: tuple[type, ...], done: list[str], *, leaving_out: type | None = None
) -> type:
    """A shell of ``protocol`` whose every method notes the effect it was given in ``done``,
    except the one of ``leaving_out``."""
    methods = {_method_name(cls): _noting(done) for cls in tier if cls is not leaving_out}
    return type("TestShell", (protocol,), methods)


def test_the_two_tiers_cover_every_effect_class() -> None:
    assert set(INNER_EFFECTS) | set(OUTER_EFFECTS) == set(typing.get_args(Effect))


@pytest.mark.parametrize(
    ("protocol", "tier"),
    [(InnerEffectShell, INNER_EFFECTS), (OuterEffectShell, OUTER_EFFECTS)],
    ids=["inner", "outer"],
)
def test_each_method_of_a_tier_is_named_after_the_effect_class_it_takes(
    protocol: type, tier: tuple[type, ...]
) -> None:
    for effect_class in tier:
        method = getattr(protocol, _method_name(effect_class))
        assert typing.get_type_hints(method)["effect"] is effect_class


def test_a_shell_class_missing_a_handler_is_refused_naming_the_class() -> None:
    shell_class = _shell_class(InnerEffectShell, INNER_EFFECTS, [], leaving_out=Deliver)
    with pytest.raises(TypeError, match=r"^TestShell has no handler for Deliver$"):
        ShellEffectHandlers(shell_class)


def test_a_shell_missing_handlers_is_refused_naming_every_class() -> None:
    shell_class = _shell_class(OuterEffectShell, OUTER_EFFECTS, [], leaving_out=StartAttempt)
    without_finish = type("TestShell", (shell_class,), {"finish": OuterEffectShell.finish})
    with pytest.raises(
        TypeError, match=r"^the test shell has no handler for Finish, StartAttempt$"
    ):
        EffectHandlers("the test shell", without_finish())


def test_a_shell_of_neither_tier_is_refused() -> None:
    with pytest.raises(TypeError, match="subclasses neither of InnerEffectShell and Outer"):
        ShellEffectHandlers(list)


def test_a_table_carries_out_each_effect_by_the_shells_own_method() -> None:
    done: list[str] = []
    shell = _shell_class(OuterEffectShell, OUTER_EFFECTS, done)()
    table: EffectHandlers[None] = EffectHandlers("the test shell", shell)
    table(Finish(result=typing.cast(typing.Any, None)))
    assert done == ["Finish"]
    assert table.handles() == frozenset(OUTER_EFFECTS)


def test_a_shell_class_table_carries_out_each_effect_by_the_shell_it_is_given() -> None:
    done: list[str] = []
    shell_class = _shell_class(InnerEffectShell, INNER_EFFECTS, done)
    table: ShellEffectHandlers[object, None] = ShellEffectHandlers(shell_class)
    table(shell_class(), RunTool(1, "lookup", {}, "lookup:{}"))
    assert done == ["RunTool"]
    assert table.handles() == frozenset(INNER_EFFECTS)
