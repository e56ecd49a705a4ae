"""The speech track's RTP sender (gateway/media/rtp_send.py): aiortc's packets, built from a template.

The packet bytes are checked against aiortc's own `RtpPacket.serialize` for the
same header fields; the sender over a real loopback peer is checked from the
listening side (exact audio, and RTCP sender reports that count what arrived).
"""

from __future__ import annotations

import asyncio

import pytest
from aiortc import RTCRtpSender
from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters, RTCRtpParameters
from aiortc.rtp import HeaderExtensionsMap, RtcpSrPacket, RtpPacket

from voxgate.engine import tone
from voxgate.gateway.media import rtp_send
from voxgate.rtc_client import RtcClient

MID_URI = "urn:ietf:params:rtp-hdrext:sdes:mid"
ABS_URI = "http://www.webrtc.org/experiments/rtp-hdrext/abs-send-time"


def extensions_map(*uris: str) -> HeaderExtensionsMap:
    m = HeaderExtensionsMap()
    m.configure(RTCRtpParameters(headerExtensions=[RTCRtpHeaderExtensionParameters(id=i + 1, uri=u) for i, u in enumerate(uris)]))
    return m


def aiortc_bytes(ext_map, payload: bytes, pt: int, seq: int, ts: int, ssrc: int, mid: str | None, ntp: int) -> bytes:
    packet = RtpPacket(payload_type=pt, sequence_number=seq, timestamp=ts, ssrc=ssrc, marker=1, payload=payload)
    packet.extensions.abs_send_time = (ntp >> 14) & 0x00FFFFFF
    packet.extensions.mid = mid
    return packet.serialize(ext_map)


@pytest.mark.parametrize("uris", [(MID_URI, ABS_URI), (ABS_URI, MID_URI), (MID_URI,), (ABS_URI,), ()])
# "\x124V" is the bytes 12 34 56: a peer's mid that holds the probe header_template looks for.
@pytest.mark.parametrize("mid", ["0", "audio-mid-17", "", "\x124V", "m\u00efd"])
def test_packets_are_byte_for_byte_what_aiortc_writes(uris, mid):
    ext_map = extensions_map(*uris)
    writer = rtp_send.PacketWriter(payload_type=111, ssrc=0xDEADBEEF, extensions_map=ext_map, mid=mid)
    for seq, ts, ntp, payload in [
        (0, 0, 0, b"\xf8\xff\xfe"),
        (65535, 0xFFFFFFFF, rtp_send.ntp_now(), bytes(range(80))),
        (1234, 960 * 77, (1 << 63) + 12345678901, b"x" * 160),
    ]:
        assert writer.packet(payload, seq, ts, ntp) == aiortc_bytes(ext_map, payload, 111, seq, ts, 0xDEADBEEF, mid, ntp)


def test_ntp_now_is_aiortcs_clock():
    from aiortc import clock

    before = clock.current_ntp_time()
    ours = rtp_send.ntp_now()
    after = clock.current_ntp_time()
    # aiortc's clock goes through datetime, rounded to whole microseconds.
    slack = 2 * (1 << 32) // 1_000_000
    assert before - slack <= ours <= after + slack


def test_an_aiortc_without_the_sender_state_keeps_its_own_loop(caplog):
    class Bare:
        _ssrc = 1

    assert not rtp_send.install(Bare(), track=None)
    assert "using aiortc's loop" in caplog.text


async def test_this_aiortc_has_the_state():
    """Red when an aiortc upgrade renames what the sender keeps: the gateway would fall back silently."""
    from aiortc.rtcdtlstransport import RTCCertificate, RTCDtlsTransport
    from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport

    dtls = RTCDtlsTransport(RTCIceTransport(RTCIceGatherer()), [RTCCertificate.generateCertificate()])
    assert rtp_send.supported(RTCRtpSender("audio", dtls))


def spy_sender_reports(client: RtcClient) -> asyncio.Queue:
    """The sender reports (RTCP SR) that reach the client's audio receiver, as they arrive."""
    receiver = next(t.receiver for t in client.pc.getTransceivers() if t.kind == "audio")
    reports: asyncio.Queue = asyncio.Queue()
    handle = receiver._handle_rtcp_packet

    async def spy(packet) -> None:
        await handle(packet)
        if isinstance(packet, RtcpSrPacket):
            reports.put_nowait(packet.sender_info)

    receiver._handle_rtcp_packet = spy
    return reports


class Track:
    stopped = False

    def stop(self) -> None:
        self.stopped = True

    async def next_payload(self):  # pragma: no cover - never reached
        raise AssertionError("no payload is asked for when the header cannot be made")


async def test_a_header_the_template_cannot_make_ends_this_tracks_sending_cleanly():
    """A peer's mid too long for a header extension: aiortc's serialize would fail on every
    packet; here sending ends at once, the track stops, and RTCRtpSender.stop() still returns."""
    from aiortc.rtcdtlstransport import RTCCertificate, RTCDtlsTransport
    from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    sender = RTCRtpSender("audio", RTCDtlsTransport(RTCIceTransport(RTCIceGatherer()), [RTCCertificate.generateCertificate()]))
    ext_map = extensions_map(MID_URI)
    sender._RTCRtpSender__rtp_header_extensions_map = ext_map
    sender._RTCRtpSender__mid = "m" * 300
    track = Track()
    codec = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
    await asyncio.wait_for(rtp_send.RtpSender(sender, track, codec).run(), 5)
    assert track.stopped and sender._RTCRtpSender__rtp_exited.is_set()


