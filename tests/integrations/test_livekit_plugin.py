"""voxgate.integrations.livekit through LiveKit Agents' own TTS interface
(`synthesize()` and `stream()`, no LiveKit server), against a real gateway with
the embedded voice: intelligible speech, streamed, with word timings, and streams
that share one connection without hearing each other."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("livekit.agents", reason='the livekit extra: pip install -e ".[livekit]"')

from livekit.agents import APIConnectOptions, APIError, tts  # noqa: E402
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402

from tests.speech import heard_well, recognize, word_error_rate, words  # noqa: E402
from voxgate.integrations.livekit import VoxgateTTS  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
RATE = 24000


def pcm_of(events: list[tts.SynthesizedAudio]) -> np.ndarray:
    assert all(e.frame.sample_rate == RATE and e.frame.num_channels == 1 for e in events)
    return np.concatenate([np.frombuffer(e.frame.data, dtype=np.int16) for e in events])


def timed_words(events: list[tts.SynthesizedAudio]) -> list:
    return [w for e in events for w in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]


async def test_synthesize_speaks_a_sentence_streamed_with_word_timings(piper_server, first_audio_report):
    engine = VoxgateTTS(url=piper_server.url, sample_rate=RATE)
    assert engine.capabilities.streaming and engine.capabilities.aligned_transcript
    try:
        started = time.perf_counter()
        arrivals, events = [], []
        async with engine.synthesize(SENTENCE) as stream:
            async for event in stream:
                arrivals.append(time.perf_counter())
                events.append(event)
    finally:
        await engine.aclose()
    first_ms = (arrivals[0] - started) * 1000.0
    first_audio_report["livekit_synthesize_first_audio_ms"] = round(first_ms, 1)
    print(f"livekit plugin, synthesize(): first audio {first_ms:.1f} ms")
    assert len(events) > 3, "the speech came as one piece, not streamed"
    assert arrivals[0] - started < 0.5 * (arrivals[-1] - started), (first_ms, arrivals[-1] - started)
    pcm = pcm_of(events)
    duration_s = len(pcm) / RATE
    assert 2.0 < duration_s < 8.0, duration_s
    heard = recognize(pcm, RATE)
    assert word_error_rate(SENTENCE, heard) < 0.5, heard
    timed = timed_words(events)
    assert words("".join(timed)) == words(SENTENCE)
    assert [w.start_time for w in timed] == sorted(w.start_time for w in timed)
    assert all(w.start_time < w.end_time for w in timed)
    assert 0.5 * duration_s < timed[-1].end_time <= duration_s + 0.02, (timed[-1].end_time, duration_s)


async def test_stream_takes_tokens_as_they_come_and_shares_the_connection(piper_server, first_audio_report):
    engine = VoxgateTTS(url=piper_server.url, sample_rate=RATE)
    reply = "Sure, I can help with that. The meeting moves to Tuesday at noon."
    try:
        stream = engine.stream()
        started = time.perf_counter()
        for token in reply.split(" "):
            stream.push_text(token + " ")
        stream.end_input()
        arrivals, events = [], []
        async for event in stream:
            arrivals.append(time.perf_counter())
            events.append(event)
        await stream.aclose()
        first_ms = (arrivals[0] - started) * 1000.0
        first_audio_report["livekit_stream_first_audio_ms"] = round(first_ms, 1)
        print(f"livekit plugin, stream(): first audio {first_ms:.1f} ms")
        assert {e.segment_id for e in events} == {events[0].segment_id} and events[-1].is_final
        pcm = pcm_of(events)
        assert heard_well(reply, pcm, RATE), recognize(pcm, RATE)
        assert words("".join(timed_words(events))) == words(reply)
        connection = engine._conn

        # Interrupted: closed after its first audio. The next stream, on the same
        # connection, hears only its own speech.
        long_stream = engine.stream()
        long_stream.push_text(" ".join(["This sentence is long, so the listener has time to interrupt it."] * 4))
        long_stream.end_input()
        await long_stream.__anext__()
        await long_stream.aclose()
        second = "Okay, stopping now."
        stream = engine.stream()
        stream.push_text(second)
        stream.end_input()
        events = [event async for event in stream]
        await stream.aclose()
        assert engine._conn is connection
        pcm = pcm_of(events)
        assert len(pcm) / RATE < 2.5, "audio of the interrupted stream came into the next one"
        heard = recognize(pcm, RATE)
        assert word_error_rate(second, heard) < 0.5, heard
    finally:
        await engine.aclose()


async def test_a_refused_key_is_a_clear_error_not_a_retry_loop(server_factory):
    server = server_factory("tone", ["--api-key", "right-key"])
    engine = VoxgateTTS(url=server.url, api_key="wrong-key", sample_rate=RATE)
    try:
        started = time.perf_counter()
        with pytest.raises(APIError) as info:
            await engine.synthesize("Hello.", conn_options=APIConnectOptions(max_retry=3, retry_interval=2.0)).collect()
        assert "401" in str(info.value) or "unauthorized" in str(info.value).lower(), info.value
        assert time.perf_counter() - started < 2.0, "a 401 was retried"
    finally:
        await engine.aclose()


async def test_the_gateways_error_is_the_one_raised(tone_server):
    """An unknown voice: the APIError carries the gateway's own code, not a follow-up's."""
    engine = VoxgateTTS(url=tone_server.url, voice="nobody", sample_rate=RATE)
    try:
        with pytest.raises(APIError) as info:
            await engine.synthesize("Hello.", conn_options=APIConnectOptions(max_retry=0)).collect()
        assert "unknown_voice" in str(info.value) and "unknown_context" not in str(info.value), info.value
    finally:
        await engine.aclose()
