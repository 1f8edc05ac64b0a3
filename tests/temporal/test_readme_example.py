"""The README's Temporal example runs as written: against this suite's dev server (for
``temporal server start-dev``'s 127.0.0.1:7233) and ``toolloop-fsm serve`` (for its
127.0.0.1:8765). It runs five times, each in a process of its own that must exit 0: a
Temporal client process that shuts down in the wrong order can abort at exit (``Fatal Python
error: PyGILState_Release``, temporalio/sdk-python#300) after printing the whole answer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import readme_example
from tests.serving import run_example
from tests.serving import serving

ROOT = Path(__file__).resolve().parents[2]
RUNS = 5

#: Appended to the example: what is left, once it has run, for Python's own exit to free.
LEFT_FOR_EXIT = """
import gc as _gc
import temporalio.bridge.client
import temporalio.client
import temporalio.worker
_kinds = (temporalio.client.Client, temporalio.bridge.client.Client, temporalio.worker.Worker)
_left = {f"{type(o).__module__}.{type(o).__qualname__}" for o in _gc.get_objects()
         if isinstance(o, _kinds)}
print("left for exit:", sorted(_left))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    with serving(ROOT, _env()) as url:
        yield url


def _example(temporal_address: str, served: str) -> str:
    example = readme_example(ROOT, "### On Temporal")
    assert '"127.0.0.1:7233"' in example and "http://127.0.0.1:8765/v1" in example
    source = example.replace("127.0.0.1:7233", temporal_address)
    return source.replace("http://127.0.0.1:8765/v1", served)


@pytest.mark.parametrize("run", range(1, RUNS + 1))
def test_the_readme_temporal_example_completes_and_exits_cleanly(
    run: int, temporal_address: str, served: str, tmp_path: Path
) -> None:
    proc = run_example(_example(temporal_address, served), tmp_path, _env())
    assert "Fatal Python error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "°C" in proc.stdout  # the model's answer reached the example's channel
    assert " completed pre_tool_text_suffices" in proc.stdout, proc.stdout


def test_the_readme_temporal_example_leaves_no_temporal_client_for_pythons_exit(
    temporal_address: str, served: str, tmp_path: Path
) -> None:
    # what the abort at exit comes from: Temporal's Rust core freed while Python finalizes
    source = _example(temporal_address, served) + LEFT_FOR_EXIT
    proc = run_example(source, tmp_path, _env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\nleft for exit: []\n" in proc.stdout, proc.stdout
