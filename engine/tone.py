"""A deterministic test engine: every byte of text becomes a short dual-tone symbol.

Received audio, even after Opus or G.711, decodes back to the exact text, so
tests and load runs can prove that nothing was lost, duplicated, reordered or
crossed between sessions. Each UTF-8 byte is a 25 ms burst of two tones, one
per nibble, followed by 15 ms of silence.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

import numpy as np

from .base import AudioChunk, Engine, EngineError, SynthesisOptions, WordTiming

SAMPLE_RATE = 16000
TONE_S = 0.025
GAP_S = 0.015
SYMBOL_S = TONE_S + GAP_S
# Low nibble in 350..1700 Hz (90 Hz apart), high nibble in 1800..3300 Hz (100 Hz
# apart), inside G.711's 300-3400 Hz band. Opus smears a burst that starts from
# silence by about one 50 Hz step (at complexity 0 and 5 alike), so tones 50 Hz
# apart mis-decoded an utterance's first symbol now and then; at 90-100 Hz apart
# every byte decodes through Opus at complexity 0 to 10 and through G.711.
LOW = [350.0 + 90.0 * i for i in range(16)]
HIGH = [1800.0 + 100.0 * i for i in range(16)]
AMPLITUDE = 0.35


def symbol(byte: int, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    n_tone = int(round(TONE_S * sample_rate))
    n_gap = int(round(GAP_S * sample_rate))
    t = np.arange(n_tone) / sample_rate
    wave = np.sin(2 * np.pi * LOW[byte & 0x0F] * t) + np.sin(2 * np.pi * HIGH[byte >> 4] * t)
    # A short fade keeps the bursts click-free so codecs do not smear them.
    ramp = min(40, n_tone // 4)
    env = np.ones(n_tone)
    env[:ramp] = np.linspace(0, 1, ramp)
    env[-ramp:] = np.linspace(1, 0, ramp)
    tone = (wave * env * AMPLITUDE * 32767 / 2).astype(np.int16)
    return np.concatenate([tone, np.zeros(n_gap, dtype=np.int16)])


@lru_cache(maxsize=1024)  # 256 bytes at a few rates
def _cached_symbol(byte: int, sample_rate: int) -> np.ndarray:
    pcm = symbol(byte, sample_rate)
    pcm.setflags(write=False)  # shared by every caller
    return pcm


def encode(text: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The text's symbols, each made once per process and rate: this engine stands in
    for synthesis that costs nothing (load runs measure the media path around it)."""
    data = text.encode("utf-8")
    if not data:
        return np.zeros(0, dtype=np.int16)
    return np.concatenate([_cached_symbol(b, sample_rate) for b in data])


def decode(pcm: np.ndarray, sample_rate: int) -> str:
    """Recover text from received audio: find each burst, then its two strongest tones."""
    x = np.asarray(pcm, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return ""
    hop = max(1, int(sample_rate * 0.0025))
    n = len(x) // hop
    energy = np.sqrt(np.mean(x[: n * hop].reshape(n, hop) ** 2, axis=1)) if n else np.zeros(0)
    peak = energy.max() if energy.size else 0.0
    if peak <= 0:
        return ""
    on = energy > max(peak * 0.15, 200.0)
    out = bytearray()
    i = 0
    min_len = int(0.012 / 0.0025)
    while i < n:
        if not on[i]:
            i += 1
            continue
        j = i
        while j < n and on[j]:
            j += 1
        if j - i >= min_len:
            start, end = i * hop, j * hop
            out.append(_classify(x[start:end], sample_rate))
        i = j
    return out.decode("utf-8", errors="replace")


def _classify(burst: np.ndarray, sample_rate: int) -> int:
    # Analyse the middle of the burst, away from the fades.
    trim = len(burst) // 5
    seg = burst[trim : len(burst) - trim] if len(burst) > 3 * trim else burst
    t = np.arange(len(seg)) / sample_rate
    win = np.hanning(len(seg))

    def power(f: float) -> float:
        # Single-bin DFT (Goertzel-like) at the exact symbol frequencies.
        c = np.dot(seg * win, np.exp(-2j * np.pi * f * t))
        return float(abs(c))

    low = int(np.argmax([power(f) for f in LOW]))
    high = int(np.argmax([power(f) for f in HIGH]))
    return (high << 4) | low


class ToneEngine(Engine):
    name = "tone"

    def __init__(self, voice: str | None = None, **_: object) -> None:
        self.default_voice = voice or "tone"

    def load(self) -> None:
        pass

    def voices(self) -> list[str]:
        return ["tone"]

    def sample_rate(self, voice: str | None = None) -> int:
        return SAMPLE_RATE

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        if options.voice not in (None, "tone"):
            raise EngineError(f"unknown voice {options.voice!r} for the tone engine: use 'tone'")
        # Every character is its own timed "word", so played_text is exact.
        words: list[WordTiming] = []
        t = 0.0
        for ch in text:
            d = len(ch.encode("utf-8")) * SYMBOL_S
            words.append(WordTiming(ch, t, t + d))
            t += d
        yield AudioChunk(pcm=encode(text), sample_rate=SAMPLE_RATE, text=text, words=words)
