"""gateway/webrtc/silence.py: a connected peer whose path is cut ends its session with a reason within
--peer-silence-timeout-s, not after aioice's ~30 s consent timeout; a connected idle peer stays.

Real aiortc peers over UDP on loopback, the tone engine, in the test's own loop. The cut is made in
the client: its ICE sockets stop reading and sending, and nothing (no DTLS close, no SCTP abort)
tells the gateway, as when a phone leaves Wi-Fi."""

import asyncio
import logging
import time

from tests.conftest import in_process_gateway
from voxgate.gateway.media import rtc_internals
from voxgate.gateway.webrtc.silence import PeerSilence
from voxgate.rtc_client import RtcClient

# An idle aiortc client sends an RTCP receiver report every 0.5-1.5 s (measured: longest gap 1.47 s
# in 15 s), so 3 s trips on a live one only past a 1.5 s stall of the shared loop; aioice's consent
# timeout would take ~30 s.
TIMEOUT_S = 3.0
MARGIN_S = 3.0  # for a loaded machine: the close is due at most TIMEOUT_S after the cut


def cut(client: RtcClient) -> None:
    """The client's network gone both ways, without a word to the gateway."""
    for connection in rtc_internals.ice_connections(client.pc):
        for protocol in connection._protocols:
            protocol.transport.pause_reading()
            protocol.transport.sendto = lambda data, addr=None: None


async def test_a_peer_whose_path_is_cut_is_closed_with_a_reason_and_an_idle_one_stays(caplog):
    caplog.set_level(logging.INFO, logger="voxgate.gateway.webrtc.peer")
    async with in_process_gateway(peer_silence_timeout_s=TIMEOUT_S) as (app, url):
        sessions = app["gateway"].sessions
        async with RtcClient(url) as idle, RtcClient(url) as lost:
            idle_since = time.monotonic()
            closed: dict[str, dict] = {}
            for client in (idle, lost):
                sessions[client.session_id].add_listener(
                    "test", lambda event, sid=client.session_id: closed.setdefault(sid, event)
                    if event["type"] == "session.closed" else None)
            idle_session, lost_session = sessions[idle.session_id], sessions[lost.session_id]
            cut_at = time.monotonic()
            cut(lost)
            await asyncio.wait_for(lost_session.closed_event.wait(), TIMEOUT_S + MARGIN_S)
            took = time.monotonic() - cut_at
            assert closed[lost.session_id]["reason"] == "peer silent"
            assert TIMEOUT_S / 2 < took <= TIMEOUT_S + MARGIN_S, took

            # The idle client, heard from all along, stays open past the timeout.
            wait = max(0.0, 1.25 * TIMEOUT_S - (time.monotonic() - idle_since))
            closing = asyncio.ensure_future(idle_session.closed_event.wait())
            done, _ = await asyncio.wait([closing], timeout=wait)
            closing.cancel()
            assert not done and not idle_session.closed, closed.get(idle.session_id)
            assert time.monotonic() - idle_since > 1.2 * TIMEOUT_S

    lines = [r for r in caplog.records if "nothing from the peer" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None, [r.getMessage() for r in lines]


async def test_the_watchdog_fires_once_after_the_last_datagram_and_not_while_heard_or_once_stopped():
    fired: list[float] = []
    done = asyncio.Event()

    def on_silent(seconds: float) -> None:
        fired.append(seconds)
        done.set()

    silence = PeerSilence(0.2, on_silent)
    silence.start()
    for _ in range(12):  # datagrams every 30 ms for 1.8 timeouts
        await asyncio.sleep(0.03)
        silence.heard()
    last = time.monotonic()
    assert fired == []
    await asyncio.wait_for(done.wait(), 5)
    assert time.monotonic() - last >= 0.2 and fired[0] >= 0.2, fired
    await asyncio.sleep(0.3)
    assert len(fired) == 1  # once: the session closes

    stopped = PeerSilence(0.05, on_silent)
    stopped.start()
    stopped.stop()
    await asyncio.sleep(0.15)
    assert len(fired) == 1
