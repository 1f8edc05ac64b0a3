"""The test kit's surface as a host's tests use it: the names `toolloop_fsm.testing` serves
(the Hypothesis ones imported on first use), how its channels confirm, refuse and drop
deliveries, and the harnesses' capture of the library's log."""

from __future__ import annotations

import asyncio
import importlib
import logging
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path

import pytest

import toolloop_fsm.testing as kit
from toolloop_fsm.testing import ChannelAct
from toolloop_fsm.testing import HostileChannel
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import Stragglers
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing._lazy_names import LAZY_MODULES
from toolloop_fsm.testing.harness import LibraryLogCapture

PACKAGE_ROOT = Path(kit.__file__).parents[2]


def test_every_name_the_kit_lists_is_the_object_its_module_serves() -> None:
    assert len(kit.__all__) == len(set(kit.__all__))
    for module_name, names in LAZY_MODULES.items():
        module = importlib.import_module(f"toolloop_fsm.testing.{module_name}")
        for name in names:
            assert name in module.__all__, (module_name, name)
            assert getattr(kit, name) is getattr(module, name), (module_name, name)
            assert name in kit.__all__, name
    assert {name for name in kit.__all__ if not hasattr(kit, name)} == set()


def test_importing_the_kit_and_asking_for_a_missing_name_load_no_hypothesis() -> None:
    code = (
        "import sys, toolloop_fsm.testing as kit\n"
        "try:\n    kit.no_such_name\nexcept AttributeError as err:\n    print(err)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hypothesis'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE_ROOT
    ).stdout.splitlines()
    assert out == ["module 'toolloop_fsm.testing' has no attribute 'no_such_name'", "[]"]


def _refuse_all(_text: str | None, _expression: str | None) -> bool:
    return True


def _hostile(
    clock: VirtualClock,
    *,
    sends: Sequence[ChannelAct] = (),
    fail_when: Callable[[str | None, str | None], bool] | None = None,
) -> HostileChannel:
    return HostileChannel(
        clock=clock,
        host_call_timeout=1.0,
        stragglers=Stragglers(),
        sends=sends,
        fail_when=fail_when,
    )


@pytest.mark.parametrize("kind", ["recording", "hostile"])
def test_a_refused_delivery_says_whether_a_message_or_an_expression_was_refused(
    kind: str,
) -> None:
    clock = VirtualClock()
    channel = (
        RecordingChannel(clock=clock, fail_when=_refuse_all)
        if kind == "recording"
        else _hostile(clock, fail_when=_refuse_all)
    )

    async def deliver() -> list[str]:
        refusals = []
        for send in (channel.send_text("hi"), channel.send_expression("smile")):
            with pytest.raises(ConnectionError) as refused:
                await send
            refusals.append(str(refused.value))
        return refusals

    assert asyncio.run(deliver()) == [
        "the channel refused the message",
        "the channel refused the expression",
    ]
    assert channel.delivered == []


@pytest.mark.parametrize("kind", ["recording", "hostile"])
def test_a_delivery_whose_key_was_accepted_is_confirmed_but_shown_once(kind: str) -> None:
    clock = VirtualClock()
    channel = RecordingChannel(clock=clock) if kind == "recording" else _hostile(clock)

    async def deliver() -> None:
        await channel.send_text("Hello. ", idempotency_key="k1")
        await channel.send_expression("wave", idempotency_key="k2")
        await channel.send_text("Hello. ", idempotency_key="k1")
        await channel.send_text("Bye.")

    asyncio.run(deliver())
    assert [(d.seq, d.text, d.expression) for d in channel.delivered] == [
        (0, "Hello. ", None),
        (1, None, "wave"),
        (2, "Bye.", None),
    ]
    assert channel.duplicates_dropped == 1
    assert channel.text == channel.delivered_text == "Hello. Bye."
    assert channel.expressions == ["wave"]


def test_a_hostile_send_that_raises_records_nothing_and_the_next_one_is_recorded() -> None:
    clock = VirtualClock()
    channel = _hostile(clock, sends=(ChannelAct.RAISE, ChannelAct.CONFIRM))

    async def deliver() -> None:
        with pytest.raises(ConnectionError, match="the channel refused send_text"):
            await channel.send_text("lost")
        await channel.send_expression("nod", idempotency_key="k")

    asyncio.run(deliver())
    assert [(d.seq, d.text, d.expression) for d in channel.delivered] == [(0, None, "nod")]
    assert [(call.method, call.outcome) for call in channel.calls] == [
        ("send_text", "raised"),
        ("send_expression", "confirmed"),
    ]


def test_the_library_log_is_captured_with_exception_text_and_the_logger_restored() -> None:
    library = logging.getLogger("toolloop_fsm")
    handlers = list(library.handlers)
    previous = library.level
    library.setLevel(logging.WARNING)
    try:
        capture = LibraryLogCapture()
        capture.attach()
        logging.getLogger("toolloop_fsm.pump").debug("asked sk-test-1 for a pass")
        try:
            raise ValueError("sk-test-2 refused")
        except ValueError:
            logging.getLogger("toolloop_fsm").exception("the provider failed")
        capture.detach()
        logging.getLogger("toolloop_fsm").warning("after the run")
        assert "asked sk-test-1 for a pass" in capture.text
        assert "ValueError: sk-test-2 refused" in capture.text
        assert "after the run" not in capture.text
        assert library.level == logging.WARNING
        assert library.handlers == handlers
    finally:
        library.setLevel(previous)
