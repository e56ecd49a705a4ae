"""A relay application's `play` (gateway/backends/relay_play.py): audio from an allowed origin is heard as an
utterance of its own, in its place between the replies, its loops and its duration bounded; what is
not allowed (another origin, a private address without --relay-allow-private), too big, endless,
or not audio gets an `error` and the conversation goes on; `interruptible` holds for it as for text.

The calls are Twilio Media Streams over a real WebSocket (tests/telephony/twilio_standin.py), and one
a real aiortc caller over WebRTC (Opus at 48 kHz); the audio a WAV and an MP3 made here and served on
loopback (tests/relay/audio_server.py)."""

from __future__ import annotations

import re

import aiohttp
import numpy as np
import pytest

from voxgate.config import ConfigError, Settings
from voxgate.gateway.media.encoder import ulaw_decode
from voxgate.gateway.backends.relay_play import PlayRefused, check_source, fetch
from voxgate.rtc_client import RtcClient

from tests.conftest import in_process_gateway
from tests.relay.audio_server import TONE_HZ, AudioServer
from tests.relay.relay_app import RelayApp
from tests.telephony.twilio_standin import TwilioStandIn

FRAME = 160  # 20 ms of the phone's 8 kHz


def tone_frames(frames: list[bytes]) -> list[bool]:
    """Per μ-law frame: whether TONE_HZ holds most of its energy (speech from the tone engine never does)."""
    t = np.arange(FRAME) / 8000
    basis = np.exp(-2j * np.pi * TONE_HZ * t)
    out = []
    for frame in frames:
        pcm = ulaw_decode(frame).astype(np.float64)
        energy = float(np.sum(pcm ** 2))
        out.append(energy > 1e6 and 2 * abs(basis @ pcm) ** 2 / FRAME > 0.5 * energy)
    return out


def marks(phone: TwilioStandIn, uid: str) -> list:
    return [m for m in phone.received.marks if m.name.split(":")[0] == uid]


def end_ms(phone: TwilioStandIn, uid: str) -> int:
    [end] = [m for m in marks(phone, uid) if m.name.endswith(":end")]
    return int(end.name.split(":")[1])


async def call(audio: AudioServer, script: list[dict], during=None, **settings) -> tuple[TwilioStandIn, RelayApp]:
    """One phone call relayed to an application that sends `script`; `during(phone)` runs while it lasts."""
    app = RelayApp(script=script)
    await app.start()
    try:
        async with in_process_gateway(relay_allow_private=True, relay_play_origin=[audio.url], relay_apology="",
                                      **settings) as (_, url):
            phone = TwilioStandIn(url, call_sid="CAplay")
            await phone.connect()
            await phone.start({"relay_url": app.url})
            try:
                if during is not None:
                    await during(phone, app)
                await phone.wait(lambda: phone.ws.closed, timeout=20)
            finally:
                await phone.close()
    finally:
        await app.stop()
    return phone, app


@pytest.fixture
async def audio():
    server = AudioServer()
    await server.start()
    yield server
    await server.stop()


async def test_a_play_is_heard_in_its_place_between_the_replies_and_loops(audio):
    script = [{"type": "text", "token": "Hello.", "last": True},
              {"type": "play", "source": audio.url + "/half.wav", "loop": 2},
              {"type": "text", "token": "Bye.", "last": True},
              {"type": "end", "handoffData": "{}"}]
    phone, app = await call(audio, script)
    assert app.of_type("error") == [] and app.invalid == []
    assert 950 <= end_ms(phone, "p1") <= 1050  # 0.5 s, twice
    frames = [m for _, m in phone.received.media]
    heard = tone_frames(frames)
    played = [i for i, is_tone in enumerate(heard) if is_tone]
    assert 40 <= len(played) <= 52, len(played)  # most of its 50 frames (the first and last are partly silence)
    # In its place: after the greeting's reply ended, before the next began.
    hello_end = [m for m in marks(phone, "r1") if m.name.endswith(":end")][0].frames_before
    first = marks(phone, "r2")[0]
    bye_first = first.frames_before - int(first.name.split(":")[1]) // 20  # a mark says how far into r2 it is
    assert hello_end - 2 <= played[0] and played[-1] <= bye_first + 2, (hello_end, played[0], played[-1], bye_first)
    assert audio.requests == ["/half.wav"]


