"""Same-size decoder windows of different requests share one batched pass in a torch replica.

A second application on the session's Serve instance hosts the torch engine
(route prefix /torch); four streams from one gateway client are four requests,
and the replica's scheduler advances their windows in batches (its counters say so).
"""

from __future__ import annotations

import asyncio

import pytest

from voxgate.engine.cluster.pool import PoolConfig, build_app
from voxgate.engine.cluster.remote import RemoteEngineClient

pytest.importorskip("torch")
serve = pytest.importorskip("ray.serve")

TEXTS = [
    "The first stream talks about the weather today.",
    "A second stream reads out a phone number slowly.",
    "A third one asks whether the order has shipped.",
    "And the fourth stream closes the batch with this sentence.",
]


async def speak(client, text):
    stream = client.stream()
    stream.push_text(text)
    stream.end_input()
    return [chunk async for chunk in stream]


async def test_windows_of_different_requests_are_batched(pool):
    serve.run(build_app(PoolConfig(engine="torch", num_cpus=1, parallel=1, threads=2)),
              name="voxgate-engine-torch", route_prefix="/torch")
    client = RemoteEngineClient(pool.url + "torch/")
    try:
        await client.start()
        results = await asyncio.gather(*(speak(client, t) for t in TEXTS))
        stats = await client.worker_stats()
        assert stats["largest_batch"] >= 2 and stats["requests"] == len(TEXTS)
        for text, chunks in zip(TEXTS, results):
            assert len(chunks) >= 2 and "".join(c.text for c in chunks).split() == text.split()
    finally:
        await client.close()
        # Not waiting out its replica's draining period (8 s): the package's ray.shutdown() ends it.
        serve.delete("voxgate-engine-torch", _blocking=False)
