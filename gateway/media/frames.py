"""The one frame size on every wire: 20 ms, and how PCM is cut into such frames."""

from __future__ import annotations

import numpy as np

FRAME_MS = 20
FRAME_S = FRAME_MS / 1000.0


def frame_samples(rate: int) -> int:
    """Samples in one frame at `rate`."""
    return rate * FRAME_MS // 1000


class Framer:
    """Cuts a stream of PCM into whole frames, keeping the remainder for the next call."""

    def __init__(self, rate: int) -> None:
        self.samples = frame_samples(rate)
        self._rest = np.zeros(0, dtype=np.int16)

    def push(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        """Whole frames of what came so far; with `last`, the remainder padded with silence."""
        pcm = np.asarray(pcm, dtype=np.int16).reshape(-1)
        samples = np.concatenate([self._rest, pcm]) if len(self._rest) else pcm
        n = self.samples
        whole = len(samples) // n * n
        if last and len(samples) > whole:
            padded = np.zeros(whole + n, dtype=np.int16)
            padded[: len(samples)] = samples
            self._rest = np.zeros(0, dtype=np.int16)
            return padded
        self._rest = samples[whole:]
        return samples[:whole]
