"""voxgate.rtc_client: the guarantees tests and the probe rely on, against a real server."""

from __future__ import annotations

import asyncio

import numpy as np

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient


class LaggingTrack:
    """The received track, read only once `release` is set. Decoded frames pile up
    in aiortc's queue meanwhile, as they do behind a decoder thread or an event
    loop starved of CPU (a loaded CI machine)."""

    def __init__(self, track, release: asyncio.Event) -> None:
        self.track = track
        self.release = release

    async def recv(self):
        await self.release.wait()
        return await self.track.recv()


def lagging_client(url: str) -> tuple[RtcClient, asyncio.Event]:
    """A client whose decoded frames are held back until the event is set."""
    release = asyncio.Event()
    client = RtcClient(url)
    record = client._record
    client._record = lambda track: record(LaggingTrack(track, release))
    return client, release


async def test_wait_tail_covers_decoding_that_lags_the_wire(tone_server):
    client, release = lagging_client(tone_server.url)
    async with client:
        text = "One, two, three."
        client.send({"type": "speak", "text": text, "id": "u"})
        done = await client.wait_for("utterance.done", id="u")
        assert client.audio.frames == []  # all of it is still behind
        release.set()
        await client.wait_tail(done)
        assert tone.decode(client.audio.pcm(), client.audio.sample_rate) == text


async def test_frames_after_an_event_are_those_sent_after_it_however_late_decoded(tone_server):
    client, release = lagging_client(tone_server.url)
    async with client:
        # 1.2 s of "A" symbols, then the utterance whose start is the event. All of
        # it is decoded only after audio.started of the second has arrived.
        client.send({"type": "speak", "text": "A" * 30, "id": "first"})
        client.send({"type": "speak", "text": "z" * 8, "id": "second"})
        started = await client.wait_for("audio.started", id="second")
        assert client.audio.frames == []
        release.set()
        after = await client.wait_frames_after(started, 16)  # the 320 ms of "z"
        heard = tone.decode(np.concatenate(after), client.audio.sample_rate)
        # The frame that raced the event may hold the end of the last "A".
        assert heard.count("z") >= 7 and heard.count("A") <= 1, heard


async def test_a_wav_at_any_rate_reaches_the_session_as_it_was(tone_server, tmp_path):
    """MicTrack.play_wav: a 22,050 Hz stereo file, resampled to the track's 48 kHz; the backend
    reads the caller's audio back (16 kHz, after Opus) and it decodes to the same text."""
    import wave

    from voxgate.client import VoxgateSession

    text = "Hello from a WAV, 22 kHz."
    mono = tone.encode(text, 22050)
    path = str(tmp_path / "caller.wav")
    with wave.open(path, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(22050)
        w.writeframes(np.stack([mono, mono], axis=1).astype("<i2").tobytes())
    async with VoxgateSession(tone_server.url, caller_audio=True) as backend:
        async with RtcClient(tone_server.url, mic=True, session_id=backend.session_id,
                             token=backend.client_token) as caller:
            seconds = caller.mic.play_wav(path)
            assert abs(seconds - len(mono) / 22050) < 0.01
            await asyncio.wait_for(caller.mic.played(), 10)
            heard = []
            wanted = int(seconds * 50) + 40  # its frames and some after, for the jitter buffer and Opus
            async for frame in backend.caller_frames():
                heard.append(frame.samples())
                if len(heard) >= wanted and (tone.decode(np.concatenate(heard), 16000) == text
                                             or len(heard) > 2 * wanted):
                    break
    assert tone.decode(np.concatenate(heard), 16000) == text
