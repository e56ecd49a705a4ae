"""A connected aiortc peer's own SRTP, sent by hand: what the listening-path attacks of issue 53 send.

`RtpFlood(client)` protects RTP packets with the client's session keys and
sends them on its nominated ICE pair, the way the peer's own microphone
packets go, except that what is in them is the caller's choice: a new SSRC
for every packet (`ssrc_flood`), more packets than real time, or packets that
jump ahead in RTP time (`packets`). The sender's libsrtp stream for each
one-off SSRC is removed at once, so the attacker's own cost stays flat.
tests/security and bench/bench_listening_flood.py use it; it reads aiortc's
private state, as a test may.
"""

from __future__ import annotations

import random
import re
import struct


def rtp_packet(ssrc: int, seq: int, ts: int, payload: bytes, pt: int) -> bytes:
    return struct.pack("!BBHII", 0x80, pt, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc & 0xFFFFFFFF) + payload


async def silent_caller(url: str, tries: int = 1, **join):
    """A connected RtcClient whose microphone track never sends a packet: the caller's packets are
    RtpFlood's alone. `tries`: offers refused (503: a busy shared machine) are made again, a second apart.
    `join`: RtcClient's session_id and token, for a session made ahead."""
    from voxgate.rtc_client import RtcClient

    return await connected(lambda: _silent(RtcClient(url, mic=True, **join)), tries)


def _silent(client):
    client.mic.stop()  # aiortc's sender ends at its first recv(), before a packet
    return client


async def connected(make, tries: int):
    """`make()`'s RtcClient, connected; an offer refused with 503 is made again, a second apart, up to `tries` times."""
    import asyncio

    from voxgate.rtc_client import OfferRefused

    for attempt in range(tries):
        client = make()
        try:
            await client.connect()
            return client
        except OfferRefused as exc:
            await client.close()
            if exc.status != 503 or attempt == tries - 1:
                raise
            await asyncio.sleep(1.0)


class RtpFlood:
    def __init__(self, client, seed: int = 53) -> None:
        transceiver = client.pc.getTransceivers()[0]
        self.dtls = transceiver.sender.transport
        self.rng = random.Random(seed)
        # The peer's own, negotiated microphone SSRC: `packets` needs a client whose track never sent
        # (`silent_caller`), or the two streams' sequence numbers would clash.
        self.ssrc = transceiver.sender._ssrc
        # Opus's payload type, as the answer has it.
        self.pt = int(re.search(r"a=rtpmap:(\d+) opus/48000", client.pc.remoteDescription.sdp, re.I).group(1))
        self.seq = self.rng.randrange(1 << 16)
        self.ts = self.rng.randrange(1 << 32)
        self.sent = 0
        self.lost = 0  # packets not sent: the connection was gone

    def _send(self, data: bytes) -> None:
        pair = self.dtls.transport._connection._nominated.get(1)
        if pair is None or pair.protocol.transport is None:
            self.lost += 1  # the gateway closed the session (the code before the fixes did, under a flood)
            return
        pair.protocol.transport.sendto(data, pair.remote_addr)
        self.sent += 1

    def ssrc_flood(self, count: int, payload: bytes) -> list[int]:
        """`count` packets, each from a new random SSRC, protected with the session's keys; their SSRCs."""
        tx = self.dtls._tx_srtp
        ssrcs = []
        for _ in range(count):
            ssrc = self.rng.randrange(1, 1 << 32)
            # Each flood SSRC is a new SRTP stream with a sequence number of its own. Sharing the microphone's
            # counter moved it on by the flood's count, and its next packets looked 120k packets old to libsrtp's
            # sender replay check ("index too old"): the bench's attacker died in its second round.
            self.ts += 960
            self._send(tx.protect(rtp_packet(ssrc, self.rng.randrange(1 << 16), self.ts, payload, self.pt)))
            tx.remove_stream(ssrc)  # the attacker's own side stays one stream
            ssrcs.append(ssrc)
        return ssrcs

    def packets(self, count: int, payload: bytes, step: int = 960) -> None:
        """`count` packets from the peer's microphone SSRC, each `step` ticks of RTP time after the last
        (960: 20 ms of Opus, as a microphone; 48000: each a second ahead)."""
        tx = self.dtls._tx_srtp
        for _ in range(count):
            self.seq += 1
            self.ts += step
            self._send(tx.protect(rtp_packet(self.ssrc, self.seq, self.ts, payload, self.pt)))
