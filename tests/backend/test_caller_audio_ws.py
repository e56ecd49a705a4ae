"""The caller's audio to the backend (`?audio=pcm16`), from a real aiortc peer's microphone on loopback.

The client's microphone plays tone bursts and remembers when it handed each
20 ms frame to aiortc; the backend, through voxgate.client, receives the
frames with their sequence numbers and capture times. Each burst's onset must
land where the client sent it, on the session's clock, within 40 ms.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import aiohttp
import numpy as np
import pytest

from voxgate.client import VoxgateError, VoxgateSession
from voxgate.rtc_client import MicTrack, RtcClient

from tests.listening import bursts, onset_times

FRAME_S = 0.020


class RecordingMic(MicTrack):
    """The test client's microphone, remembering each frame it handed to aiortc and when."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[float, np.ndarray]] = []

    async def recv(self):
        frame = await super().recv()
        self.sent.append((time.perf_counter(), frame.to_ndarray().reshape(-1).copy()))
        return frame


async def open_with_origin(backend: VoxgateSession) -> float:
    """Opens the backend's session; returns where the session clock's zero lies on this
    machine's perf_counter, from session.ready's `at_ms` (late by the WebSocket's delivery)."""
    await backend.open()
    return time.perf_counter() - backend.ready["at_ms"] / 1000.0


def alignment_errors_ms(sent: list[float], received: list[float]) -> list[float]:
    assert len(received) == len(sent), (len(sent), len(received))
    return [(r - s) * 1000.0 for s, r in zip(sent, received)]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def caught_up(frames: list, origin: float, until: float, timeout: float = 10.0) -> None:
    """Wait until the backend has frames captured up to `until` (perf_counter)."""
    deadline = time.monotonic() + timeout
    while not frames or origin + frames[-1].capture_ms / 1000.0 < until:
        assert time.monotonic() < deadline, f"the backend has {len(frames)} frames, not up to the end of what was sent"
        await asyncio.sleep(0.02)


async def collect(backend: VoxgateSession, into: list) -> None:
    async for frame in backend.caller_frames():
        into.append(frame)


async def test_a_webrtc_callers_audio_reaches_the_backend_in_order_on_the_session_clock(tone_server):
    backend = VoxgateSession(tone_server.url, caller_audio=True)
    origin = await open_with_origin(backend)
    frames: list = []
    reader = asyncio.ensure_future(collect(backend, frames))
    client = RtcClient(tone_server.url, mic=True, session_id=backend.session_id, token=backend.client_token)
    client.mic = RecordingMic()
    try:
        await client.connect()
        # The capture clock places the caller's media clock by the fastest packet so far (clock.py), so
        # it learns that a call's first packets came late (handshakes, a busy loop) only when a faster one
        # arrives: the placement may step back once, early. Measured from 1 s into the call; from there
        # the frames must keep 20 ms apart.
        await caught_up(frames, origin, time.perf_counter() + 1.0, timeout=15.0)
        settled = len(frames)
        signal = bursts(48000)
        client.mic.play(signal)
        while client.mic.busy:
            await asyncio.sleep(0.05)
        # The last burst's frames, plus the jitter buffer's worth, have reached the backend.
        await caught_up(frames, origin, client.mic.sent[-1][0] - 0.1)
    finally:
        await client.close()
        await backend.close()
        reader.cancel()
    # In order and complete: consecutive sequence numbers, capture times 20 ms apart.
    seqs = [f.seq for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    steps = np.diff([f.capture_ms for f in frames[settled:]])
    assert np.all(np.abs(steps - 20) <= 3), steps[np.abs(steps - 20) > 3]
    assert all(len(f.pcm) == 640 for f in frames)
    # Each burst where the client sent it: a microphone hands a frame over once it is whole,
    # so its first sample was captured 20 ms before.
    sent = onset_times([(t - FRAME_S, pcm) for t, pcm in client.mic.sent], 48000)
    received = onset_times([(origin + f.capture_ms / 1000.0, f.samples()) for f in frames], 16000)
    errors = alignment_errors_ms(sent, received)
    print(f"\ncaller audio over WebRTC: {len(frames)} frames, burst onsets on the session clock "
          f"{min(errors):+.1f} to {max(errors):+.1f} ms from where the client sent them")
    assert len(sent) == 6
    assert max(abs(e) for e in errors) <= 40.0, errors


async def test_only_the_key_that_owns_the_session_gets_its_audio(server_factory):
    server = server_factory("tone", env={"VOXGATE_API_KEY": "key-a,key-b"})
    async with VoxgateSession(server.url, api_key="key-a") as owner:
        with pytest.raises(VoxgateError) as refused:
            await VoxgateSession(server.url, api_key="key-b", session_id=owner.session_id, caller_audio=True).open()
        assert refused.value.status == 404
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as http:
            url = f"{server.url}/v1/sessions/{owner.session_id}/ws?audio=opus"
            async with http.get(url) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_field"
