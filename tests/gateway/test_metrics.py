"""/metrics, /healthz and /readyz as an operator sees them."""

import asyncio
import gc
import re

import aiohttp

from voxgate.gateway.load.metrics import GatewayMetrics
from voxgate.rtc_client import RtcClient


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def metrics_text(http, server) -> str:
    async with http.get(server.url + "/metrics") as resp:
        return await resp.text()


def jitter_buckets(text: str) -> dict[float, float]:
    """Cumulative counts of the pacer jitter histogram, by upper bound in seconds."""
    found = re.findall(r'^voxgate_pacer_departure_jitter_seconds_bucket\{le="([^"]+)"\} ([0-9.e+-]+)$', text, re.M)
    return {float(le): float(n) for le, n in found}


async def test_metrics_reflect_speech_and_cancel(server_factory):
    server = server_factory("tone")
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(server.url + "/readyz") as resp:
            assert resp.status == 200 and (await resp.json())["ready"] is True
        async with RtcClient(server.url) as client:
            before = await metrics_text(http, server)
            client.send({"type": "speak", "text": "Count me in the metrics.", "id": "m1"})
            done = await client.wait_for("utterance.done", id="m1")
            client.send({"type": "speak", "text": "This one is cancelled part way through its words. " * 3, "id": "m2"})
            await client.wait_for("audio.started", id="m2")
            client.send({"type": "cancel"})
            interrupted = await client.wait_for("utterance.interrupted", id="m2")
            # cancel-to-silence is observed when the next (silent) frame leaves.
            for _ in range(50):
                text = await metrics_text(http, server)
                if sample(text, "voxgate_cancel_to_silence_seconds_count") > 0:
                    break
                await asyncio.sleep(0.05)
            assert sample(text, "voxgate_active_sessions") >= 0
        assert sample(text, "voxgate_ttfa_seconds_count") >= 2
        assert sample(text, 'voxgate_gc_pause_seconds_count{generation="0"}') > 0  # speaking allocates
        assert sample(text, 'voxgate_engine_first_chunk_seconds_count{engine="tone"}') >= 2
        assert sample(text, "voxgate_text_aggregation_wait_seconds_count") >= 2
        assert sample(text, "voxgate_cancel_to_silence_seconds_count") == 1
        assert sample(text, 'voxgate_utterances_total{outcome="done"}') == 1
        assert sample(text, 'voxgate_utterances_total{outcome="interrupted"}') == 1
        # Every frame of both utterances was paced and measured, except each
        # utterance's first frame, which a wake sends early and is not jitter.
        frames = (done["audio_ms"] + interrupted["played_ms"]) // 20
        jitter = "voxgate_pacer_departure_jitter_seconds"
        count = sample(text, jitter + "_count") - sample(before, jitter + "_count")
        assert count >= frames - 2, (count, frames)
        # ... and their spacing is 20 ms: a pacer that did not wait would put
        # every sample near 20 ms of deviation.
        mean = (sample(text, jitter + "_sum") - sample(before, jitter + "_sum")) / count
        assert mean < 0.005, mean
        buckets = jitter_buckets(text)
        assert buckets[0.01] / buckets[float("inf")] > 0.8, buckets
        assert sample(text, "voxgate_event_loop_lag_seconds_count") > 0
        assert sample(text, "voxgate_engine_rtf_count") >= 2
        assert "voxgate_engine_worker_restarts_total 0.0" in text


def test_garbage_collection_pauses_are_timed_until_unwatched():
    metrics = GatewayMetrics()
    full = 'voxgate_gc_pause_seconds_count{generation="2"}'
    metrics.watch_collections()
    metrics.watch_collections()  # once only
    try:
        gc.collect()
        text = metrics.render().decode()
        assert sample(text, full) == 1
        assert sample(text, 'voxgate_gc_pause_seconds_sum{generation="2"}') > 0
    finally:
        metrics.unwatch_collections()
    gc.collect()
    assert sample(metrics.render().decode(), full) == 1


async def test_engine_first_chunk_counts_engine_time_not_the_wait_for_a_listener(tone_server):
    """A backend's utterance queued before any listener joins: its first chunk is made at once and
    waits for the listener; voxgate_engine_first_chunk_seconds counts only the engine's part. The
    listener (as the page joins a backend's session) hears of the utterance's start too: speech
    starts with the media, ahead of its data channel, and the events from before it opens reach it."""
    from voxgate.client import VoxgateSession

    name = 'voxgate_engine_first_chunk_seconds_{}{{engine="tone"}}'
    wait_s = 2.0
    async with aiohttp.ClientSession() as http, VoxgateSession(tone_server.url) as backend:
        before = await metrics_text(http, tone_server)
        backend_utterance = asyncio.ensure_future(backend.say("Queued before anyone listens."))
        await backend.wait_for("utterance.queued")
        await asyncio.sleep(wait_s)  # the scenario itself: nobody listens yet
        async with RtcClient(tone_server.url, session_id=backend.session_id, token=backend.client_token) as listener:
            ttfa_ms = (await listener.wait_for("audio.started", timeout=20))["ttfa_ms"]
            await asyncio.wait_for(backend_utterance, 30)
        after = await metrics_text(http, tone_server)
    # The labelled series appears with its first observation.
    had = name.format("count") in before
    count = sample(after, name.format("count")) - (sample(before, name.format("count")) if had else 0)
    seconds = sample(after, name.format("sum")) - (sample(before, name.format("sum")) if had else 0)
    assert count == 1
    # The engine's first chunk took a few ms of the tone engine, not the seconds the utterance waited.
    assert seconds < 0.25 * wait_s, (seconds, ttfa_ms)


async def test_error_events_are_counted_by_code(tone_server):
    """voxgate_protocol_errors_total counts each `error` event a client got, by its code."""
    from voxgate.client import VoxgateSession

    async with aiohttp.ClientSession() as http:
        before = await metrics_text(http, tone_server)
        async with VoxgateSession(tone_server.url) as backend:
            await backend.send({"type": "speak"})  # no text
            await backend.wait_for("error")
            await backend.send({"type": "no_such_message"})
            await backend.wait_for("error")
            await backend.send({"type": "cancel", "id": 7})  # an id must be a string
            await backend.wait_for("error")
            codes = [e["code"] for e in backend.history if e["type"] == "error"]
        text = await metrics_text(http, tone_server)

    def count(t: str, code: str) -> float:
        match = re.search(rf'^voxgate_protocol_errors_total\{{code="{code}"\}} ([0-9.e+-]+)$', t, re.M)
        return float(match.group(1)) if match else 0.0

    assert len(codes) == 3
    for code in set(codes):
        assert count(text, code) - count(before, code) == codes.count(code), (code, codes)
