"""Policies for the `toolloop-fsm fuzz` CLI tests (tests/test_cli.py).

`BROKEN` is a deliberately broken policy: its custom exit rule ("end the turn when the text
before the tool has a second word that ends a sentence") indexes the second word of the
pre-tool text, so it raises `IndexError` on one-word text — a guard that breaks the turn. The
fuzzer must find that, shrink it and report it. `make_broken` is the same policy behind a
factory, the other form ``--policy`` accepts.
"""

from __future__ import annotations

from toolloop_fsm.policy import ExitView
from toolloop_fsm.policy import LoopPolicy


def second_word_ends_sentence(view: ExitView) -> bool:
    """Broken on purpose: assumes the pre-tool text always has at least two words."""
    text = view.pre_tool_text or ""
    return text.split()[1].endswith(".")


BROKEN = LoopPolicy(end_after_pre_tool_text=second_word_ends_sentence)


def make_broken() -> LoopPolicy:
    return LoopPolicy(end_after_pre_tool_text=second_word_ends_sentence)


def wait_for_ever(view: ExitView) -> bool:
    """Hangs on purpose: a custom exit rule that never returns (a busy loop, so that no
    asyncio timeout can interrupt it)."""
    while True:
        pass


HANGS = LoopPolicy(end_after_pre_tool_text=wait_for_ever)
