"""libopus, called directly: one 20 ms frame in, one packet out, and back.

PyAV wraps every frame in an AVFrame and every packet in an AVPacket, which
costs more than the encoding itself at low complexity (about 90 µs a frame
here, against about 100 µs for libopus at complexity 0). The same libopus that
PyAV ships (or the system's) is called here through ctypes, which also
releases the GIL for the call, so encoding threads run beside the event loop.

Only what the gateway needs: a mono encoder with bitrate, complexity, FEC,
packet-loss and DTX settings, and a mono decoder at any Opus rate (the
microphone is decoded straight to 16 kHz for the VAD).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

import numpy as np

from . import av_internals

# From opus_defines.h.
_APPLICATION = {"voip": 2048, "audio": 2049, "lowdelay": 2051}
_SET_BITRATE = 4002
_SET_COMPLEXITY = 4010
_SET_INBAND_FEC = 4012
_SET_PACKET_LOSS_PERC = 4014
_SET_DTX = 4016
_SET_SIGNAL = 4024
# "voice" lets libopus pick SILK or hybrid (SILK below 8 kHz, CELT above), the
# modes that carry in-band FEC; "music" makes it pick CELT alone, which costs
# about a third as much per frame here and carries no in-band FEC.
SIGNALS = {"voice": 3001, "music": 3002}
# CELT frames normally code their band energies against the previous frame's.
# The gateway sends one shared, pre-encoded silence packet between and around
# utterances, made by another encoder, so the decoder's previous frame is not
# the one this encoder assumed, and the next frame decodes at the wrong level
# (a tone symbol lost in tests). With prediction off every frame stands alone,
# which also stops one lost packet from spoiling the next. Only music sets it:
# SILK's in-band FEC needs the prediction.
_SET_PREDICTION_DISABLED = 4042
_OK = 0

# Opus codes at these input rates; the RTP clock is 48 kHz whatever the input.
RATES = (8000, 12000, 16000, 24000, 48000)
MAX_PACKET = 1275  # the largest Opus packet for one frame


class OpusError(RuntimeError):
    pass


def _candidates() -> list[str]:
    found = av_internals.bundled("libopus")  # PyAV's, from PyPI's wheels
    system = ctypes.util.find_library("opus")
    if system:
        found.append(system)
    return found


_loaded: list[str] = []  # the path _lib() loaded


def library() -> tuple[str, str]:
    """(path, version) of the libopus in use: loaded now if not yet (raises OpusError if none is found)."""
    lib = _lib()
    return _loaded[0], lib.opus_get_version_string().decode()


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        _loaded[:] = [path]
        lib.opus_get_version_string.restype = ctypes.c_char_p
        lib.opus_get_version_string.argtypes = []
        lib.opus_encoder_create.restype = ctypes.c_void_p
        lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
        lib.opus_encode.restype = ctypes.c_int32
        lib.opus_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int32]
        lib.opus_decoder_create.restype = ctypes.c_void_p
        lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
        lib.opus_decode.restype = ctypes.c_int
        lib.opus_decode.argtypes = [
            ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ]
        lib.opus_packet_get_nb_samples.restype = ctypes.c_int
        lib.opus_packet_get_nb_samples.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32]
        lib.opus_strerror.restype = ctypes.c_char_p
        if hasattr(lib, "opus_packet_has_lbrr"):  # libopus 1.5 and later
            lib.opus_packet_has_lbrr.restype = ctypes.c_int
            lib.opus_packet_has_lbrr.argtypes = [ctypes.c_char_p, ctypes.c_int32]
        lib.opus_strerror.argtypes = [ctypes.c_int]
        return lib
    raise OpusError(
        "libopus was not found: install PyAV from PyPI (it bundles libopus) or the system's libopus "
        f"(Debian: apt install libopus0). Tried: {'; '.join(errors) or 'nothing found'}"
    )


def _check(code: int, what: str) -> int:
    if code < 0:
        raise OpusError(f"{what}: {_lib().opus_strerror(code).decode()}")
    return code


class Encoder:
    """A mono libopus encoder for 20 ms frames of int16 PCM at `rate`."""

    def __init__(
        self,
        rate: int,
        bitrate: int,
        complexity: int,
        fec: bool,
        packet_loss_pct: int,
        dtx: bool,
        application: str = "voip",
        signal: str = "voice",
        voice_bitrate: int | None = None,
    ) -> None:
        if rate not in RATES:
            raise ValueError(f"Opus encodes at {', '.join(map(str, RATES))} Hz, not {rate}")
        lib = _lib()
        err = ctypes.c_int()
        self._state = lib.opus_encoder_create(rate, 1, _APPLICATION[application], ctypes.byref(err))
        _check(err.value, "opus_encoder_create")
        self.rate = rate
        self.frame_samples = rate // 50
        # Coded as voice with FEC, libopus needs the bitrate to cover LBRR as well, or it leaves it out
        # (gateway/media/fec.py): voice_bitrate applies then, `bitrate` otherwise.
        self._bitrates = {"music": bitrate, "voice": max(bitrate, voice_bitrate or 0) if fec else bitrate}
        for request, value in (
            (_SET_COMPLEXITY, complexity),
            (_SET_INBAND_FEC, int(fec)),
            (_SET_PACKET_LOSS_PERC, packet_loss_pct),
            (_SET_DTX, int(dtx)),
        ):
            # opus_encoder_ctl is variadic: plain C ints, no declared argtypes.
            _check(lib.opus_encoder_ctl(ctypes.c_void_p(self._state), ctypes.c_int(request), ctypes.c_int(value)), "opus_encoder_ctl")
        self.signal = ""
        self.set_signal(signal)
        self._out = ctypes.create_string_buffer(MAX_PACKET)

    def set_signal(self, signal: str) -> None:
        """What libopus codes the next frames as (SIGNALS), at that signal's bitrate; it switches modes between frames."""
        if signal not in SIGNALS:
            raise ValueError(f"signal {signal!r}: choose one of {', '.join(SIGNALS)}")
        for request, value in ((_SET_SIGNAL, SIGNALS[signal]), (_SET_PREDICTION_DISABLED, int(signal == "music")),
                               (_SET_BITRATE, self._bitrates[signal])):
            _check(_lib().opus_encoder_ctl(ctypes.c_void_p(self._state), ctypes.c_int(request), ctypes.c_int(value)),
                   "opus_encoder_ctl")
        self.signal = signal

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """Whole 20 ms frames of int16 PCM in, one packet per frame out."""
        pcm = np.ascontiguousarray(pcm, dtype=np.int16)
        n = self.frame_samples
        if len(pcm) % n:
            raise ValueError(f"{len(pcm)} samples is not a whole number of {n}-sample frames")
        encode, state, out = _lib().opus_encode, self._state, self._out
        base = pcm.ctypes.data
        packets = []
        for offset in range(0, len(pcm) * 2, n * 2):
            size = encode(state, base + offset, n, out, MAX_PACKET)
            # The packet's bytes only: `out.raw` would copy the whole buffer first.
            packets.append(ctypes.string_at(out, _check(size, "opus_encode")))
        return packets

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            _lib().opus_encoder_destroy(state)


