"""Word timings for Piper (piper_engine.py, and the torch port): a unit's written text
shared among espeak's sentences, and each word's span from the phoneme alignment."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base import WordTiming, words_by_length


@dataclass
class Sentence:
    """One espeak sentence (or capped piece of one) of a unit, as both Piper engines
    see it before their own stages: each adds what its graph needs."""

    text: str
    phonemes: list[str]
    ids: list[int]  # the voice's phoneme ids
    last_of_unit: bool
    windows: int = 0  # windows emitted so far
    words: list[WordTiming] = field(default_factory=list)


def split_words_over(text: str, sentences: list[list[str]]) -> list[str]:
    """Share a unit's written text among espeak's sentences, by phoneme count."""
    if len(sentences) <= 1:
        return [text]
    words = text.split(" ")
    counts = [max(1, p.count(" ") + 1) for p in sentences]
    out, pos = [], 0
    for i, n in enumerate(counts):
        if i == len(counts) - 1:
            out.append(" ".join(words[pos:]))
        else:
            out.append(" ".join(words[pos : pos + n]) + " ")
            pos += n
    return out


def word_timings(text, phonemes, ids, id_samples, loaded, duration) -> list[WordTiming]:
    """Word timings from Piper's phoneme alignment.

    espeak marks word gaps with a space phoneme. When its word count matches the
    written words, each written word gets its phonemes' span; otherwise (numbers
    expanded into several words, say) the words are spread by length.
    """
    words = text.split()
    if id_samples is None or len(id_samples) != len(ids) or not words:
        return words_by_length(text, duration)
    id_map = loaded.voice.config.phoneme_id_map
    pad = id_map.get("_", [0])
    # Sample offset at which each phoneme starts: BOS + pad, then phoneme + pad each.
    sr = loaded.sample_rate
    samples = np.asarray(id_samples, dtype=np.float64).reshape(-1)
    pos = 0
    idx = 0
    # BOS (^) and its pad
    bos = id_map.get("^", [])
    step = len(bos) + len(pad)
    pos += samples[idx : idx + step].sum()
    idx += step
    spans: list[list[float]] = []
    current_start = None
    for ph in phonemes:
        n = len(id_map.get(ph, [])) + len(pad)
        seg = samples[idx : idx + n].sum()
        if ph == " ":
            if current_start is not None:
                spans.append([current_start, pos])
                current_start = None
        elif current_start is None and ph not in ",.!?;:":
            current_start = pos
        pos += seg
        idx += n
    if current_start is not None:
        spans.append([current_start, pos])
    if len(spans) != len(words):
        return words_by_length(text, duration)
    # The last word keeps the sentence's closing pause (the end token's, after the
    # period's, which is in it already): the words end where the audio does, so a
    # client that cuts or captions by word time loses none of it (0-93 ms were left out).
    if duration * sr > spans[-1][0]:
        spans[-1][1] = max(spans[-1][1], duration * sr)
    return [WordTiming(w, s / sr, e / sr) for w, (s, e) in zip(words, spans)]
