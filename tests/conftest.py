"""Hypothesis profiles for the whole test suite.

Two profiles are registered here:

``ci`` (the default, and always when the ``CI`` environment variable is set)
    Reproducible and bounded: ``derandomize=True`` (every run draws the same examples, so a
    red CI run is red on every machine), no example database (nothing carried between runs),
    ``deadline=None`` (a loaded CI box must not turn slowness into failures),
    ``print_blob=True`` (a failure prints the ``@reproduce_failure`` blob to replay it), and
    ``max_examples=500`` — the property suite (tests/test_properties_inner.py and
    tests/test_transition_coverage.py) then stays well under a minute on two cores. Tests
    that set their own ``max_examples`` keep it.

``explore``
    A long randomized hunt for new counterexamples: ``max_examples=5000``, a fresh random
    seed every run, the example database on (so failures found are replayed first next
    time), ``deadline=None``. Select it with ``HYPOTHESIS_PROFILE=explore pytest
    tests/test_properties_inner.py``.

``HYPOTHESIS_PROFILE`` picks a profile by name; when it is unset (on CI or anywhere else)
``ci`` is loaded.

The suite runs on every core (pytest-xdist, ``-n auto --dist loadfile`` in pyproject.toml);
each worker dies with the run's controller, as the processes it starts die with it
(`tests.processes`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any
from typing import Protocol

import pytest
from hypothesis import HealthCheck
from hypothesis import settings

from tests import processes
from tests.providers.wire_server import WireServer

#: Examples per property test under the ci profile (see the module docstring).
CI_MAX_EXAMPLES = 500
EXPLORE_MAX_EXAMPLES = 5000

settings.register_profile(
    "ci",
    max_examples=CI_MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    max_examples=EXPLORE_MAX_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# `CI` needs no special case: ci is what loads unless a profile is named explicitly.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the summaries tests recorded (``record_property("…_summary", text)``): the crash
    campaign's counts, whichever xdist worker ran it."""
    for outcome in ("passed", "failed"):
        for report in terminalreporter.getreports(outcome):
            for name, value in getattr(report, "user_properties", ()):
                if name.endswith("_summary"):
                    terminalreporter.write_sep("-", name.removesuffix("_summary"))
                    terminalreporter.write_line(str(value))


class _XdistWorker(Protocol):  # what these hooks read of xdist's WorkerController
    workerinput: dict[str, Any]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: known only with xdist loaded
def pytest_configure_node(node: _XdistWorker) -> None:
    """Each xdist worker is told the controller's pid, to die with it (`tests.processes`)."""
    processes.hand_over_the_run(node.workerinput)


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker
        processes.die_with_the_run(workerinput)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default run): one worker more than the machine has cores. A third of
    the suite waits on real servers and subprocesses (the Temporal dev server's heartbeat
    timeouts, LiteLLM's start, worker processes killed and restarted) rather than computing,
    so a worker beyond the cores keeps them busy while another waits: on two cores, three
    workers run the suite in 340 s where two take 370 s."""
    del config
    return (os.cpu_count() or 1) + 1


@pytest.fixture
async def wire_server() -> AsyncIterator[WireServer]:
    """A loopback HTTP server a test scripts byte by byte (`tests.providers.wire_server`)."""
    server = WireServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()
