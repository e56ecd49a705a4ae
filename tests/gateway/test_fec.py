"""In-band FEC until the listener shows a clean line (gateway/media/fec.py): the policy, the
encoder's switch, and a real aiortc listener that drops packets on loopback."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from voxgate.engine import tone
from voxgate.gateway.media import opus
from voxgate.gateway.media.encoder import OpusEncoder, OpusSettings
from voxgate.gateway.media.fec import CLEAN_REPORTS, HOLD_S, LOSS_ON, SignalPolicy
from voxgate.gateway.media.frames import Framer
from voxgate.rtc_client import RtcClient


def mode(packet: bytes) -> str:
    """An Opus packet's mode, from its TOC byte's configuration (RFC 6716, 3.1)."""
    config = packet[0] >> 3
    return "silk" if config < 12 else "hybrid" if config < 16 else "celt"


def test_fec_is_on_before_the_first_report_and_off_after_clean_ones():
    policy = SignalPolicy()
    assert policy.signal == "voice"  # nothing known about the line: FEC from the first packet
    for i in range(CLEAN_REPORTS - 1):
        assert policy.report(LOSS_ON / 2, 100.0 + i) == "voice"  # under the threshold, but not enough of them
    assert policy.report(0.0, 101.0 + CLEAN_REPORTS) == "music"
    assert policy.report(LOSS_ON, 110.0) == "voice"
    for i in range(CLEAN_REPORTS + 1):
        assert policy.report(0.0, 111.0 + i) == "voice"  # held through quiet reports
    assert policy.report(0.0, 110.0 + HOLD_S + 1) == "music"
    assert policy.report(LOSS_ON, 200.0) == "voice"
    assert policy.report(0.0, 200.0 + HOLD_S + 1) == "voice"  # past the hold, but one clean report only
    assert policy.report(0.0, 200.0 + HOLD_S + 2) == "music"


def speech_frames(text: str = "Frames for the encoder.") -> np.ndarray:
    """The tone engine's text as the feeder hands it to the encoder: 24 kHz, whole 20 ms frames."""
    pcm = soxr.resample(tone.encode(text), tone.SAMPLE_RATE, 24000).astype(np.int16)
    return Framer(24000).push(pcm, last=True)


def test_the_encoder_codes_celt_alone_as_music_and_hybrid_with_fec_as_voice():
    encoder = OpusEncoder(OpusSettings())  # signal auto: starts as voice
    frames = speech_frames()
    n = encoder.frame_samples
    first = encoder.encode(frames[: 15 * n])
    assert {mode(p) for p in first} <= {"silk", "hybrid"}
    encoder.use_signal("music")
    middle = encoder.encode(frames[15 * n: 35 * n])
    assert {mode(p) for p in middle[2:]} == {"celt"}
    encoder.use_signal("voice")
    rest = encoder.encode(frames[35 * n: 60 * n])
    assert {mode(p) for p in rest[2:]} <= {"silk", "hybrid"}  # libopus may take a frame or two to switch
    decoder = opus.Decoder(16000)
    heard = tone.decode(np.concatenate([decoder.decode(p) for p in first + middle + rest]), 16000)
    assert heard == "Frames for the encoder."  # the switches between frames lose no symbol
    with pytest.raises(ValueError):
        encoder.use_signal("speech")


def test_a_fixed_signal_stays():
    assert {mode(p) for p in OpusEncoder(OpusSettings(signal="voice")).encode(speech_frames()[:20 * 480])} <= {"silk", "hybrid"}
    assert {mode(p) for p in OpusEncoder(OpusSettings(signal="music")).encode(speech_frames()[:20 * 480])} == {"celt"}


