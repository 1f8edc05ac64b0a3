"""Fixtures for the provider tests: a shared HTTP client (the loopback server, `wire_server`,
is the suite's: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # One shared client per test: creating one (its TLS context) costs more than a replay.
    async with httpx.AsyncClient() as shared:
        yield shared
