"""The README's Temporal example runs as written: against this suite's dev server (for
``temporal server start-dev``'s 127.0.0.1:7233) and ``toolloop-fsm serve`` (for its
127.0.0.1:8765)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import serving

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def _example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### On Temporal") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def served() -> Iterator[str]:
    with serving(ROOT, _env()) as url:
        yield url


def test_the_readme_temporal_example_completes(
    temporal_address: str, served: str, tmp_path: Path
) -> None:
    example = _example()
    assert '"127.0.0.1:7233"' in example and "http://127.0.0.1:8765/v1" in example
    script = tmp_path / "durable.py"
    script.write_text(
        example.replace("127.0.0.1:7233", temporal_address).replace(
            "http://127.0.0.1:8765/v1", served
        ),
        encoding="utf-8",
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "°C" in proc.stdout  # the model's answer reached the example's channel
    assert " completed pre_tool_text_suffices" in proc.stdout, proc.stdout
