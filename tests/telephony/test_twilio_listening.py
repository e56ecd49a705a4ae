"""The listening half on a phone call: the caller's μ-law audio reaches the backend as 16 kHz frames.

The Twilio stand-in sends known audio and remembers when it sent each frame;
the backend takes the caller's audio through voxgate.client. Also: a backend
that stops reading loses frames (gaps, counted in /metrics), not memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time

import aiohttp
import numpy as np
from aiohttp import web

from voxgate.client import VoxgateSession
from voxgate.config import Settings
from voxgate.gateway.media.encoder import ulaw_decode
from voxgate.signaling.server import create_app

from tests.conftest import free_port
from tests.listening import bursts, onset_times
from twilio_standin import FRAME_S, TwilioStandIn


async def _call_with_audio(url: str) -> tuple[VoxgateSession, float, TwilioStandIn]:
    backend = VoxgateSession(url, caller_audio=True)
    await backend.open()
    origin = time.perf_counter() - backend.ready["at_ms"] / 1000.0
    phone = TwilioStandIn(url)
    await phone.connect()
    await phone.start({"session_id": backend.session_id, "token": backend.client_token})
    await backend.wait_for("call.started")
    return backend, origin, phone


async def test_a_callers_audio_reaches_the_backend_in_order_on_the_session_clock(tone_server):
    backend, origin, phone = await _call_with_audio(tone_server.url)
    frames: list = []
    reader = asyncio.ensure_future(_collect(backend, frames))
    try:
        await phone.send_audio(bursts(8000))
        last_sent = phone.sent_media[-1][0]
        deadline = time.monotonic() + 10
        while not frames or origin + frames[-1].capture_ms / 1000.0 < last_sent - 0.1:
            assert time.monotonic() < deadline, f"{len(frames)} frames reached the backend"
            await asyncio.sleep(0.02)
    finally:
        reader.cancel()
        await phone.close()
        await backend.close()
    seqs = [f.seq for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    steps = np.diff([f.capture_ms for f in frames])
    assert np.all(np.abs(steps - 20) <= 3), steps
    # Twilio sends a frame once its 20 ms have been captured.
    sent = onset_times([(t - FRAME_S, ulaw_decode(m)) for t, m in phone.sent_media], 8000)
    received = onset_times([(origin + f.capture_ms / 1000.0, f.samples()) for f in frames], 16000)
    assert len(sent) == len(received) == 6
    errors = [(r - s) * 1000 for s, r in zip(sent, received)]
    print(f"\ncaller audio over Twilio: {len(frames)} frames, burst onsets on the session clock "
          f"{min(errors):+.1f} to {max(errors):+.1f} ms from where the phone sent them")
    assert max(abs(e) for e in errors) <= 40.0, errors


def _tiny_receive_buffer(addr_info) -> socket.socket:
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


def _shrink_server_side(runner: web.AppRunner, client_port: int) -> None:
    """The gateway's end of the backend's connection keeps a small kernel buffer, as on a busy host
    (on loopback Linux grows it to megabytes, which the test would have to fill first)."""
    for handler in runner.server.connections:
        transport = handler.transport
        if transport is not None and transport.get_extra_info("peername")[1] == client_port:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            return
    raise AssertionError("the backend's connection was not found on the server")


@contextlib.asynccontextmanager
async def gateway_with_runner(**settings):
    """tests.conftest.in_process_gateway, also handing over the runner (to reach the server's sockets)."""
    app = create_app(Settings(engine="tone", host="127.0.0.1", ice_host=["127.0.0.1"], web=False, **settings))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield app, runner, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _dropped(metrics: str) -> float:
    match = re.search(r'^voxgate_caller_audio_frames_total\{outcome="dropped"\} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


async def test_a_backend_that_stops_reading_loses_frames_not_memory():
    async with gateway_with_runner(caller_audio_buffer_ms=200) as (app, runner, url):
        backend, _, phone = await _call_with_audio(url)
        kept: list = []
        keeper = asyncio.ensure_future(_collect(backend, kept))
        connector = aiohttp.TCPConnector(socket_factory=_tiny_receive_buffer)
        try:
            async with aiohttp.ClientSession(connector=connector) as http, aiohttp.ClientSession() as plain:
                # A second backend that stops reading: its window closes, then the gateway's buffers fill.
                stalled = await http.ws_connect(f"{url}/v1/sessions/{backend.session_id}/ws?audio=pcm16&role=watcher")
                _shrink_server_side(runner, stalled.get_extra_info("sockname")[1])
                loud = np.tile(bursts(8000, count=1), 40)[: 8000 * 30]
                talker = asyncio.ensure_future(phone.send_audio(loud, speed=4.0))
                deadline = time.monotonic() + 20
                while True:
                    async with plain.get(url + "/metrics") as resp:
                        if _dropped(await resp.text()) >= 50:
                            break
                    assert time.monotonic() < deadline and not talker.done(), "no frame was dropped"
                    await asyncio.sleep(0.1)
                # It reads again while the caller talks on: the loss shows as a gap in its sequence numbers.
                seqs: list[int] = []

                async def read() -> None:
                    async for msg in stalled:
                        if msg.type == aiohttp.WSMsgType.BINARY:
                            seqs.append(int.from_bytes(msg.data[:4], "little"))

                reader = asyncio.ensure_future(read())
                mark = len(phone.sent_media)
                await phone.wait(lambda: len(phone.sent_media) >= mark + 50, timeout=10)  # a second more of the call
                talker.cancel()
                deadline = time.monotonic() + 10
                while not seqs or not kept or seqs[-1] < kept[-1].seq:
                    assert time.monotonic() < deadline, "the stalled backend did not catch up"
                    await asyncio.sleep(0.05)
                reader.cancel()
                await stalled.close()
            assert not app["gateway"].sessions[backend.session_id].closed  # the call goes on
        finally:
            keeper.cancel()
            await phone.close()
            await backend.close()
    gaps = int(np.sum(np.diff(seqs) - 1))
    print(f"\nstalled backend: {len(phone.sent_media)} frames sent by the phone, {len(seqs)} reached it, "
          f"{gaps} missing from its sequence")
    assert gaps >= 50 and np.all(np.diff(seqs) >= 1)
    # The backend that kept reading lost nothing.
    assert [f.seq for f in kept] == list(range(kept[0].seq, kept[0].seq + len(kept)))


async def _collect(backend: VoxgateSession, into: list) -> None:
    async for frame in backend.caller_frames():
        into.append(frame)
