"""Fixtures for the provider tests: a loopback HTTP server serving recorded streams."""

from __future__ import annotations

from collections.abc import AsyncIterator

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
