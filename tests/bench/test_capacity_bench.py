"""The capacity benchmark's own parts (bench/bench_capacity.py, bench/baseline_aiortc.py):
what it reads from the product, the same-run baseline it compares against, and its arithmetic.

Real components: the product and the baseline run as processes on loopback,
clients are aiortc peers decoding real Opus.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import aiohttp
import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import baseline_aiortc  # noqa: E402 - bench/ is on the path only now
import bench_capacity  # noqa: E402
from _common import free_port  # noqa: E402


def test_histogram_arithmetic() -> None:
    le = [0.001, 0.005, 0.05, float("inf")]
    before = [5.0, 5.0, 5.0, 5.0]
    after = [15.0, 103.0, 104.0, 105.0]  # window: 10 <= 1 ms, 88 in (1, 5], 1 in (5, 50], 1 over 50 ms
    assert bench_capacity.histogram_bound(le, before, after, 0.5) == 0.005
    assert bench_capacity.histogram_bound(le, before, after, 0.98) == 0.005
    assert bench_capacity.histogram_bound(le, before, after, 0.99) == 0.05
    assert bench_capacity.histogram_bound(le, before, after, 1.0) == float("inf")
    assert bench_capacity.over_bound(le, before, after, 0.005) == 2
    assert bench_capacity.over_bound(le, before, after, 0.05) == 1
    assert bench_capacity.histogram_bound(le, before, before, 0.99) is None
    assert bench_capacity.split(41, 2) == [21, 20]


async def test_reads_the_products_metrics(tone_server) -> None:
    """The figures the benchmark takes from a real gateway's /metrics move with the frames it sends."""
    async with aiohttp.ClientSession() as http:

        async def figures() -> dict:
            async with http.get(tone_server.url + "/metrics") as resp:
                return bench_capacity.parse_product_metrics(await resp.text())

        before = await figures()
        async with RtcClient(tone_server.url) as client:
            client.send({"type": "speak", "text": "frames", "id": "f"})
            done = await client.wait_for("utterance.done", id="f")
        after = await figures()
    frames = after["frames"] - before["frames"]
    assert frames >= done["audio_ms"] // 20 - 1  # the utterance's frames (less the first, sent by a wake)
    # The histogram's +Inf bucket holds every interval: buckets and count are read consistently.
    assert after["jitter_cumulative"][-1] == after["frames"]
    assert after["jitter_le"][-1] == float("inf")
    assert after["late"] >= before["late"]
    assert bench_capacity.histogram_bound(after["jitter_le"], before["jitter_cumulative"], after["jitter_cumulative"], 0.5) is not None
    # The server process collected its start-up heap in full (gateway/heap.py settle) after the gateway began timing collections.
    assert after["full_collections"] >= 1 and after["full_collection_s"] > 0
    assert after["full_collection_cumulative"][-1] == after["full_collections"]
    # Young collections: generations 0 and 1 added, bucket by bucket.
    assert after["young_collections"] > before["young_collections"]
    assert after["young_collection_cumulative"][-1] == after["young_collections"]


