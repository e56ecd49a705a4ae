"""/metrics, /healthz and /readyz as an operator sees them."""

import asyncio
import re

import aiohttp

from voxgate.rtc_client import RtcClient


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def test_metrics_reflect_speech_and_cancel(server_factory):
    server = server_factory("tone")
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(server.url + "/readyz") as resp:
            assert resp.status == 200 and (await resp.json())["ready"] is True
        async with RtcClient(server.url) as client:
            client.send({"type": "speak", "text": "Count me in the metrics.", "id": "m1"})
            await client.wait_for("utterance.done", id="m1")
            client.send({"type": "speak", "text": "This one is cancelled part way through its words. " * 3, "id": "m2"})
            await client.wait_for("audio.started", id="m2")
            client.send({"type": "cancel"})
            await client.wait_for("utterance.interrupted", id="m2")
            # cancel-to-silence is observed when the next (silent) frame leaves.
            for _ in range(50):
                async with http.get(server.url + "/metrics") as resp:
                    text = await resp.text()
                if sample(text, "voxgate_cancel_to_silence_seconds_count") > 0:
                    break
                await asyncio.sleep(0.05)
            assert sample(text, "voxgate_active_sessions") >= 0
        assert sample(text, "voxgate_ttfa_seconds_count") >= 2
        assert sample(text, 'voxgate_engine_first_chunk_seconds_count{engine="tone"}') >= 2
        assert sample(text, "voxgate_text_aggregation_wait_seconds_count") >= 2
        assert sample(text, "voxgate_cancel_to_silence_seconds_count") == 1
        assert sample(text, 'voxgate_utterances_total{outcome="done"}') == 1
        assert sample(text, 'voxgate_utterances_total{outcome="interrupted"}') == 1
        assert sample(text, "voxgate_pacer_departure_jitter_seconds_count") > 50
        assert sample(text, "voxgate_event_loop_lag_seconds_count") > 0
        assert sample(text, "voxgate_engine_rtf_count") >= 2
        assert "voxgate_engine_worker_restarts_total 0.0" in text