def test_sequence_numbers_start_in_the_lower_half():
    """As aiortc's: a wrap soon after the start breaks SRTP decryption at some receivers."""
    starts = {rtp_send.RtpSender(RTCRtpSender.__new__(RTCRtpSender), Track(), None).sequence for _ in range(200)}
    assert max(starts) < 0x8000 and len(starts) > 100


@pytest.mark.parametrize("sender", ["voxgate", "aiortc"])
async def test_speech_over_either_sender_decodes_exactly_and_rtcp_counts_it(server_factory, sender):
    server = server_factory("tone", extra=["--rtp-sender", sender])
    async with RtcClient(server.url) as client:
        reports = spy_sender_reports(client)
        text = "Packets from a template."
        sent = client.send({"type": "speak", "text": text, "id": "p"})
        done = await client.wait_for("utterance.done", id="p", timeout=30)
        await client.wait_tail(done)
        assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == text
        # aiortc's RTCP loop reports what the sender counted: at least the utterance's frames
        # (silence before it counts too), and 3 bytes or more a packet.
        frames = done["audio_ms"] // 20
        while True:
            info = await asyncio.wait_for(reports.get(), 10)
            if info.packet_count >= frames:
                break
        assert info.octet_count >= 3 * info.packet_count


async def test_the_direct_wire_sends_what_aiortcs_path_would_and_declines_where_it_differs():
    """SRTP-protected on the nominated pair's socket, with the DTLS transport's counters; False
    (nothing sent) when not connected, without a pair, or on a protocol of another kind."""
    import os
    from types import SimpleNamespace

    from aioice.ice import StunProtocol
    from aiortc.rtcdtlstransport import State
    from pylibsrtp import Policy, Session

    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()

    class Listener(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            arrived.put_nowait(data)

    listener, _ = await loop.create_datagram_endpoint(Listener, local_addr=("127.0.0.1", 0))
    transport, protocol = await loop.create_datagram_endpoint(lambda: StunProtocol(None), local_addr=("127.0.0.1", 0))
    try:
        key = os.urandom(30)
        profile = Policy.SRTP_PROFILE_AES128_CM_SHA1_80
        tx = Session(Policy(key=key, ssrc_type=Policy.SSRC_ANY_OUTBOUND, srtp_profile=profile))
        rx = Session(Policy(key=key, ssrc_type=Policy.SSRC_ANY_INBOUND, srtp_profile=profile))
        pair = SimpleNamespace(protocol=protocol, remote_addr=listener.get_extra_info("sockname")[:2])
        connection = SimpleNamespace(_nominated={1: pair})
        dtls = SimpleNamespace(transport=SimpleNamespace(_connection=connection), _state=State.CONNECTED, _tx_srtp=tx,
                               _RTCDtlsTransport__tx_bytes=0, _RTCDtlsTransport__tx_packets=0)
        send = rtp_send.direct_wire(dtls)
        packet = rtp_send.PacketWriter(payload_type=111, ssrc=7, extensions_map=extensions_map(), mid=None).packet(
            b"\xf8\xff\xfe", 1, 960, 0)
        assert send(packet)
        wire = await asyncio.wait_for(arrived.get(), 5)
        assert rx.unprotect(wire) == packet
        assert (dtls._RTCDtlsTransport__tx_packets, dtls._RTCDtlsTransport__tx_bytes) == (1, len(wire))
        rtcp_like = rtp_send.PacketWriter(payload_type=72, ssrc=7, extensions_map=extensions_map(), mid=None).packet(
            b"\xf8", 2, 1920, 0)
        assert not send(rtcp_like)  # aiortc's _send_rtp would protect it as RTCP (RFC 5761)
        dtls._state = State.CLOSED
        assert not send(packet)
        dtls._state = State.CONNECTED
        pair.protocol = SimpleNamespace(transport=transport)  # not aioice's StunProtocol
        assert not send(packet)
        connection._nominated.clear()
        assert not send(packet)
        assert dtls._RTCDtlsTransport__tx_packets == 1 and arrived.empty()
    finally:
        transport.close()
        listener.close()


async def test_this_aiortc_has_what_the_direct_wire_reads():
    """Red when an aiortc or aioice upgrade renames it: every packet would take the slow path silently."""
    from aiortc.rtcdtlstransport import RTCCertificate, RTCDtlsTransport
    from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport

    dtls = RTCDtlsTransport(RTCIceTransport(RTCIceGatherer()), [RTCCertificate.generateCertificate()])
    assert rtp_send.direct_wire(dtls) is not None


async def test_a_real_sessions_speech_leaves_by_the_direct_wire():
    """In-process gateway and an aiortc listener on loopback: every speech packet took the
    direct wire (none fell back to aiortc's coroutines), and the audio arrived exactly."""
    from tests.conftest import in_process_gateway

    async with in_process_gateway() as (app, url):
        async with RtcClient(url) as client:
            text = "Straight to the socket."
            sent = client.send({"type": "speak", "text": text, "id": "d"})
            done = await client.wait_for("utterance.done", id="d", timeout=30)
            await client.wait_tail(done)
            assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == text
            sender = next(t.sender for t in app["gateway"].peers[client.session_id].pc.getTransceivers())
            rtp = sender.voxgate_rtp
            assert rtp.packets >= done["audio_ms"] // 20 and rtp.direct_packets == rtp.packets