def test_a_renamed_product_metric_is_an_error() -> None:
    text = (
        "# TYPE voxgate_pacer_departure_jitter_seconds histogram\n"
        'voxgate_pacer_departure_jitter_seconds_bucket{le="0.005"} 3.0\n'
        'voxgate_pacer_departure_jitter_seconds_bucket{le="+Inf"} 4.0\n'
        "voxgate_pacer_departure_jitter_seconds_count 4.0\n"
        "voxgate_pacer_departure_jitter_seconds_sum 0.01\n"
        "# TYPE voxgate_event_loop_lag_seconds histogram\n"
        'voxgate_event_loop_lag_seconds_bucket{le="0.001"} 1.0\n'
        'voxgate_event_loop_lag_seconds_bucket{le="+Inf"} 1.0\n'
        "voxgate_event_loop_lag_seconds_count 1.0\n"
        "voxgate_event_loop_lag_seconds_sum 0.0\n"
        "# TYPE voxgate_pacer_underruns_total counter\n"
        "voxgate_pacer_underruns_total 0.0\n"
        "# TYPE voxgate_pacer_dtx_frames_total counter\n"
        "voxgate_pacer_dtx_frames_total 40.0\n"
    )
    gc_pauses = "# TYPE voxgate_gc_pause_seconds histogram\n"  # no collection yet: no series, and not an error
    late = "# TYPE voxgate_pacer_late_frames_total counter\nvoxgate_pacer_late_frames_total 1.0\n"
    figures = bench_capacity.parse_product_metrics(text + gc_pauses + late)
    assert figures["late"] == 1 and figures["full_collections"] == 0 and figures["young_collections"] == 0
    young = (
        'voxgate_gc_pause_seconds_bucket{generation="0",le="0.001"} 5.0\n'
        'voxgate_gc_pause_seconds_bucket{generation="0",le="+Inf"} 6.0\n'
        'voxgate_gc_pause_seconds_count{generation="0"} 6.0\n'
        'voxgate_gc_pause_seconds_sum{generation="0"} 0.004\n'
        'voxgate_gc_pause_seconds_bucket{generation="1",le="0.001"} 0.0\n'
        'voxgate_gc_pause_seconds_bucket{generation="1",le="+Inf"} 2.0\n'
        'voxgate_gc_pause_seconds_count{generation="1"} 2.0\n'
        'voxgate_gc_pause_seconds_sum{generation="1"} 0.006\n'
    )
    figures = bench_capacity.parse_product_metrics(text + gc_pauses + young + late)
    assert figures["young_collections"] == 8 and figures["young_collection_s"] == pytest.approx(0.01)
    assert figures["young_collection_le"] == [0.001, float("inf")] and figures["young_collection_cumulative"] == [5.0, 8.0]
    assert figures["full_collections"] == 0
    with pytest.raises(KeyError, match="voxgate_gc_pause_seconds"):
        bench_capacity.parse_product_metrics(text + late)
    with pytest.raises(KeyError, match="voxgate_pacer_late_frames_total"):
        bench_capacity.parse_product_metrics(text + gc_pauses)


