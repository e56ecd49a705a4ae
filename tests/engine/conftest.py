"""Fixtures for the engine tests."""

import pytest

from voxgate.engine.runtime.client import EngineClient, EngineConfig


@pytest.fixture
async def tone_client():
    client = EngineClient(EngineConfig(engine="tone", parallel=2))
    await client.start()
    yield client
    await client.close()
