"""``toolloop-fsm serve`` as a background process for the tests that run the README's
examples against it: started (ready once it prints the line naming its URL), stopped with
SIGINT (its clean stop is part of what is tested), and killed with its process group
whatever happened."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests import processes


@contextlib.contextmanager
def serving(cwd: Path, env: dict[str, str], *options: str) -> Iterator[str]:
    """``toolloop-fsm serve --port 0`` (with ``options``) running; yields its base URL
    (``…/v1``)."""
    command = [sys.executable, "-m", "toolloop_fsm", "serve", "--port", "0", *options]
    proc = processes.start(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    with processes.running(proc):
        assert proc.stdout is not None and proc.stderr is not None
        # the first line names the URL once it listens; an empty one means it exited
        first = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/v1)", first)
        assert found is not None, first + proc.stderr.read()
        yield found.group(1)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate()  # until it has stopped: a stop that hangs is a defect
        assert "Traceback" not in err, err
        assert proc.returncode == 0, err


def readme_example(repo: Path, heading: str) -> str:
    """The first ``python`` code block of the README after ``heading``."""
    readme = (repo / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


def run_example(
    source: str, directory: Path, env: dict[str, str], stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a script of its own in ``directory``, as a reader of the README
    would, typing ``stdin``, until it exits; what it printed, and how it exited."""
    script = directory / "example.py"
    script.write_text(source, encoding="utf-8")
    with processes.running(
        processes.start(
            [sys.executable, script],
            cwd=directory,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    ) as proc:
        out, err = proc.communicate(stdin)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