def drop_every(client: RtcClient, nth: int) -> list[tuple[bool, bytes]]:
    """Make the client's receiver lose every nth RTP packet before aiortc sees it
    (so its receiver reports count them lost); returns (after_switch, payload) of
    the packets it kept, in order."""
    (receiver,) = [t.receiver for t in client.pc.getTransceivers() if t.kind == "audio"]
    handle = receiver._handle_rtp_packet
    kept: list[tuple[bool, bytes]] = []
    count = [0]

    async def lossy(packet, arrival_time_ms):
        count[0] += 1
        if count[0] % nth == 0:
            return
        kept.append((client.fec_switched, bytes(packet.payload)))
        await handle(packet, arrival_time_ms)

    client.fec_switched = False
    receiver._handle_rtp_packet = lossy
    return kept


async def test_a_listener_that_loses_packets_keeps_in_band_fec_from_its_first_packet(server_factory):
    """A real aiortc listener drops every 5th packet: its receiver reports show 20 %
    loss, and both utterances arrive as SILK or hybrid with LBRR (FEC) in the packets,
    from the first: the line never counts as clean."""
    server = server_factory("tone", extra=["--log-json"])
    async with RtcClient(server.url) as client:
        kept = drop_every(client, 5)
        client.send({"type": "speak", "text": "Lossy line, first words.", "id": "f1"})
        await client.wait_for("utterance.done", id="f1")
        client.send({"type": "speak", "text": "With FEC still, for a while longer.", "id": "f2"})
        await client.wait_for("utterance.done", id="f2")
    speech = [p for _, p in kept if len(p) > 20]  # silence packets are a few bytes
    assert len(speech) > 60 and {mode(p) for p in speech} <= {"silk", "hybrid"}
    if opus.has_lbrr(speech[0]) is not None:
        assert sum(bool(opus.has_lbrr(p)) for p in speech) > 0.8 * len(speech)
    assert not [e for e in server.log_entries() if "Opus signal music" in e["message"]]


async def test_a_listener_that_loses_nothing_gets_celt_after_its_clean_reports_and_hears_every_word(tone_server):
    async with RtcClient(tone_server.url) as client:
        kept = drop_every(client, 10**9)
        text = "A clean line gets the cheap mode; every symbol arrives. " * 3
        sent = client.send({"type": "speak", "text": text, "id": "c1"})
        await client.wait_tail(await client.wait_for("utterance.done", id="c1"))
        assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == text
    modes = [mode(p) for _, p in kept if len(p) > 20]
    assert modes[0] in ("silk", "hybrid") and modes[-1] == "celt", modes


async def test_without_a_place_to_watch_reports_the_session_keeps_fec():
    """An aiortc that no longer has _handle_rtcp_packet: nothing can say the listener
    loses nothing, so speech is coded with FEC throughout, also after a cancel."""
    from tests.gateway.test_session import make
    from voxgate.gateway.media.fec import watch_reports

    assert watch_reports(object(), lambda fraction: None) is False
    session, _, _, _ = make()
    session.attach_output("opus")
    assert session.output.encoder.signal == "voice"
    session.output.keep_fec()
    assert session.output.encoder.signal == "voice"
    for _ in range(5):
        session.output.on_loss_report(0.0)  # the policy is pinned: no clean reports turn it to music
    session.output.restart()  # a cancel makes a fresh encoder
    assert session.output.encoder.signal == "voice"
    await session.close("test")


async def test_the_policy_outlives_a_cancel_and_ignores_what_it_cannot_switch():
    from tests.gateway.test_session import make

    session, _, _, _ = make()
    session.attach_output("opus")
    session.output.on_loss_report(0.05)
    assert session.output.encoder.signal == "voice"
    session.output.restart()  # a cancel or barge-in: a fresh encoder takes the signal the policy holds
    assert session.output.encoder.signal == "voice"
    await session.close("test")

    for codec in ("pcmu", "none"):  # G.711 and the data-channel-only output have no Opus to switch
        session, _, _, samples = make()
        session.attach_output(codec)
        session.output.on_loss_report(0.5)
        assert session.output.signal_policy is None
        await session.close("test")

    session, _, _, _ = make(opus=OpusSettings(fec=False))  # auto without FEC: music throughout
    session.attach_output("opus")
    session.output.on_loss_report(0.5)
    assert session.output.encoder.signal == "music"
    await session.close("test")
