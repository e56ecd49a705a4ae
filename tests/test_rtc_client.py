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
