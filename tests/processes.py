"""The processes the suite starts — its servers (LLMock, LiteLLM's proxy, the Temporal dev
server, ``toolloop-fsm serve``) and the Temporal workers — tied to the run that started them.

`start` runs each in a process group of its own, with PR_SET_PDEATHSIG set to SIGKILL
(Linux; `DIES_WITH_THE_RUN` says whether it is set): when the run dies, even by a SIGKILL
that leaves it no teardown, the kernel kills the process, so a run killed at a timeout
leaves no server behind. `stop` kills the whole group at teardown, whatever the process
started in turn. Nothing here waits on the clock: a started process ends when it is killed,
and `stop` waits for exactly that.

The death signal follows the thread that started the process, so start them from the
thread that lives as long as they should (the main thread: fixtures and tests run there).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import IO
from typing import Any
from typing import Literal
from typing import TypeVar
from typing import overload

#: ``prctl(2)``'s option that names the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1

# resolved here, in the suite's own process: the child, between fork and exec, only calls it
# (loading a library there could deadlock on a lock another thread of the parent held)
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
if _prctl is not None:
    _prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    _prctl.restype = ctypes.c_int

DIES_WITH_THE_RUN = _prctl is not None
"""Whether a started process dies with the run (Linux's prctl); elsewhere only `stop` ends
it, so a run killed without its teardown leaves it running."""

#: What one of a process's standard streams is connected to, as `subprocess` takes it.
Stream = int | IO[Any] | None
P = TypeVar("P", bound="subprocess.Popen[Any]")


def _tied_to(parent: int) -> None:
    """In the child, before exec: a group of its own, SIGKILL when ``parent`` dies."""
    os.setpgid(0, 0)
    # a background run (`pytest &`) hands its children SIGINT ignored, and Python then never
    # installs its KeyboardInterrupt handler: give them the default disposition back, so a
    # server's stop on SIGINT behaves the same wherever the suite runs
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with(parent)


def _die_with(parent: int) -> None:
    """SIGKILL to this process when ``parent``, its parent, dies (where prctl exists)."""
    if _prctl is None:
        return
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        # the parent died before prctl: the kernel will never send the signal
        os.kill(os.getpid(), signal.SIGKILL)


@overload
def start(
    argv: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: Stream = subprocess.DEVNULL,
    stdout: Stream = None,
    stderr: Stream = None,
    text: Literal[False] = False,
) -> subprocess.Popen[bytes]: ...


@overload
def start(
    argv: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: Stream = subprocess.DEVNULL,
    stdout: Stream = None,
    stderr: Stream = None,
    text: Literal[True],
) -> subprocess.Popen[str]: ...


def start(
    argv: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: Stream = subprocess.DEVNULL,
    stdout: Stream = None,
    stderr: Stream = None,
    text: bool = False,
) -> subprocess.Popen[bytes] | subprocess.Popen[str]:
    """``argv`` running in a process group of its own, killed by the kernel if this process
    dies first; text streams are UTF-8."""
    parent = os.getpid()
    return subprocess.Popen(
        [str(arg) for arg in argv],
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        encoding="utf-8" if text else None,
        preexec_fn=lambda: _tied_to(parent),
    )


def stop(process: subprocess.Popen[Any]) -> None:
    """Kill ``process``'s whole group and reap it; its pipes are closed. What it started
    dies too, even when ``process`` has already ended (a group lasts while a member runs)."""
    with contextlib.suppress(ProcessLookupError):  # no member left
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


@contextlib.contextmanager
def running(process: P) -> Iterator[P]:
    """``process`` for the block; `stop` at its end, however the block ends."""
    try:
        yield process
    finally:
        stop(process)


# ----------------------------------------------------------------------- xdist's workers
#: The key of a worker's ``workerinput`` that names the run's controller process.
CONTROLLER_PID = "toolloop_controller_pid"


def hand_over_the_run(workerinput: dict[str, Any]) -> None:
    """In xdist's controller, for a worker it starts: the pid the worker is tied to."""
    workerinput[CONTROLLER_PID] = os.getpid()


def die_with_the_run(workerinput: Mapping[str, Any]) -> None:
    """In an xdist worker: SIGKILL when the controller dies. A worker can outlive a
    controller killed with SIGKILL (it does when the run ignores SIGINT, as a background job
    does) and would hold its test's servers; a worker's processes die with it, so they die
    with the controller too."""
    _die_with(int(workerinput[CONTROLLER_PID]))
