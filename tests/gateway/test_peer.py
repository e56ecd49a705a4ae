"""Negotiation in gateway/webrtc/peer.py: DTX between utterances for a listener whose offer asks for it.

The end-to-end cases read the RTP timestamps of what a real aiortc listener receives
on loopback: with DTX, the packets between utterances are keep-alives 20 frames of
RTP time apart; without, one every frame. Timestamps, not arrival times, so the
check does not depend on how busy the machine is.
"""

from __future__ import annotations

import asyncio

import pytest

from voxgate.engine import tone
from voxgate.gateway.webrtc.peer import asks_for_dtx
from voxgate.gateway.media.track import KEEPALIVE_FRAMES
from voxgate.rtc_client import TAIL_FRAMES, RtcClient, offer_with_dtx

FRAME_TICKS = 960  # 20 ms at Opus's 48 kHz RTP clock

OFFER = (
    "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111 0\r\n"
    "a=rtpmap:111 opus/48000/2\r\na=fmtp:111 minptime=10;useinbandfec=1\r\na=rtpmap:0 PCMU/8000\r\n"
)


@pytest.mark.parametrize(
    ("fmtp", "asks"),
    [
        ("minptime=10;useinbandfec=1", False),
        ("minptime=10;useinbandfec=1;usedtx=1", True),
        ("usedtx=1", True),
        ("useinbandfec=1; usedtx = 1", True),
        ("usedtx=0", False),
        ("usedtx=10", False),
        ("notusedtx=1", False),
    ],
)
def test_the_offer_asks_for_dtx_only_with_usedtx_1_on_the_codecs_own_line(fmtp, asks):
    sdp = OFFER.replace("minptime=10;useinbandfec=1", fmtp)
    assert asks_for_dtx(sdp, 111) is asks
    assert asks_for_dtx(sdp, 0) is False  # another payload type's line (none here)


def test_a_client_offer_with_dtx_marks_the_opus_line_once():
    marked = offer_with_dtx(OFFER)
    assert asks_for_dtx(marked, 111)
    assert offer_with_dtx(marked) == marked
    assert offer_with_dtx(OFFER.replace("opus/48000/2", "G722/8000")) == OFFER.replace("opus/48000/2", "G722/8000")


def spy_rtp_timestamps(client: RtcClient) -> asyncio.Queue:
    """The RTP timestamp of every speech packet the client's receiver gets, as it arrives."""
    receiver = next(t.receiver for t in client.pc.getTransceivers() if t.kind == "audio")
    stamps: asyncio.Queue = asyncio.Queue()
    handle = receiver._handle_rtp_packet

    async def spy(packet, arrival_time_ms: int) -> None:
        stamps.put_nowait(packet.timestamp)
        await handle(packet, arrival_time_ms)

    receiver._handle_rtp_packet = spy
    return stamps


async def idle_gaps(client: RtcClient, stamps: asyncio.Queue, packets: int = 4) -> list[int]:
    """RTP time in frames between the packets that follow an utterance's end."""
    done = client.send({"type": "speak", "text": "Idle after this.", "id": "before"})
    await client.wait_for("utterance.done", id="before", timeout=30)
    while not stamps.empty():  # the utterance's own packets
        stamps.get_nowait()
    seen = [await asyncio.wait_for(stamps.get(), 10) for _ in range(packets + 1)]
    assert done is not None
    return [((b - a) & 0xFFFFFFFF) // FRAME_TICKS for a, b in zip(seen, seen[1:])]


@pytest.mark.parametrize(
    ("server_flags", "client_dtx", "dtx_expected"),
    [([], True, True), ([], False, False), (["--no-opus-dtx-when-asked"], True, False)],
    ids=["asked", "not-asked", "asked-but-turned-off"],
)
async def test_between_utterances_a_listener_that_asks_gets_keepalives_and_then_exact_speech(
    server_factory, server_flags, client_dtx, dtx_expected
):
    server = server_factory("tone", extra=server_flags)
    async with RtcClient(server.url, dtx=client_dtx) as client:
        stamps = spy_rtp_timestamps(client)
        gaps = await idle_gaps(client, stamps)
        if dtx_expected:
            # The first gap may still hold the utterance's last frames; then keep-alives only.
            assert all(g >= KEEPALIVE_FRAMES // 2 for g in gaps[1:]), gaps
        else:
            assert gaps == [1] * len(gaps), gaps
        # The next utterance starts at once and is heard whole.
        text = "Back from the quiet."
        sent = client.send({"type": "speak", "text": text, "id": "after"})
        done = await client.wait_for("utterance.done", id="after", timeout=30)
        # Past the event, keep-alives only where DTX is on: three of them (1.2 s) follow the last word.
        await client.wait_tail(done, tail_frames=3 if dtx_expected else TAIL_FRAMES)
        assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == text


def test_dtx_is_read_and_asked_for_in_the_audio_section_only():
    """Payload type numbers are per m-section: a video line with the same number is not Opus's."""
    video_first = (
        "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 VP8/90000\r\na=fmtp:111 usedtx=1\r\n"
        "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n"
    )
    assert not asks_for_dtx(video_first, 111)
    marked = offer_with_dtx(video_first)
    assert asks_for_dtx(marked, 111)
    assert marked.count("usedtx=1") == 2 and marked.startswith(video_first.split("m=audio")[0])


async def test_an_offer_with_two_audio_sections_is_refused_in_plain_words():
    """The microphone is read by payload type on the one audio section that also carries speech."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    from voxgate.gateway.errors import GatewayError
    from voxgate.gateway.webrtc.peer import validate_offer_sdp

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    try:
        with pytest.raises(GatewayError, match="2 audio sections: offer one") as refused:
            validate_offer_sdp(pc.localDescription.sdp)
        assert refused.value.code == "invalid_sdp"
    finally:
        await pc.close()
