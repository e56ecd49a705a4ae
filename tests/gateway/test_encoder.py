"""Wire encoders (gateway/media/encoder.py): one packet per 20 ms frame, decodable back to the same sound.

Real libopus on both sides (gateway/media/opus.py's Decoder), and G.711 tables
checked against the standard's fixed points.
"""

from __future__ import annotations

import numpy as np
import pytest

from voxgate.gateway.media import opus
from voxgate.gateway.media.encoder import (
    G711Encoder,
    NullEncoder,
    OpusEncoder,
    OpusSettings,
    alaw_decode,
    alaw_encode,
    create_encoder,
    ulaw_decode,
    ulaw_encode,
)


def tone(rate: int, seconds: float, hz: float = 440.0, amplitude: float = 8000.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * hz * t) * amplitude).astype(np.int16)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))


def test_opus_makes_one_packet_a_frame_that_decodes_back_to_the_tone():
    encoder = OpusEncoder(OpusSettings(input_rate=24000))
    assert encoder.sample_rate == 24000 and encoder.clock_rate == 48000 and encoder.frame_samples == 480
    pcm = tone(24000, 1.0)
    packets = encoder.encode(pcm)
    assert len(packets) == 50 and all(0 < len(p) < 400 for p in packets)
    decoder = opus.Decoder(24000)
    out = np.concatenate([decoder.decode(p) for p in packets])
    assert len(out) == len(pcm)
    # The codec's delay shifts the signal: compare the steady part's level and pitch.
    steady = out[4800:]
    assert 0.7 < rms(steady) / rms(pcm) < 1.3
    spectrum = np.abs(np.fft.rfft(steady))
    assert abs(np.argmax(spectrum) * 24000 / len(steady) - 440) < 5


def test_opus_bitrate_setting_changes_the_packet_sizes():
    pcm = tone(24000, 1.0, hz=300) + tone(24000, 1.0, hz=2100, amplitude=3000)
    small = sum(map(len, OpusEncoder(OpusSettings(bitrate=12000, fec=False)).encode(pcm)))
    large = sum(map(len, OpusEncoder(OpusSettings(bitrate=64000, fec=False)).encode(pcm)))
    assert large > 2 * small


def test_opus_silence_decodes_to_silence_and_is_made_once_per_settings():
    settings = OpusSettings()
    a, b = OpusEncoder(settings), OpusEncoder(settings)
    assert a.silence() is b.silence()
    assert np.abs(opus.Decoder(48000).decode(a.silence())).max() <= 1


@pytest.mark.parametrize("law,encode,decode,zero", [("pcmu", ulaw_encode, ulaw_decode, 0xFF), ("pcma", alaw_encode, alaw_decode, 0xD5)])
def test_g711_frames_are_160_bytes_and_round_trip_within_the_law(law, encode, decode, zero):
    encoder = G711Encoder(law)
    assert encoder.codec == law and encoder.frame_samples == 160 and encoder.clock_rate == 8000
    pcm = tone(8000, 0.1)
    packets = encoder.encode(pcm)
    assert [len(p) for p in packets] == [160] * 5
    assert encoder.silence() == bytes([zero]) * 160  # the standard's code for 0
    back = decode(b"".join(packets))
    # Logarithmic companding: the error grows with the level, a few percent of it at most.
    error = np.abs(back.astype(np.int32) - pcm)
    assert error.max() <= 0.04 * np.abs(pcm).max() + 8
    assert encode(pcm) == b"".join(packets)


def test_ulaw_and_alaw_are_different_laws():
    pcm = tone(8000, 0.02)
    assert ulaw_encode(pcm) != alaw_encode(pcm)


def test_null_encoder_counts_frames_and_encodes_nothing():
    encoder = NullEncoder()
    assert encoder.encode(np.zeros(160 * 3, np.int16)) == [b""] * 3 and encoder.silence() == b""


def test_create_encoder_by_codec_name():
    assert isinstance(create_encoder("OPUS"), OpusEncoder)
    assert create_encoder("pcma").codec == "pcma"
    assert isinstance(create_encoder("none"), NullEncoder)
    with pytest.raises(ValueError, match="no encoder for codec g722"):
        create_encoder("g722")


@pytest.mark.parametrize("signal", ["voice", "music", "auto", "auto-then-voice"])
def test_speech_after_the_shared_silence_packet_decodes_as_coded(signal):
    """Between units the playout sends the process's shared silence packet, made by
    another encoder. The frames that follow must not lean on a previous frame the
    decoder never saw: with CELT's inter-frame prediction on, the space after
    "Sure!" was lost (tone engine, through the real decoder)."""
    from voxgate.engine import tone as tone_engine
    from voxgate.gateway.media.frames import Framer
    from voxgate.gateway.media.resample import StreamResampler

    encoder = OpusEncoder(OpusSettings(signal=signal.split("-")[0]))
    if signal == "auto-then-voice":  # a listener that lost packets: voice speech, the (music) shared silence
        encoder.use_signal("voice")
    parts = ("Sure!", " The store opens at nine, and closes at six.")
    for gap in (0, 1, 3):
        framer, packets = Framer(encoder.sample_rate), []
        for i, part in enumerate(parts):
            packets += [encoder.silence()] * (gap if i else 0)
            pcm = StreamResampler(tone_engine.SAMPLE_RATE, encoder.sample_rate).process(tone_engine.encode(part), last=True)
            packets += encoder.encode(framer.push(pcm, last=True))
        decoder = opus.Decoder(48000)
        heard = tone_engine.decode(np.concatenate([decoder.decode(p) for p in packets]), 48000)
        assert heard == "".join(parts), (signal, gap)


def test_speech_coded_as_voice_carries_in_band_fec_at_the_default_settings():
    # libopus puts LBRR (the previous frame again, at low bitrate) in a packet only with FEC on, a nonzero
    # expected loss, speech in the frame, and a bitrate that covers it: at 32 kbit/s and complexity 0
    # an expected loss of 5 % gave none in any packet, so "FEC" recovered nothing (bench/bench_network.py).
    from tests.listening_corpus import espeak

    speech = espeak("The quick brown fox jumps over the lazy dog.", "en-us+f2", 24000)
    speech = speech[: len(speech) // 480 * 480]
    packets = OpusEncoder(OpusSettings(signal="voice")).encode(speech)
    flags = [opus.has_lbrr(p) for p in packets]
    if None in flags:
        pytest.skip("libopus before 1.5 cannot say whether a packet has LBRR")
    assert sum(flags) >= 0.6 * len(packets), f"{sum(flags)} of {len(packets)} packets carry LBRR"
    # Coded as music (CELT alone), nothing does: the FEC policy's other half, at --opus-bitrate again.
    encoder = OpusEncoder(OpusSettings())  # auto: voice first
    with_fec = encoder.encode(speech)
    encoder.use_signal("music")
    music = encoder.encode(speech)
    assert not any(opus.has_lbrr(p) for p in music[2:])
    size = {name: 8 * 50 * sum(map(len, ps[10:])) / len(ps[10:]) for name, ps in (("fec", with_fec), ("music", music))}
    assert size["fec"] > 1.25 * size["music"] and size["music"] < 1.1 * OpusSettings().bitrate, size
