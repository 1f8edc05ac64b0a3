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


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    with serving(ROOT, _env()) as url:
        yield url


@pytest.mark.parametrize("run", range(1, RUNS + 1))
def test_the_readme_temporal_example_completes_and_exits_cleanly(
    run: int, temporal_address: str, served: str, tmp_path: Path
) -> None:
    example = readme_example(ROOT, "### On Temporal")
    assert '"127.0.0.1:7233"' in example and "http://127.0.0.1:8765/v1" in example
    source = example.replace("127.0.0.1:7233", temporal_address)
    proc = run_example(source.replace("http://127.0.0.1:8765/v1", served), tmp_path, _env())
    assert "Fatal Python error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "°C" in proc.stdout  # the model's answer reached the example's channel
    assert " completed pre_tool_text_suffices" in proc.stdout, proc.stdout
