"""Wire encoders: 20 ms frames of PCM in, codec packets out.

The outbound track sends these packets as they are (aiortc packs a returned
av.Packet without re-encoding), so encoding happens once, ahead of playout and
off the event loop, and we own Opus bitrate, FEC, DTX and complexity.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

FRAME_MS = 20


@dataclass
class OpusSettings:
    bitrate: int = 32000
    fec: bool = True
    dtx: bool = False
    complexity: int = 5
    packet_loss_pct: int = 5
    application: str = "voip"


class FrameEncoder:
    """Encodes mono int16 PCM at `sample_rate` into one packet per 20 ms frame."""

    codec: str = ""
    sample_rate: int = 48000

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * FRAME_MS // 1000

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """pcm holds a whole number of frames (the caller pads the last one)."""
        raise NotImplementedError

    def silence(self) -> bytes:
        raise NotImplementedError


class OpusEncoder(FrameEncoder):
    codec = "opus"
    sample_rate = 48000

    def __init__(self, settings: OpusSettings | None = None) -> None:
        self.settings = settings or OpusSettings()
        self._context = self._open()
        self._pts = 0
        self._silence = self._make_silence()

    def _open(self) -> av.CodecContext:
        s = self.settings
        ctx = av.CodecContext.create("libopus", "w")
        ctx.sample_rate = 48000
        ctx.layout = "mono"
        ctx.format = "s16"
        ctx.bit_rate = s.bitrate
        ctx.options = {
            "application": s.application,
            "frame_duration": str(FRAME_MS),
            "packet_loss": str(s.packet_loss_pct),
            "fec": "1" if s.fec else "0",
            "dtx": "1" if s.dtx else "0",
            "compression_level": str(s.complexity),
        }
        return ctx

    def _make_silence(self) -> bytes:
        # Steady-state silence from a separate encoder: a few bytes per frame.
        ctx = self._open()
        zeros = np.zeros(self.frame_samples * 6, dtype=np.int16)
        packets = _encode(ctx, zeros, self.frame_samples, 0)
        return packets[-1]

    def reset(self) -> None:
        """Forget the audio before a cancel, so the next utterance starts clean."""
        self._context = self._open()
        self._pts = 0

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        packets = _encode(self._context, pcm, self.frame_samples, self._pts)
        self._pts += len(pcm)
        return packets

    def silence(self) -> bytes:
        return self._silence


def _encode(ctx: av.CodecContext, pcm: np.ndarray, frame_samples: int, pts: int) -> list[bytes]:
    out: list[bytes] = []
    for start in range(0, len(pcm), frame_samples):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm[start : start + frame_samples]).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate = 48000
        frame.pts = pts + start
        out.extend(bytes(p) for p in ctx.encode(frame))
    return out


# G.711 by table: one numpy lookup per buffer. The tables come from FFmpeg's
# own G.711 codecs, built once, so they match what peers decode.
def _g711_tables(name: str) -> tuple[np.ndarray, np.ndarray]:
    samples = np.arange(-32768, 32768, dtype=np.int16)
    enc = av.CodecContext.create(f"pcm_{name}", "w")
    enc.sample_rate, enc.layout, enc.format = 8000, "mono", "s16"
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 8000
    encode_table = np.frombuffer(b"".join(bytes(p) for p in enc.encode(frame)), dtype=np.uint8)
    dec = av.CodecContext.create(f"pcm_{name}", "r")
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

    def __init__(self, law: str = "pcmu") -> None:
        self.codec = law
        self._fn = ulaw_encode if law == "pcmu" else alaw_encode
        self._silence = self._fn(np.zeros(self.frame_samples, dtype=np.int16))

    def reset(self) -> None:
        pass

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

    def reset(self) -> None:
        pass

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
