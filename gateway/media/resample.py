"""Streaming resampling: from engine rate to wire rate, and the caller's 8 kHz audio to 16 kHz.

One resampler lives for one utterance and keeps its filter state across
chunks, so chunk boundaries carry no clicks.
"""

from __future__ import annotations

import functools

import numpy as np
import soxr

# Engine chunk lengths (seconds) the hold-back is measured over: two sentences'
# windows as engine/piper/windows.py plans them for a Piper voice (12 frames of
# 256 samples at 22,050 Hz first, growing 4x up to 256, then a tail). Three
# rounds of them gave the same mean within 0.3 ms at three times the cost.
_PROBE_CHUNKS_S = (0.139, 0.557, 2.23, 2.97, 0.43, 0.139, 0.557, 1.16)


class StreamResampler:
    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16", quality="HQ")

    def process(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        pcm = np.asarray(pcm, dtype=np.int16).reshape(-1)
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(pcm, last=last)


class Upsampler2x:
    """8 kHz to 16 kHz for the caller's audio (a phone call, a G.711 microphone), each output sample
    as soon as its input has arrived.

    A soxr stream hands its output over in blocks: 8 kHz to 16 kHz comes out about 100 ms at a
    time (1,660 samples after every fifth 20 ms frame), which would hold the VAD and the backends
    back that long. This is a windowed-sinc half-band filter in two phases, one for the even
    output samples and one for the odd, which keeps the last `TAPS // 2 - 1` input samples
    between calls. Its delay, `DELAY_S` (under 2 ms), is the same for every sample.
    """

    TAPS = 64
    DELAY_S = (TAPS - 1) / 2 / 16000

    def __init__(self) -> None:
        self._history = np.zeros(self.TAPS // 2 - 1, dtype=np.float64)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, np.asarray(pcm, dtype=np.float64).reshape(-1)])
        self._history = x[len(x) - len(self._history):]
        out = np.empty(2 * (len(x) - len(self._history)), dtype=np.float64)
        out[0::2] = np.convolve(x, _HALF_BAND[0::2], "valid")
        out[1::2] = np.convolve(x, _HALF_BAND[1::2], "valid")
        return np.clip(np.rint(out), -32768, 32767).astype(np.int16)


def _half_band(taps: int) -> np.ndarray:
    """A low-pass at a quarter of the output rate (the input's Nyquist), gain 2 for the zeros between samples."""
    n = np.arange(taps) - (taps - 1) / 2
    h = np.sinc(n / 2) * np.kaiser(taps, 8.0)
    return 2 * h / h.sum()


_HALF_BAND = _half_band(Upsampler2x.TAPS)


@functools.lru_cache(maxsize=32)
def held_back_s(in_rate: int, out_rate: int) -> float:
    """How much audio a StreamResampler(in_rate, out_rate) keeps back from its
    output before the stream's last chunk, on average over a stream, in seconds.

    soxr works in blocks, so what it holds swings from chunk to chunk (5-42 ms
    from 22,050 Hz to 24,000). It is read here once per pair of rates by running
    silence through it in chunks as long as an engine's windows: 2-4 ms of
    work, which Gateway.start does for the engine's rate and Opus's.
    """
    if in_rate == out_rate:
        return 0.0
    stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16", quality="HQ")
    holds: list[float] = []
    for chunk_s in _PROBE_CHUNKS_S:
        stream.resample_chunk(np.zeros(max(1, int(in_rate * chunk_s)), np.int16))
        holds.append(float(stream.delay()))
    return sum(holds) / len(holds) / out_rate
