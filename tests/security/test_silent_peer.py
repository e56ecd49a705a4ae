"""Issue 39, finding 4: a peer that never acknowledges its data channel, and messages the
gateway refuses, cannot keep a session (and the gateway's memory) growing.

The peer is a real aiortc client over loopback whose SCTP drops every DATA chunk the
gateway sends and so never acknowledges one (its `_receive_data_chunk` made a no-op: the
one thing faked here, the misbehaving peer), while it sends pings as fast as it likes.
"""

from __future__ import annotations

import asyncio
import time

from tests.conftest import in_process_gateway
from voxgate.rtc_client import RtcClient

CAP_KB = 64


async def _never_acknowledge(chunk) -> None:
    return None  # dropped: no DATA is delivered, so no SACK is ever due


async def test_a_peer_that_never_acknowledges_is_closed_at_its_buffer_cap():
    async with in_process_gateway(max_channel_buffer_kb=CAP_KB) as (app, url):
        gw = app["gateway"]
        async with RtcClient(url) as client:
            sid = client.session_id
            session = gw.sessions[sid]
            channel = gw.peers[sid].channel
            client.pc.sctp._receive_data_chunk = _never_acknowledge
            peak = 0
            deadline = time.monotonic() + 30
            n = 0
            while not session.closed_event.is_set() and time.monotonic() < deadline:
                for _ in range(50):
                    client.send({"type": "ping", "t": n})
                    n += 1
                peak = max(peak, channel.bufferedAmount)
                await asyncio.sleep(0.01)  # the client's loop sends them; the gateway shares it
            assert session.closed_event.is_set(), f"still open after {n} pings, {channel.bufferedAmount} bytes unread"
            assert sid not in gw.sessions
            # It closed at the cap: one event past it at most (a pong or an error is under 200 bytes).
            assert peak <= CAP_KB * 1024 + 200, peak


async def test_refused_messages_do_not_keep_a_session_alive():
    async with in_process_gateway(idle_timeout_s=2.0) as (app, url):
        gw = app["gateway"]
        async with RtcClient(url) as client:
            sid = client.session_id
            session = gw.sessions[sid]
            started = time.monotonic()
            while not session.closed_event.is_set() and time.monotonic() - started < 15:
                client.send("this is not JSON")  # refused with an error event, every time
                await asyncio.sleep(0.05)
            assert session.closed_event.is_set(), "refused messages kept the session alive"
            # The reaper looks every second: closed about one idle timeout after connecting.
            assert time.monotonic() - started < 2.0 + 3.0
