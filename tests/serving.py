"""``toolloop-fsm serve`` as a background process for the tests that run the README's
examples against it: started, stopped with SIGINT (its clean stop is part of what is
tested), and killed if it does not stop, whatever the suite's own SIGINT disposition."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The bound on serve's exit after SIGINT, before it is killed.
SERVE_STOP_SECONDS = 10


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def serving(cwd: Path, env: dict[str, str], *options: str) -> Iterator[str]:
    """``toolloop-fsm serve --port 0`` (with ``options``) running; yields its base URL
    (``…/v1``)."""
    command = [sys.executable, "-m", "toolloop_fsm", "serve", "--port", "0", *options]
    # a background job (`pytest &`) inherits SIGINT ignored, and Python then never installs
    # its KeyboardInterrupt handler: give the server the default disposition back, so that
    # the clean stop on SIGINT is what is tested wherever the suite runs
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        preexec_fn=_default_sigint,
    ) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            found = re.search(r"(http://127\.0\.0\.1:\d+/v1)", first)
            assert found is not None, first + (proc.stderr.read() if proc.stderr else "")
            yield found.group(1)
            proc.send_signal(signal.SIGINT)
            try:
                _out, err = proc.communicate(timeout=SERVE_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pytest.fail(f"serve did not stop within {SERVE_STOP_SECONDS} s of SIGINT")
            assert "Traceback" not in err, err
            assert proc.returncode == 0, err
        finally:
            # whatever happened above, never leave the server running (the `with` would
            # otherwise wait for it forever)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def readme_example(repo: Path, heading: str) -> str:
    """The first ``python`` code block of the README after ``heading``."""
    readme = (repo / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


def run_example(
    source: str, directory: Path, env: dict[str, str], timeout: float, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a script of its own in ``directory``, as a reader of the README
    would, typing ``stdin``; what it printed, and how it exited."""
    script = directory / "example.py"
    script.write_text(source, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=directory,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        check=False,
    )
