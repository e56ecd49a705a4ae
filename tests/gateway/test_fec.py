"""In-band FEC while the listener loses packets (gateway/fec.py): the policy, the
encoder's switch, and a real aiortc listener that drops packets on loopback."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from voxgate.engine import tone
from voxgate.gateway import opus
from voxgate.gateway.encoder import OpusEncoder, OpusSettings
from voxgate.gateway.fec import HOLD_S, LOSS_ON, SignalPolicy
from voxgate.gateway.frames import Framer
from voxgate.rtc_client import RtcClient


def mode(packet: bytes) -> str:
    """An Opus packet's mode, from its TOC byte's configuration (RFC 6716, 3.1)."""
    config = packet[0] >> 3
    return "silk" if config < 12 else "hybrid" if config < 16 else "celt"


def test_fec_goes_on_with_reported_loss_and_off_after_the_hold():
    policy = SignalPolicy()
    assert policy.signal == "music"
    assert policy.report(0.0, 100.0) == "music"
    assert policy.report(LOSS_ON / 2, 101.0) == "music"  # under the threshold: one stray loss
    assert policy.report(LOSS_ON, 102.0) == "voice"
    assert policy.report(0.0, 102.0 + HOLD_S - 1) == "voice"  # held through quiet reports
    assert policy.report(0.0, 102.0 + HOLD_S + 1) == "music"


def speech_frames(text: str = "Frames for the encoder.") -> np.ndarray:
    """The tone engine's text as the feeder hands it to the encoder: 24 kHz, whole 20 ms frames."""
    pcm = soxr.resample(tone.encode(text), tone.SAMPLE_RATE, 24000).astype(np.int16)
    return Framer(24000).push(pcm, last=True)


def test_the_encoder_codes_celt_alone_as_music_and_hybrid_with_fec_as_voice():
    encoder = OpusEncoder(OpusSettings())  # signal auto: starts as music
    frames = speech_frames()
    n = encoder.frame_samples
    first = encoder.encode(frames[: 20 * n])
    assert {mode(p) for p in first} == {"celt"}
    encoder.use_signal("voice")
    rest = encoder.encode(frames[20 * n: 60 * n])
    assert {mode(p) for p in rest[2:]} <= {"silk", "hybrid"}  # libopus may take a frame or two to switch
    decoder = opus.Decoder(16000)
    heard = tone.decode(np.concatenate([decoder.decode(p) for p in first + rest]), 16000)
    assert heard == "Frames for the encoder."  # the switch between frames loses no symbol
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


async def test_a_listener_that_loses_packets_gets_in_band_fec(server_factory):
    """A real aiortc listener drops every 5th packet: its receiver reports show 20 %
    loss, the server turns the Opus signal to voice, and the next utterance arrives
    as SILK or hybrid (FEC) where the first arrived as CELT alone."""
    server = server_factory("tone", extra=["--log-json"])
    async with RtcClient(server.url) as client:
        kept = drop_every(client, 5)
        client.send({"type": "speak", "text": "Lossy line, first words.", "id": "f1"})
        await client.wait_for("utterance.done", id="f1")
        switched = await server.wait_log(lambda e: "Opus signal voice" in e["message"], timeout=30)
        assert switched["session_id"]
        client.fec_switched = True
        client.send({"type": "speak", "text": "With FEC now, for a while longer.", "id": "f2"})
        await client.wait_for("utterance.done", id="f2")
    speech = [(after, p) for after, p in kept if len(p) > 20]  # silence packets are a few bytes
    before_modes = {mode(p) for after, p in speech if not after}
    after_modes = [mode(p) for after, p in speech if after]
    assert before_modes == {"celt"}
    assert len(after_modes) > 20 and set(after_modes[2:]) <= {"silk", "hybrid"}


async def test_a_listener_that_loses_nothing_keeps_celt_and_hears_every_word(tone_server):
    async with RtcClient(tone_server.url) as client:
        kept = drop_every(client, 10**9)
        text = "A clean line keeps the cheap mode; every symbol arrives. " * 3
        sent = client.send({"type": "speak", "text": text, "id": "c1"})
        await client.wait_tail(await client.wait_for("utterance.done", id="c1"))
        assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == text
    assert {mode(p) for _, p in kept if len(p) > 20} == {"celt"}


async def test_without_a_place_to_watch_reports_the_session_keeps_fec():
    """An aiortc that no longer has _handle_rtcp_packet: nothing can say the listener
    loses nothing, so speech is coded with FEC throughout, also after a cancel."""
    from tests.gateway.test_session import make
    from voxgate.gateway.fec import watch_reports

    assert watch_reports(object(), lambda fraction: None) is False
    session, _, _, _ = make()
    session.attach_output("opus")
    assert session.encoder.signal == "music"
    session.keep_fec()
    assert session.encoder.signal == "voice"
    session.on_loss_report(0.0)  # the policy is pinned: nothing turns it back
    session._restart_feeder()  # a cancel makes a fresh encoder
    assert session.encoder.signal == "voice"
    await session.close("test")


async def test_the_policy_outlives_a_cancel_and_ignores_what_it_cannot_switch():
    from tests.gateway.test_session import make

    session, _, _, _ = make()
    session.attach_output("opus")
    session.on_loss_report(0.05)
    assert session.encoder.signal == "voice"
    session._restart_feeder()  # a cancel or barge-in: a fresh encoder takes the signal the policy holds
    assert session.encoder.signal == "voice"
    await session.close("test")

    for codec in ("pcmu", "none"):  # G.711 and the data-channel-only output have no Opus to switch
        session, _, _, samples = make()
        session.attach_output(codec)
        session.on_loss_report(0.5)
        assert session.signal_policy is None
        await session.close("test")

    session, _, _, _ = make(opus=OpusSettings(fec=False))  # auto without FEC: music throughout
    session.attach_output("opus")
    session.on_loss_report(0.5)
    assert session.encoder.signal == "music"
    await session.close("test")