def has_lbrr(packet: bytes) -> bool | None:
    """Whether the packet carries in-band FEC (SILK's LBRR: the previous frame again, at low bitrate);
    None where libopus is older than 1.5 and cannot say.

    libopus codes LBRR only with FEC on, a nonzero expected loss, SILK or hybrid
    mode (signal voice), speech in the frame, and a bitrate that covers it: at
    32 kbit/s and complexity 0 it needs 6 % expected loss or more (tests/gateway/test_encoder.py)."""
    lib = _lib()
    if not hasattr(lib, "opus_packet_has_lbrr"):
        return None
    return _check(lib.opus_packet_has_lbrr(packet, len(packet)), "opus_packet_has_lbrr") > 0


def packet_samples(packet: bytes, rate: int) -> int:
    """How many samples at `rate` an Opus packet holds, read from its header without decoding.

    The arithmetic of libopus's `opus_packet_get_nb_samples` (RFC 6716, 3.1), in
    Python: the microphone asks this for every packet its level gate passes over,
    and a ctypes call cost several times the reading. `tests/gateway/test_opus.py`
    checks it against libopus for every header.
    """
    if not packet:
        raise OpusError("opus_packet_get_nb_samples: invalid argument")
    toc = packet[0]
    code = toc & 0x3
    if code == 0:
        frames = 1
    elif code != 3:
        frames = 2
    elif len(packet) < 2:
        raise OpusError("opus_packet_get_nb_samples: corrupted stream")
    else:
        frames = packet[1] & 0x3F
    if toc & 0x80:  # CELT: 2.5, 5, 10 or 20 ms
        per_frame = (rate << ((toc >> 3) & 0x3)) // 400
    elif toc & 0x60 == 0x60:  # hybrid: 10 or 20 ms
        per_frame = rate // 50 if toc & 0x08 else rate // 100
    else:  # SILK: 10, 20, 40 or 60 ms
        size = (toc >> 3) & 0x3
        per_frame = rate * 60 // 1000 if size == 3 else (rate << size) // 100
    samples = frames * per_frame
    if samples * 25 > rate * 3:  # over 120 ms
        raise OpusError("opus_packet_get_nb_samples: corrupted stream")
    return samples


class Decoder:
    """A mono libopus decoder; decodes any Opus packet straight to `rate`."""

    def __init__(self, rate: int) -> None:
        if rate not in RATES:
            raise ValueError(f"Opus decodes at {', '.join(map(str, RATES))} Hz, not {rate}")
        err = ctypes.c_int()
        self._state = _lib().opus_decoder_create(rate, 1, ctypes.byref(err))
        _check(err.value, "opus_decoder_create")
        self.rate = rate
        # The longest Opus packet holds 120 ms.
        self._pcm = np.zeros(rate * 120 // 1000, dtype=np.int16)
        self._pcm_at = self._pcm.ctypes.data  # read once: `.ctypes` builds new objects on every access

    def decode(self, packet: bytes) -> np.ndarray:
        """One packet in, its int16 samples out (a copy)."""
        pcm = self._pcm
        n = _lib().opus_decode(self._state, packet, len(packet), self._pcm_at, len(pcm), 0)
        return pcm[: _check(n, "opus_decode")].copy()

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            _lib().opus_decoder_destroy(state)
