"""Wire encoders: 20 ms frames of PCM in, codec packets out.

The outbound track sends these packets as they are (aiortc packs a returned
av.Packet without re-encoding), so encoding happens once, ahead of playout and
off the event loop, and we own Opus bitrate, FEC, DTX and complexity. Opus goes
through libopus directly (`opus.py`); silence is encoded once per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import av
import numpy as np
from av.audio.codeccontext import AudioCodecContext

from ...config import Settings
from . import opus
from .frames import frame_samples


@dataclass(frozen=True)
class OpusSettings:
    """The encoder's settings; the defaults are the --opus-* flags' (voxgate/config.py)."""

    bitrate: int = Settings.opus_bitrate
    fec: bool = Settings.opus_fec
    # The bitrate while coding as voice with FEC (when higher than `bitrate`): libopus leaves
    # LBRR out of packets whose bitrate does not cover it (gateway/media/opus.py has_lbrr).
    fec_bitrate: int = Settings.opus_fec_bitrate
    # Between utterances, send a silent keep-alive packet every 400 ms instead of
    # a silent packet every 20 ms (Opus DTX; receivers fill the gap with silence).
    dtx: bool = Settings.opus_dtx
    # Between utterances only: DTX for a listener whose offer asks for it (usedtx=1,
    # RFC 7587), the way a listener says its decoder fills gaps; see peer.py.
    dtx_when_asked: bool = Settings.opus_dtx_when_asked
    # The cost per frame against speech quality is measured by bench/bench_opus_quality.py.
    complexity: int = Settings.opus_complexity
    packet_loss_pct: int = Settings.opus_loss_pct
    application: str = "voip"
    # What libopus is told the signal is: "voice" (SILK or hybrid, with in-band
    # FEC), "music" (CELT alone, without in-band FEC), or "auto": voice until the
    # listener's reports show a clean line (gateway/media/fec.py).
    signal: str = Settings.opus_signal
    # Rate the encoder is fed at. The RTP clock is 48 kHz whatever this is; 24 kHz
    # keeps all of a 22.05 kHz voice and costs less to resample and encode.
    input_rate: int = 24000


class FrameEncoder:
    """Encodes mono int16 PCM at `sample_rate` into one packet per 20 ms frame."""

    codec: str = ""
    sample_rate: int = 48000  # the rate PCM is fed at
    clock_rate: int = 48000  # the RTP clock, and the rate a receiver decodes at

    @property
    def frame_samples(self) -> int:
        return frame_samples(self.sample_rate)

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """pcm holds a whole number of frames (the caller pads the last one)."""
        raise NotImplementedError

    def silence(self) -> bytes:
        raise NotImplementedError


class OpusEncoder(FrameEncoder):
    codec = "opus"
    clock_rate = 48000

    def __init__(self, settings: OpusSettings | None = None) -> None:
        self.settings = settings or OpusSettings()
        self.sample_rate = self.settings.input_rate
        self._encoder = _open(self.settings)
        self._signal = self._encoder.signal

    def use_signal(self, signal: str) -> None:
        """The signal ("voice" or "music") the next encode() codes with. Called from
        the event loop; the next encode() applies it (on the loop, or on an encoding thread
        with --encode-threads N), so libopus is only ever touched by the code that encodes."""
        if signal not in opus.SIGNALS:
            raise ValueError(f"signal {signal!r}: choose one of {', '.join(opus.SIGNALS)}")
        self._signal = signal

    @property
    def signal(self) -> str:
        return self._signal

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        if self._signal != self._encoder.signal:
            self._encoder.set_signal(self._signal)
        return self._encoder.encode(pcm)

    def silence(self) -> bytes:
        return _opus_silence(self.settings)


def _open(s: OpusSettings, auto: str | None = None) -> opus.Encoder:
    # auto starts as voice (FEC before the first loss report) when FEC is on: gateway/media/fec.py.
    signal = (auto or ("voice" if s.fec else "music")) if s.signal == "auto" else s.signal
    return opus.Encoder(s.input_rate, s.bitrate, s.complexity, s.fec, s.packet_loss_pct, s.dtx, s.application, signal,
                        voice_bitrate=s.fec_bitrate)


@lru_cache(maxsize=32)
def _opus_silence(settings: OpusSettings) -> bytes:
    """Steady-state silence, encoded once per setting for the whole process. With auto it is CELT,
    as it was before auto started with FEC: silence has nothing for FEC to rebuild."""
    encoder = _open(settings, auto="music")
    packets = encoder.encode(np.zeros(frame_samples(settings.input_rate) * 6, dtype=np.int16))
    return packets[-1]


# G.711 by table: one numpy lookup per buffer. The tables come from FFmpeg's
# own G.711 codecs, built once, so they match what peers decode.
def _g711_tables(name: str) -> tuple[np.ndarray, np.ndarray]:
    samples = np.arange(-32768, 32768, dtype=np.int16)
    enc = cast(AudioCodecContext, av.CodecContext.create(f"pcm_{name}", "w"))
    enc.sample_rate, enc.layout, enc.format = 8000, "mono", "s16"
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 8000
    encode_table = np.frombuffer(b"".join(bytes(p) for p in enc.encode(frame)), dtype=np.uint8)
    dec = cast(AudioCodecContext, av.CodecContext.create(f"pcm_{name}", "r"))
    dec.sample_rate, dec.layout = 8000, "mono"
    packet = av.Packet(bytes(range(256)))
    decode_table = np.concatenate([f.to_ndarray().reshape(-1) for f in dec.decode(packet)]).astype(np.int16)
    return encode_table, decode_table


_ULAW, _ULAW_DECODE = _g711_tables("mulaw")
_ALAW, _ALAW_DECODE = _g711_tables("alaw")


def ulaw_encode(pcm: np.ndarray) -> bytes:
    return _ULAW[np.asarray(pcm, dtype=np.int16).astype(np.int32) + 32768].tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    return _ALAW[np.asarray(pcm, dtype=np.int16).astype(np.int32) + 32768].tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


class G711Encoder(FrameEncoder):
    sample_rate = 8000
    clock_rate = 8000

    def __init__(self, law: str = "pcmu") -> None:
        self.codec = law
        self._fn = ulaw_encode if law == "pcmu" else alaw_encode
        self._silence = self._fn(np.zeros(self.frame_samples, dtype=np.int16))

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        data = self._fn(pcm)
        n = self.frame_samples
        return [data[i : i + n] for i in range(0, len(data), n)]

    def silence(self) -> bytes:
        return self._silence


class NullEncoder(FrameEncoder):
    """For sessions without an audio output: frames are counted, never encoded."""

    codec = "none"
    sample_rate = 8000
    clock_rate = 8000

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        return [b""] * (len(pcm) // self.frame_samples)

    def silence(self) -> bytes:
        return b""


def create_encoder(codec: str, opus: OpusSettings | None = None) -> FrameEncoder:
    codec = codec.lower()
    if codec == "none":
        return NullEncoder()
    if codec == "opus":
        return OpusEncoder(opus)
    if codec in ("pcmu", "pcma"):
        return G711Encoder(codec)
    raise ValueError(f"no encoder for codec {codec}")
