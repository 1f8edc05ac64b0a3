"""Fixtures of the interop suite: real third-party servers on 127.0.0.1, one process each,
started once per test session and stopped at its end.

* `llmock_server` — LLMock (``llmock serve``), which speaks OpenAI chat and Responses,
  Anthropic and Gemini, and injects faults on request; `llmock` hands each test a freshly
  reset one.
* `litellm_proxy` — LiteLLM's proxy (``litellm --config …``) with mocked models (a text
  reply, a rate limit, a server error) and one real route, to LLMock, for what LiteLLM's
  mocks cannot stream (tool calls, Anthropic messages, the Responses API).

A missing package skips these tests on a developer's machine and fails them when
``TOOLLOOP_INTEROP=required`` (`.ci/run` sets it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import yaml
from attrs import frozen

from tests.interop.servers import LLMockControl
from tests.interop.servers import ServerProcess
from tests.interop.servers import free_port
from tests.interop.servers import interop_requirement

INSTALL_HINT = 'python -m pip install -e ".[test]"'

PROXY_KEY = "sk-interop-proxy-7c1e9d04b2"
"""LiteLLM's master key: the only key its proxy accepts, and one no result may contain."""

#: LiteLLM model names, as the tests ask for them.
MOCK_TEXT_MODEL = "mock-text"
MOCK_TEXT = "Hello from LiteLLM's mocked model."
MOCK_RATE_LIMITED_MODEL = "mock-rate-limited"
MOCK_SERVER_ERROR_MODEL = "mock-server-error"
UPSTREAM_MODEL = "llmock-gpt"


@frozen
class LiteLLMProxy:
    url: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture(scope="session")
def llmock_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMockControl]:
    interop_requirement("LLMock", ["llmock", "uvicorn", "fastapi"], INSTALL_HINT)
    port = free_port()
    logs = tmp_path_factory.mktemp("llmock")
    server = ServerProcess(
        "LLMock",
        [
            sys.executable,
            "-c",
            "from llmock.cli import app; app()",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=logs / "llmock.log",
        # answers are deterministic text; offered tools are called only when a test scripts it
        env={"LLMOCK_TOOL_MODE": "off", "LLMOCK_RESPONSE_STYLE": "static"},
        cwd=logs,
    )
    server.start()
    try:
        yield LLMockControl(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


# This overrides the `llmock` fixture of LLMock's own pytest plugin, which runs a server in
# this process and points the vendors' SDKs at it through environment variables: here the
# server is a process of its own, and each test points an adapter at it explicitly.
@pytest.fixture
def llmock(llmock_server: LLMockControl) -> LLMockControl:
    """The session's LLMock, with no request recorded and no behaviour queued."""
    llmock_server.reset()
    return llmock_server


def litellm_config(upstream: str) -> dict[str, object]:
    """The proxy's models: three mocked by LiteLLM itself, one routed to LLMock."""

    def mocked(name: str, response: str) -> dict[str, object]:
        return {
            "model_name": name,
            "litellm_params": {
                "model": f"openai/{name}",
                "api_key": "sk-never-sent",
                "mock_response": response,
            },
        }

    return {
        "model_list": [
            mocked(MOCK_TEXT_MODEL, MOCK_TEXT),
            mocked(MOCK_RATE_LIMITED_MODEL, "litellm.RateLimitError"),
            mocked(MOCK_SERVER_ERROR_MODEL, "litellm.InternalServerError"),
            {
                "model_name": UPSTREAM_MODEL,
                "litellm_params": {
                    "model": "openai/gpt-4o",
                    "api_base": f"{upstream}/v1",
                    "api_key": "sk-upstream-llmock",
                },
            },
        ],
        # the proxy must not retry on its own: the tests see each failure as it happens
        "litellm_settings": {"num_retries": 0, "request_timeout": 30},
        "general_settings": {"master_key": PROXY_KEY},
    }


@pytest.fixture(scope="session")
def litellm_proxy(
    llmock_server: LLMockControl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiteLLMProxy]:
    interop_requirement(
        "LiteLLM's proxy", ["litellm", "uvicorn", "fastapi", "backoff"], INSTALL_HINT
    )
    port = free_port()
    home = tmp_path_factory.mktemp("litellm")
    config = home / "config.yaml"
    config.write_text(yaml.safe_dump(litellm_config(llmock_server.url)))
    server = ServerProcess(
        "LiteLLM proxy",
        [
            sys.executable,
            "-c",
            "from litellm import run_server; run_server()",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        health_url=f"http://127.0.0.1:{port}/health/liveliness",
        log_path=home / "litellm.log",
        env={
            # the bundled model price map: no fetch from the network at start-up
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
        },
        cwd=home,
    )
    server.start()
    try:
        yield LiteLLMProxy(f"http://127.0.0.1:{port}")
    finally:
        server.stop()
