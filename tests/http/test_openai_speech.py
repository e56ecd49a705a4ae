"""POST /v1/audio/speech through the official `openai` client: OpenAI's request, Voxgate's
streaming, keys, limits and errors (the machinery of POST /v1/tts)."""

from __future__ import annotations

import base64
import gc
import io
import json
import statistics
import time
import wave

import av
import numpy as np
import openai
import pytest

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient
from tests.speech import recognize, word_error_rate

TEXT = "Speech for OpenAI clients."


def client(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def speech(url: str, key: str = "unused", *, using: openai.AsyncOpenAI | None = None, **params) -> tuple[dict, bytes, float]:
    """The response's headers, its body, and when its first bytes came, in seconds from the request."""
    params = {"model": "tts-1", "voice": "alloy", "input": TEXT, **params}
    using = using or client(url, key)
    started = time.perf_counter()
    first = None
    body = b""
    async with using.audio.speech.with_streaming_response.create(**params) as response:
        async for data in response.iter_bytes():
            first = first or time.perf_counter() - started
            body += data
        return dict(response.headers), body, first


def decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    if pcm.dtype.kind == "f":
        pcm = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    return pcm.astype(np.int16), frames[0].sample_rate


async def test_every_openai_format_streams_the_text(tone_server):
    symbols_s = len(TEXT.encode()) * tone.SYMBOL_S
    for fmt, content_type in [("wav", "audio/wav"), ("pcm", "audio/L16"), ("opus", "audio/ogg"), ("mp3", "audio/mpeg"),
                              ("aac", "audio/aac"), ("flac", "audio/flac")]:
        headers, body, _ = await speech(tone_server.url, response_format=fmt)
        assert headers["content-type"].startswith(content_type), (fmt, headers)
        assert headers.get("transfer-encoding") == "chunked"
        if fmt == "pcm":  # OpenAI's pcm: 24 kHz, no header
            pcm, rate = np.frombuffer(body, dtype="<i2"), 24000
        elif fmt == "wav":
            with wave.open(io.BytesIO(body)) as w:
                pcm, rate = np.frombuffer(w.readframes(10**9), dtype=np.int16), w.getframerate()
        else:
            pcm, rate = decode(body)
        if fmt in ("wav", "pcm", "flac", "opus"):  # lossless, or Opus, which the tone decoder reads
            assert tone.decode(pcm, rate) == TEXT, fmt
        # Lossy codecs pad: their encoder's delay, and a last frame.
        assert symbols_s - 0.05 < len(pcm) / rate < symbols_s + 0.15, fmt


async def test_server_sent_events_carry_the_audio_and_end_with_done(tone_server):
    headers, body, _ = await speech(tone_server.url, response_format="pcm", stream_format="sse", speed=2.0)
    assert headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in body.decode().split("\n\n") if line]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and "usage" in events[-1]
    pcm = np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), dtype="<i2")
    # speed 2.0 is the tone engine's rate 2.0: half as long.
    assert tone.decode(pcm, 24000) == TEXT
    assert events[-1]["audio_ms"] == pytest.approx(len(pcm) / 24, abs=25)


@pytest.mark.parametrize(
    "params, code",
    [
        ({"input": ""}, "invalid_field"),
        ({"input": "x" * 20001}, "text_too_long"),
        ({"voice": "nobody"}, "unknown_voice"),
        ({"response_format": "ogg"}, "invalid_field"),
        ({"response_format": {}}, "invalid_field"),
        ({"stream_format": "chunks"}, "invalid_field"),
        ({"speed": 9}, "invalid_field"),
    ],
)
async def test_bad_requests_get_the_errors_of_v1_tts(tone_server, params, code):
    with pytest.raises(openai.BadRequestError) as error:
        await speech(tone_server.url, **params)
    assert error.value.status_code == 400
    assert error.value.body["code"] == code  # the client hands over the "error" object


async def test_keys_and_the_audio_cap_are_those_of_v1_tts(server_factory):
    server = server_factory("tone", ["--api-key", "key-1", "--tts-max-audio-s", "2"])
    with pytest.raises(openai.AuthenticationError):
        await speech(server.url, key="wrong")
    headers, body, _ = await speech(server.url, key="key-1", response_format="pcm", input="a" * 200)  # 8 s of tone
    assert headers["x-max-audio-s"] == "2"
    assert len(body) / 2 / 24000 <= 2.05


async def test_openai_client_plays_the_voice_and_its_first_byte_keeps_up_with_a_session(piper_server):
    """The issue's bound, in one run: the first byte through the openai client within 1.5x
    the session's TTFA (audio.started, server side) for the same sentences. The client is
    made once, as apps do: making one costs 20-80 ms here, before any request leaves."""
    sentences = [
        "The library opens at nine and closes at six on weekdays.",
        "Please bring your card when you borrow a book from the desk.",
        "Our garden has tomatoes, beans and a row of sunflowers.",
        "The next bus to the airport leaves in twenty minutes.",
        "My sister painted the kitchen a bright shade of yellow.",
    ]
    session_ms, openai_ms, heard = [], [], []
    reused = client(piper_server.url)
    async with RtcClient(piper_server.url) as rtc:
        for i, text in enumerate([sentences[0]] + sentences):  # the first of each is a warm-up
            rtc.send({"type": "speak", "text": text, "id": f"s{i}"})
            started = await rtc.wait_for("audio.started", id=f"s{i}")
            # Its TTFA is known: the rest of it need not play (3-4 s) before the next request.
            rtc.send({"type": "cancel"})
            ended = await rtc.wait_for_any(("utterance.interrupted", "utterance.done"), timeout=30)
            assert ended["id"] == f"s{i}"
            # The suite's own garbage (this process has run every test before this one) is collected
            # before the request, not during it: the first byte is the server's and the client's.
            gc.collect()
            gc.disable()
            try:
                headers, body, first = await speech(piper_server.url, using=reused, input=text, response_format="wav")
            finally:
                gc.enable()
            if i:
                session_ms.append(started["ttfa_ms"])
                openai_ms.append(first * 1000)
                with wave.open(io.BytesIO(body)) as w:
                    heard.append(recognize(np.frombuffer(w.readframes(10**9), dtype=np.int16), w.getframerate()))
    wer = word_error_rate(" ".join(sentences), " ".join(heard))
    print(f"pocketsphinx heard {heard}: WER {wer:.2f}")
    # Piper's noise makes each rendering differ: pocketsphinx's WER on the first three was 0.24-0.48
    # over 11 runs, on these five 0.25-0.34 over 3; audio that is not this speech (silence, a tone,
    # noise) scores 1.0.
    assert wer < 0.7
    ratio = statistics.median(openai_ms) / statistics.median(session_ms)
    print(f"first byte through openai {openai_ms} ms; session TTFA {session_ms} ms; ratio of medians {ratio:.2f}")
    assert ratio <= 1.5, (openai_ms, session_ms)
