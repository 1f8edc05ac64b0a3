"""`toolloop-fsm serve` as a process: its options set its bounds, a bad request gets an
answer rather than a traceback, and Ctrl-C stops it cleanly while a client holds a
connection (`tests.serving` checks the clean stop)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.serving import serving

REPO = Path(__file__).resolve().parent.parent
MODELS = b"GET /v1/models HTTP/1.1\r\nhost: demo\r\n\r\n"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # `python -m` from the repo root finds the package itself
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def _held(url: str) -> socket.socket:
    """A connection the server has answered once, so it surely holds it."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    held = socket.create_connection((parts.hostname, parts.port))
    held.sendall(MODELS)
    answer = b""
    while b'"object": "list"' not in answer:
        answer += held.recv(65536)
    return held


def _until_closed(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_a_bad_json_body_gets_a_400_and_ctrl_c_still_stops_serve_with_a_client_connected() -> None:
    with serving(REPO, _env()) as url:
        held = _held(url)  # kept alive, idle, while serve is stopped
        response = httpx.post(f"{url}/chat/completions", content=b"{not json", timeout=None)
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert _until_closed(held) == b""  # serve ended the connection it held
    held.close()


def test_serve_answers_503_past_its_max_connections() -> None:
    with serving(REPO, _env(), "--max-connections", "1") as url:
        held = _held(url)
        extra = socket.create_connection((urlsplit(url).hostname or "", urlsplit(url).port or 0))
        extra.sendall(MODELS)
        assert _until_closed(extra).startswith(b"HTTP/1.1 503 ")
        extra.close()
        held.close()


def test_serve_answers_413_past_its_max_body_bytes() -> None:
    with serving(REPO, _env(), "--max-body-bytes", "100") as url:
        response = httpx.post(f"{url}/chat/completions", content=b"{" * 101, timeout=None)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"


def test_serve_refuses_a_bound_not_above_zero_naming_the_option() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "toolloop_fsm", "serve", "--idle-timeout", "-1"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "--idle-timeout: must be above 0, got -1" in proc.stderr
