"""Fixtures for the provider tests: a loopback HTTP server serving recorded streams, and a
shared HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.providers.wire_server import WireServer


@pytest.fixture
async def wire_server() -> AsyncIterator[WireServer]:
    server = WireServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # One shared client per test: creating one (its TLS context) costs more than a replay.
    async with httpx.AsyncClient() as shared:
        yield shared