@pytest.fixture(scope="module")
def baseline_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(BENCH, "baseline_aiortc.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/stats", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the baseline server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


async def test_baseline_speaks_the_tone_audio_and_the_protocol_subset(baseline_url) -> None:
    """The plain aiortc server says exactly the text it is given, with the events the load generator needs."""
    async with RtcClient(baseline_url) as client:
        assert client.ready["session_id"]
        text = "same audio"
        t_send = client.send({"type": "speak", "text": text, "id": "s"})
        await client.wait_for("audio.started", id="s")
        done = await client.wait_for("utterance.done", id="s")
        assert done["audio_ms"] == len(tone.encode(text, 48000)) * 1000 // 48000
        await client.wait_tail(done)
        assert tone.decode(client.audio.pcm(t_send), client.audio.sample_rate) == text

        client.send({"type": "speak", "text": "cancelled " * 20, "id": "c"})
        await client.wait_for("audio.started", id="c")
        client.send({"type": "cancel"})
        interrupted = await client.wait_for("utterance.interrupted", id="c")
        assert interrupted["reason"] == "cancel" and 0 < interrupted["played_ms"] < 8000
    async with aiohttp.ClientSession() as http, http.get(baseline_url + "/stats") as resp:
        stats = await resp.json(content_type=None)
    assert stats["frames"] > 0 and stats["jitter_cumulative"][-1] == stats["intervals"]


def _packet_bytes() -> int:
    """Bytes aiortc's Opus encoder makes of 0.8 s of tone speech."""
    import fractions

    import av
    from aiortc.codecs.opus import OpusEncoder

    encoder = OpusEncoder()
    pcm = tone.encode("twenty characters...", 48000)  # 20 characters: 0.8 s, 40 frames
    total = 0
    for i in range(len(pcm) // 960):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[i * 960 : (i + 1) * 960]).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, i * 960, fractions.Fraction(1, 48000)
        payloads, _ = encoder.encode(frame)
        total += sum(len(p) for p in payloads)
    return total


def test_matched_baseline_encodes_with_the_products_settings() -> None:
    """--opus matched turns aiortc's 96 kbit/s stereo into the product's mono 32 kbit/s."""
    from aiortc.codecs import opus

    default = _packet_bytes()
    original = opus.OpusEncoder.__init__
    try:
        baseline_aiortc.match_opus(bitrate=32000, complexity=5, fec=True, dtx=False)
        encoder = opus.OpusEncoder()
        assert encoder.codec.layout.name == "mono" and encoder.codec.bit_rate == 32000
        matched = _packet_bytes()
    finally:
        opus.OpusEncoder.__init__ = original
    # 32 against 96 kbit/s: about a third of the bytes (far from the 0.6 bound).
    assert matched < 0.6 * default


def test_the_generators_mic_levels_are_what_aiortc_puts_in_the_header():
    """The load generator's microphone sends each packet's RFC 6464 level as a browser does;
    it is computed as aiortc computes it for frames it encodes itself."""
    import av
    from aiortc.rtp import compute_audio_level_dbov

    import capacity_load

    rng = np.random.default_rng(3)
    pcm = np.concatenate([
        np.clip(rng.normal(0, capacity_load.NOISE_STD, 960 * 3), -32768, 32767),
        (np.sin(np.arange(960 * 2) * 0.05) * 12000),
        np.zeros(960),
    ]).astype(np.int16)
    levels = [level for _, level in capacity_load.with_levels([b"x"] * 6, pcm)]
    for i, level in enumerate(levels):
        frame = av.AudioFrame.from_ndarray(pcm[i * 960 : (i + 1) * 960].reshape(1, -1), format="s16", layout="mono")
        assert level == compute_audio_level_dbov(frame)
    assert levels[0] <= -55 < levels[3] and levels[5] == -127


def test_a_group_of_processes_reads_as_one_server() -> None:
    """--product-processes: counts and histogram buckets add up, a process with no full collection yet counts zeros,
    and generator i connects to process i mod N."""
    one = {"frames": 10.0, "late": 1.0, "jitter_le": [0.005, float("inf")], "jitter_cumulative": [8.0, 10.0],
           "full_collections": 0.0, "full_collection_le": [], "full_collection_cumulative": []}
    two = {"frames": 30.0, "late": 0.0, "jitter_le": [0.005, float("inf")], "jitter_cumulative": [29.0, 30.0],
           "full_collections": 1.0, "full_collection_le": [0.01, float("inf")], "full_collection_cumulative": [1.0, 1.0]}
    total = bench_capacity.add_figures([one, two])
    assert total["frames"] == 40 and total["late"] == 1 and total["jitter_cumulative"] == [37.0, 40.0]
    assert total["full_collections"] == 1 and total["full_collection_le"] == [0.01, float("inf")]
    assert total["full_collection_cumulative"] == [1.0, 1.0]
    group = bench_capacity.ProductGroup("product", [], 2)
    assert group.processes == 2 and [group.url_for(i) for i in range(3)] == [m.url for m in group.members] + [group.members[0].url]
    assert group.members[0].url != group.members[1].url


def test_a_windows_collections_from_two_readings() -> None:
    """Counts and pauses are the window's (the second reading less the first); a series with no
    collection yet at the first reading counts as zeros; no collection has no mean or longest."""
    before = {"full_collections": 0.0, "full_collection_s": 0.0, "full_collection_le": [], "full_collection_cumulative": []}
    after = {"full_collections": 2.0, "full_collection_s": 0.05,
             "full_collection_le": [0.01, 0.05, float("inf")], "full_collection_cumulative": [0.0, 2.0, 2.0]}
    assert bench_capacity.collections_in_window(before, after, "full") == {
        "count": 2, "total_ms": 50.0, "mean_ms": 25.0, "longest_le_ms": 50.0}
    assert bench_capacity.collections_in_window(after, after, "full") == {
        "count": 0, "total_ms": 0.0, "mean_ms": None, "longest_le_ms": None}
