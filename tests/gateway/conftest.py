"""Fixtures shared by tests/gateway/'s modules."""

from __future__ import annotations

import pytest_asyncio

from voxgate.config import Settings
from voxgate.gateway.gateway import Gateway


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw():
    """A tone-engine Gateway's engine and admission, one for the module (its worker takes a second to
    start), for speech with no peer (test_peerless_speech.py, test_speech_contexts.py). Its loop-lag
    watcher is not started: it would count this test process's own work (the worker's start, other
    tests' encodes) and refuse requests on a busy machine."""
    gw = Gateway(Settings(engine="tone", host="127.0.0.1", ice_host=["127.0.0.1"], web=False))
    await gw.engine.start()
    gw.admission.tick()
    yield gw
    await gw.engine.close()
