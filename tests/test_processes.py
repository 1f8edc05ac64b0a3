"""The servers the suite starts die with the run that started them (`tests.processes`): a
run killed with SIGKILL, which leaves it no teardown, leaves no server behind, and a
server's teardown ends whatever the server started too."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import processes

REPO = Path(__file__).resolve().parent.parent

#: Runs the rest of its command line as a background job (``pytest &``) would: SIGINT
#: ignored, and so in every process it starts. An xdist worker then runs on after its
#: controller is killed (with SIGINT at its default, it stops once its channel closes).
IN_THE_BACKGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)

#: How many times a process that should be dead is looked at; each look waits for its end
#: for up to `LOOK`, so this is a safety net against a test that would otherwise hang, not
#: a timing the test checks.
LOOKS = 500
LOOK = 0.02


def _gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state in {"Z", "X"}


def _ends(pidfd: int, pid: int) -> bool:
    """Whether process ``pid`` (watched through ``pidfd``) ends within `LOOKS` looks."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)  # readable once the process has ended
    return any(poller.poll(LOOK * 1000) or _gone(pid) for _look in range(LOOKS))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


@pytest.mark.skipif(
    not processes.DIES_WITH_THE_RUN, reason="no prctl(PR_SET_PDEATHSIG) here (it is Linux's)"
)
@pytest.mark.parametrize(
    "workers", [["-p", "no:xdist"], ["-n", "1"]], ids=["in-process", "xdist-worker"]
)
def test_a_server_dies_with_a_test_run_that_was_killed(workers: list[str], tmp_path: Path) -> None:
    # a run of its own whose one test starts `toolloop-fsm serve`, reports its pid over a
    # socket (an xdist worker's own output never reaches the run's), and then holds it until
    # the run is killed: no teardown of that run ever runs
    (tmp_path / "test_holds_a_server.py").write_text(
        textwrap.dedent(
            f"""
            import os, socket, subprocess, sys, threading
            from tests import processes

            def test_holds_a_server():
                server = processes.start(
                    [sys.executable, "-m", "toolloop_fsm", "serve", "--port", "0"],
                    cwd={str(REPO)!r}, stdout=subprocess.PIPE, text=True,
                )
                assert "http://127.0.0.1:" in server.stdout.readline()  # it listens
                with socket.socket(socket.AF_UNIX) as report:
                    report.connect(os.environ["REPORT_TO"])
                    report.sendall(str(server.pid).encode())
                threading.Event().wait()
            """
        ),
        encoding="utf-8",
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "report"))
        listener.listen(1)
        # the suite's own hooks (`-p tests.conftest`): they tie an xdist worker to the run
        pytest = [sys.executable, "-c", IN_THE_BACKGROUND, "-m", "pytest", "-sq"]
        run = processes.start(
            [*pytest, "-p", "no:cacheprovider", "-p", "tests.conftest", *workers],
            cwd=tmp_path,
            env={**_env(), "REPORT_TO": str(tmp_path / "report")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        with processes.running(run):
            server = _reported_pid(listener, run)
            pidfd = os.pidfd_open(server)
            try:
                assert os.getpgid(server) == server  # a process group of its own
                # the run's first process alone (xdist's controller, with -n): no teardown,
                # and no signal to the rest of its process group
                os.kill(run.pid, signal.SIGKILL)
                assert run.wait() == -signal.SIGKILL
                ended = _ends(pidfd, server)
                if not ended:
                    os.kill(server, signal.SIGKILL)
                assert ended, f"server {server} outlived the run that started it"
            finally:
                os.close(pidfd)


def _reported_pid(listener: socket.socket, run: subprocess.Popen[bytes]) -> int:
    """The pid the run reports on ``listener``; fails with its output if it ends first."""
    assert run.stdout is not None
    output = b""
    while True:
        ready, _, _ = select.select([listener.fileno(), run.stdout.fileno()], [], [])
        if listener.fileno() in ready:
            connection, _ = listener.accept()
            with connection:
                return int(connection.makefile("rb").read())
        chunk = os.read(run.stdout.fileno(), 65536)
        if not chunk:
            raise AssertionError(
                f"the run ended ({run.wait()}) before its server started:\n{output.decode()}"
            )
        output += chunk


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open here (it is Linux's)")
def test_stopping_a_server_ends_what_it_started_too() -> None:
    # a "server" that starts a process of its own and names it
    spawner = (
        "import subprocess, sys, threading\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import threading; "
        "threading.Event().wait()'])\n"
        "print(child.pid, flush=True)\n"
        "threading.Event().wait()\n"
    )
    server = processes.start([sys.executable, "-c", spawner], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    child = int(server.stdout.readline())
    pidfd = os.pidfd_open(child)
    try:
        processes.stop(server)
        ended = _ends(pidfd, child)
        if not ended:
            os.kill(child, signal.SIGKILL)
        assert ended, f"process {child}, started by the server, outlived its stop"
    finally:
        os.close(pidfd)
    assert server.returncode == -signal.SIGKILL
