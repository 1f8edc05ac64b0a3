"""Third-party servers for the interop suite, each run as its own process on 127.0.0.1.

`ServerProcess` starts one command on a free loopback port, waits until a health URL answers
200 (or the process exits, or the start-up deadline passes: both fail with the end of the
server's own log), and stops it again. `interop_requirement` decides what a missing server
package means: a skip on a developer's machine, a failure when ``TOOLLOOP_INTEROP=required``
(what ``.ci/run`` sets, so that CI can never pass by skipping the suite).

`LLMockControl` drives LLMock's control API (``/_llmock/…``): queue scripted behaviours,
read back the requests it served, reset it between tests.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

REQUIRED_VARIABLE = "TOOLLOOP_INTEROP"
"""Set to ``required`` to make a missing server package fail the suite instead of skipping."""

START_TIMEOUT = 180.0
"""Seconds a server may take to answer its health URL (LiteLLM's proxy takes ~25 s on two
busy cores: it imports most of its provider SDKs before it listens)."""


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
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.health_url = health_url
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
            )
        try:
            self._await_health()
        except BaseException:
            self.stop()
            raise

    def _await_health(self) -> None:
        process = self._process
        assert process is not None
        deadline = time.monotonic() + self.start_timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                try:
                    if client.get(self.health_url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() >= deadline:
                    raise ServerFailedToStart(
                        f"{self.name} did not answer {self.health_url} within "
                        f"{self.start_timeout:.0f} s\n{self.log_tail()}"
                    )
                # waiting on the process itself paces the polling and notices an early exit
                try:
                    code = process.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                raise ServerFailedToStart(
                    f"{self.name} exited with code {code} before it answered "
                    f"{self.health_url}\n{self.log_tail()}"
                )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


class LLMockControl:
    """LLMock's control API: scripted behaviours in, served requests out."""

    def __init__(self, url: str) -> None:
        self.url = url

    def base_url(self, path: str) -> str:
        return f"{self.url}{path}"

    def reset(self) -> None:
        """Forget every request served and every behaviour still queued."""
        httpx.post(f"{self.url}/_llmock/reset", timeout=10).raise_for_status()

    async def script(self, *behaviours: Mapping[str, Any]) -> None:
        """Queue behaviours (``{"type": "reply", …}``, ``{"type": "fail", …}``, …) in order."""
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(
                f"{self.url}/_llmock/scenario", json={"behaviors": list(behaviours)}
            )
        response.raise_for_status()

    async def requests(self) -> list[dict[str, Any]]:
        """Every request served since the last reset, oldest first, with its body."""
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(f"{self.url}/_llmock/requests")
        response.raise_for_status()
        served: list[dict[str, Any]] = response.json()["requests"]
        return served