async def test_what_is_too_big_endless_or_not_audio_is_refused_and_the_call_goes_on(audio):
    script = [{"type": "play", "source": audio.url + "/tone.mp3", "loop": 0},  # until interrupted: the cap ends it
              {"type": "play", "source": audio.url + "/big.wav"},
              {"type": "play", "source": audio.url + "/endless.wav"},
              {"type": "play", "source": audio.url + "/garbage.wav"},
              {"type": "play", "source": audio.url + "/image.png"},
              {"type": "play", "source": "https://elsewhere.example/a.mp3"},
              {"type": "play", "source": audio.url + "/half.wav", "loop": -1},
              {"type": "text", "token": "Still here.", "last": True},
              {"type": "end", "handoffData": "{}"}]
    phone, app = await call(audio, script, relay_play_max_s=1.5, relay_play_max_bytes=1 << 20)
    errors = [e["description"] for e in app.of_type("error")]
    expected = ["https://elsewhere.example is not an origin this server fetches audio from",
                "'play.loop' must be an integer", "big.wav: the audio is", "endless.wav: the audio is over 1048576 bytes",
                "garbage.wav: the audio could not be decoded", "image.png: the file is not audio"]
    assert len(errors) == len(expected), errors
    for want in expected:
        assert [e for e in errors if want in e], (want, errors)
    assert 1450 <= end_ms(phone, "p1") <= 1550  # the MP3 (0.6 s) looped until --relay-play-max-s
    assert [end_ms(phone, uid) for uid in ("p2", "p3", "p4", "p5")] == [0, 0, 0, 0]
    assert end_ms(phone, "r1") > 0  # the conversation went on
    assert "/big.wav" in audio.requests and audio.requests.count("/endless.wav") == 1


async def test_interruptible_false_keeps_a_key_from_cutting_a_play_and_true_lets_it(audio):
    script = [{"type": "play", "source": audio.url + "/half.wav", "loop": 0, "interruptible": False},
              {"type": "play", "source": audio.url + "/half.wav", "loop": 0}]

    async def press_during(phone: TwilioStandIn, app: RelayApp) -> None:
        for uid in ("p1", "p2"):
            await phone.wait(lambda uid=uid: any(m.name == f"{uid}:400" for m in phone.received.marks))
            await phone.send({"event": "dtmf", "streamSid": phone.stream_sid, "dtmf": {"track": "inbound_track", "digit": "1"}})
        await app.wait(lambda: app.of_type("interrupt"))
        await phone.stop()

    phone, app = await call(audio, script, during=press_during, relay_play_max_s=2.0)
    assert end_ms(phone, "p1") == 2000  # played on, to the cap, through the key
    [interrupt] = app.of_type("interrupt")
    assert 400 <= interrupt["durationUntilInterruptMs"] < 1500 and interrupt["utteranceUntilInterrupt"] == ""
    assert phone.received.clears and not [m for m in marks(phone, "p2") if m.name.endswith(":end")]  # cut


async def test_the_fetch_passes_the_outbound_guard_and_only_allowed_origins(audio):
    port = re.search(r":(\d+)$", audio.url).group(1)  # type: ignore[union-attr]
    guarded = Settings(relay_play_origin=[audio.url, f"http://localhost:{port}"])
    for url in (audio.url + "/half.wav", f"http://localhost:{port}/half.wav", "http://[::ffff:127.0.0.1]/x.wav"):
        with pytest.raises(PlayRefused, match="private address"):
            await fetch(url, guarded)
    assert audio.requests == []  # never reached
    assert len(await fetch(audio.url + "/half.wav", Settings(relay_allow_private=True))) > 16000
    with pytest.raises(PlayRefused, match="no --relay-play-origin"):
        check_source(audio.url + "/half.wav", [])
    with pytest.raises(PlayRefused, match="not an origin this server"):
        check_source("http://127.0.0.1:1/half.wav", [audio.url])
    with pytest.raises(PlayRefused, match="http:// or https://"):
        check_source("file:///etc/passwd", [audio.url])
    assert check_source(audio.url.upper().replace("HTTP", "http") + "/x.wav", [audio.url + "/"])
    for origin in ("https://cdn.example/path", "ftp://cdn.example", "cdn.example", "https://u:p@cdn.example"):
        with pytest.raises(ConfigError, match="--relay-play-origin"):
            Settings(relay_play_origin=[origin]).check()


async def test_a_play_is_heard_by_a_webrtc_caller(audio):
    app = RelayApp(script=[{"type": "play", "source": audio.url + "/half.wav", "loop": 2}])
    await app.start()
    try:
        async with in_process_gateway(relay_allow_private=True, relay_play_origin=[audio.url]) as (_, url):
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/sessions", json={"relay": {"url": app.url}}) as resp:
                    made = await resp.json()
            caller = RtcClient(url, session_id=made["session_id"], token=made["client_token"])
            try:
                await caller.connect()
                started = await caller.wait_for("utterance.started", id="p1")
                frames = await caller.wait_frames_after(started, 45)
                done = await caller.wait_for("utterance.done", id="p1")
            finally:
                await caller.close()
    finally:
        await app.stop()
    pcm = np.concatenate(frames[5:45]).astype(np.float64)  # past Opus's first frames, within the second played
    spectrum = np.abs(np.fft.rfft(pcm))
    assert abs(np.argmax(spectrum) * 48000 / len(pcm) - TONE_HZ) < 5
    assert np.sqrt(np.mean(pcm ** 2)) > 3000  # the tone (12,000 peak) heard, not a trace of it
    assert done["audio_ms"] == 1000 and app.of_type("error") == []
