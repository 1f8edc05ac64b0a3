"""Third-party servers for the interop suite, each run as its own process on 127.0.0.1.

`ServerProcess` starts one command on a free loopback port (through `tests.processes`, so
it dies with the run), waits until a health URL answers 200 (or the process exits, or it
has been asked `HEALTH_CHECKS` times: both fail with the end of the server's own log), and
kills it again. `interop_requirement` decides what a missing server package means: a skip
on a developer's machine, a failure when ``TOOLLOOP_INTEROP=required`` (what ``.ci/run``
sets, so that CI can never pass by skipping the suite).

`LLMockControl` drives LLMock's control API (``/_llmock/…``): queue scripted behaviours,
read back the requests it served, reset it between tests.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import processes

REQUIRED_VARIABLE = "TOOLLOOP_INTEROP"
"""Set to ``required`` to make a missing server package fail the suite instead of skipping."""

HEALTH_CHECKS = 3000
"""How many times a server's health URL is asked before the server counts as hung. Each
check waits up to `CHECK_PACE` for the process to exit, so this is a safety net of ten
minutes or more against a server that neither listens nor exits, not a start-up deadline
(LiteLLM's proxy takes ~25 s on two busy cores: it imports most of its provider SDKs before
it listens)."""

CHECK_PACE = 0.2
"""Seconds between two health checks, spent waiting on the process (which notices an early
exit at once)."""


def interop_requirement(server: str, modules: Sequence[str], install_hint: str) -> None:
    """Skip (locally) or fail (under ``TOOLLOOP_INTEROP=required``) when a module is missing."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = (
        f"{server} is not installed (missing modules: {', '.join(missing)}); "
        f"install it with: {install_hint}"
    )
    if os.environ.get(REQUIRED_VARIABLE, "").strip().lower() == "required":
        pytest.fail(
            f"{message} — {REQUIRED_VARIABLE}=required, so the interop suite must run",
            pytrace=False,
        )
    pytest.skip(message)


def free_port() -> int:
    """A port nothing listens on right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ServerFailedToStart(RuntimeError):
    """The server exited or never answered its health URL; the message ends with its log."""


class ServerProcess:
    """One server process: `start()` returns once ``health_url`` answers 200; `stop()`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        health_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.health_url = health_url
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self._process = processes.start(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
            )
        try:
            self._await_health()
        except BaseException:
            self.stop()
            raise

    def _await_health(self) -> None:
        process = self._process
        assert process is not None
        # one check's wait on an answer is bounded so that a server that accepts but never
        # answers is asked again; a slow answer only costs a check
        with httpx.Client(timeout=2.0) as client:
            for _check in range(HEALTH_CHECKS):
                try:
                    if client.get(self.health_url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                # waiting on the process itself paces the checks and notices an early exit
                try:
                    code = process.wait(timeout=CHECK_PACE)
                except subprocess.TimeoutExpired:
                    continue
                raise ServerFailedToStart(
                    f"{self.name} exited with code {code} before it answered "
                    f"{self.health_url}\n{self.log_tail()}"
                )
        raise ServerFailedToStart(
            f"{self.name} neither answered {self.health_url} nor exited in {HEALTH_CHECKS} "
            f"checks: it is hung\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"

    def stop(self) -> None:
        """Kill the server and whatever it started (its clean stop is not what is tested)."""
        if self._process is not None:
            processes.stop(self._process)


class LLMockControl:
    """LLMock's control API: scripted behaviours in, served requests out. Its calls wait for
    the answer however long a loaded machine takes (no wall-clock limit in a test)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def base_url(self, path: str) -> str:
        return f"{self.url}{path}"

    def reset(self) -> None:
        """Forget every request served and every behaviour still queued."""
        httpx.post(f"{self.url}/_llmock/reset", timeout=None).raise_for_status()

    async def script(self, *behaviours: Mapping[str, Any]) -> None:
        """Queue behaviours (``{"type": "reply", …}``, ``{"type": "fail", …}``, …) in order."""
        async with httpx.AsyncClient(timeout=None) as client:
            response = await client.post(
                f"{self.url}/_llmock/scenario", json={"behaviors": list(behaviours)}
            )
        response.raise_for_status()

    async def requests(self) -> list[dict[str, Any]]:
        """Every request served since the last reset, oldest first, with its body."""
        async with httpx.AsyncClient(timeout=None) as client:
            response = await client.get(f"{self.url}/_llmock/requests")
        response.raise_for_status()
        served: list[dict[str, Any]] = response.json()["requests"]
        return served
