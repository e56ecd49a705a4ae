"""Streaming resampling from engine rate to wire rate.

One resampler lives for one utterance and keeps its filter state across
chunks, so chunk boundaries carry no clicks.
"""

from __future__ import annotations

import numpy as np
import soxr


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
