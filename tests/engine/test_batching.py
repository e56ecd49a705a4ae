"""Cross-session batching in the worker with the torch engine."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("torch")

from voxgate.engine.runtime.client import EngineClient, EngineConfig  # noqa: E402


async def speak(client, text):
    stream = client.stream()
    stream.push_text(text)
    stream.end_input()
    return [chunk async for chunk in stream]


async def test_concurrent_streams_are_batched_and_each_gets_its_own_speech():
    client = EngineClient(EngineConfig(engine="torch", parallel=1, threads=2))
    await client.start()
    try:
        texts = [
            "The first stream talks about the weather today.",
            "A second stream reads out a phone number slowly.",
            "Third, a short one.",
            "And the fourth stream closes the batch with this sentence.",
        ]
        solo = [await speak(client, t) for t in texts[:1]]
        results = await asyncio.gather(*(speak(client, t) for t in texts))
        stats = await client.worker_stats()
        assert stats["largest_batch"] >= 2 and stats["batches"] > 0
        assert stats["streams"] == 0
        for text, chunks in zip(texts, results):
            assert len(chunks) >= 2  # streamed inside the sentence, window by window
            assert "".join(c.text for c in chunks).split() == text.split()
            words = [w.text for c in chunks for w in c.words]
            assert words == text.split()
            audio = np.concatenate([c.pcm for c in chunks])
            assert 0.5 < len(audio) / 22050 < 6.0
            assert np.abs(audio).max() > 1000
        # A stream's audio does not depend on its batch-mates: the first text alone
        # and in a batch of four have the same length (noise differs, durations are close).
        alone = sum(len(c.pcm) for c in solo[0])
        batched = sum(len(c.pcm) for c in results[0])
        assert abs(alone - batched) / alone < 0.25
    finally:
        await client.close()
