"""Helpers for the listening half: known caller audio, and where its onsets land on each side."""

from __future__ import annotations

import numpy as np


def bursts(rate: int, count: int = 6, burst_ms: int = 80, gap_ms: int = 320, freq: float = 1000.0,
           amplitude: float = 8000.0) -> np.ndarray:
    """Tone bursts with sharp onsets after silence: easy to find again after Opus or μ-law."""
    burst = (amplitude * np.sin(2 * np.pi * freq * np.arange(rate * burst_ms // 1000) / rate)).astype(np.int16)
    gap = np.zeros(rate * gap_ms // 1000, np.int16)
    return np.concatenate([gap] + [np.concatenate([burst, gap]) for _ in range(count)])


def onsets(pcm: np.ndarray, rate: int, threshold: float = 2000.0, quiet_ms: int = 100) -> list[int]:
    """Sample indices where the signal first crosses `threshold` after `quiet_ms` below it."""
    loud = np.flatnonzero(np.abs(np.asarray(pcm, dtype=np.int32)) > threshold)
    quiet = rate * quiet_ms // 1000
    found, last = [], -quiet - 1
    for index in loud:
        if index - last > quiet:
            found.append(int(index))
        last = index
    return found


def onset_times(frames: list[tuple[float, np.ndarray]], rate: int) -> list[float]:
    """Onsets of a stream of frames, each (when its first sample happened, its samples), as times."""
    starts, pcm, at = [], [], 0
    for when, samples in frames:
        starts.append((at, when))
        pcm.append(np.asarray(samples).reshape(-1))
        at += len(pcm[-1])
    whole = np.concatenate(pcm) if pcm else np.zeros(0, np.int16)
    times = []
    for index in onsets(whole, rate):
        offset, when = next((o, w) for o, w in reversed(starts) if o <= index)
        times.append(when + (index - offset) / rate)
    return times
