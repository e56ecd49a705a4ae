"""Issue 53, finding 1: a connected peer that protects every RTP packet with its own keys under a new SSRC.

libsrtp adds a stream for every SSRC whose packet authenticates and searches
them one by one for every later packet, so before the fix each such packet
made the session's every later packet dearer, and its memory grew until the
session ended. A real aiortc peer on loopback floods its own session; the
gateway's inbound SRTP session is then asked, SSRC by SSRC, whether it holds a
stream (libsrtp refuses to remove one it does not): only --max-ssrcs of them
may, and the peer's own microphone packets are still read. A peer without a
microphone (recvonly) gets none of its RTP decrypted at all.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import numpy as np
import pylibsrtp

from voxgate.gateway.media import opus
from voxgate.rtc_client import RtcClient
from tests.conftest import in_process_gateway
from tests.security.rtp_flood import RtpFlood


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.01)

FLOOD = 2000


def streams_held(rx: pylibsrtp.Session, ssrcs: list[int]) -> int:
    """How many of `ssrcs` the gateway's inbound SRTP session holds a stream for (removing them)."""
    held = 0
    for ssrc in ssrcs:
        try:
            rx.remove_stream(ssrc)
            held += 1
        except pylibsrtp.Error:
            pass
    return held


async def test_an_ssrc_flood_adds_no_srtp_streams_and_the_microphone_is_still_heard():
    silence = opus.Encoder(48000, 32000, 5, False, 0, False).encode(np.zeros(960, dtype=np.int16))[0]
    async with in_process_gateway(max_ssrcs=4) as (app, url):
        async with RtcClient(url, mic=True) as caller, RtcClient(url) as listener:
            gateway = app["gateway"]
            # The caller floods its own session; a listener without a microphone floods its own.
            flood, quiet = RtpFlood(caller), RtpFlood(listener)
            flood_ssrcs: list[int] = []
            quiet_ssrcs: list[int] = []
            for _ in range(FLOOD // 50):  # in bursts the gateway's socket buffer holds
                flood_ssrcs += flood.ssrc_flood(50, silence)
                quiet_ssrcs += quiet.ssrc_flood(5, silence)
                await asyncio.sleep(0.005)
            peer = gateway.peers[caller.session_id]
            # The caller's own microphone packets still arrive and are read (after the flood's, in order).
            heard = peer.mic.packets
            await until(lambda: peer.mic.packets >= heard + 25)
            rx = peer.mic.receiver.transport._rx_srtp
            assert len(peer.ssrcs.known) <= 4
            assert streams_held(rx, flood_ssrcs) <= 4 - 1  # the peer's own microphone SSRC holds one
            assert streams_held(gateway.peers[listener.session_id].pc.getTransceivers()[0].sender.transport._rx_srtp,
                                quiet_ssrcs) == 0
            async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
                text = await resp.text()
    dropped = float(re.search(r'^voxgate_mic_dropped_total\{reason="ssrc"\} (\S+)$', text, re.M).group(1))
    assert dropped >= FLOOD // 2  # not all: loopback may lose some
