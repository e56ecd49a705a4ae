"""From recorded frames and events to figures: first and last sound, gaps, interrupt-to-silence, played_text checks."""

from __future__ import annotations

import math

import numpy as np

from .config import FALLBACK_WORDS_PER_S, SILENCE_RMS, UNDERRUN_GAP_S, ProbeConfig
from .metrics import histogram_delta, parse_counter, parse_histogram
from .report import ProbeReport
from .results import SessionResult


def leading_silence_s(pcm: np.ndarray, rate: int, threshold: float = SILENCE_RMS) -> float:
    n = rate // 100
    for i in range(0, len(pcm) - n, n):
        if np.sqrt(np.mean(pcm[i : i + n].astype(np.float64) ** 2)) > threshold:
            return i / rate
    return 0.0


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if len(pcm) else 0.0


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def analyse(
    config: ProbeConfig, sessions: list[SessionResult], duration: float, started: float, before: str | None, after: str | None
) -> ProbeReport:
    """Turn recorded frames and events into figures. Times are seconds since the run's start."""
    done_words = done_s = 0.0
    for s in sessions:
        for u in s.utterances:
            if u.outcome == "done" and u.played_text and u.played_ms:
                done_words += len(u.played_text.split())
                done_s += u.played_ms / 1000.0
    words_per_s = done_words / done_s if done_s > 0 else FALLBACK_WORDS_PER_S
    gaps: list[float] = []
    for s in sessions:
        gaps.extend(_analyse_session(s, words_per_s))
    report = ProbeReport(config=config, sessions=sessions, duration_s=duration, started=started, words_per_s=words_per_s, gaps_ms=gaps)
    if before is not None and after is not None:
        name = "voxgate_cancel_to_silence_seconds"
        report.server = {
            "cancel_to_silence": histogram_delta(parse_histogram(before, name), parse_histogram(after, name)),
            "ttfa": histogram_delta(parse_histogram(before, "voxgate_ttfa_seconds"), parse_histogram(after, "voxgate_ttfa_seconds")),
            "pacer_underruns": parse_counter(after, "voxgate_pacer_underruns_total") - parse_counter(before, "voxgate_pacer_underruns_total"),
        }
    return report


def _analyse_session(s: SessionResult, words_per_s: float) -> list[float]:
    from ..engine import tone

    if not s.frames:
        return []
    times = np.array([t for t, _ in s.frames])
    loud = np.array([rms(p) > SILENCE_RMS for _, p in s.frames])
    gaps_ms: list[float] = []
    for k, u in enumerate(s.utterances):
        hi = s.utterances[k + 1].sent_at if k + 1 < len(s.utterances) else math.inf
        window = np.nonzero((times >= u.sent_at) & (times < hi))[0]
        heard = window[loud[window]]
        if heard.size == 0:
            continue
        u.first_sound_at = float(times[heard[0]])
        u.last_sound_at = float(times[heard[-1]])
        u.client_ttfa_ms = (u.first_sound_at - u.sent_at) * 1000.0
        # Arrival gaps between frames while speech was arriving.
        span = times[heard[0] : heard[-1] + 1]
        if span.size > 1:
            diffs = np.diff(span) * 1000.0
            gaps_ms.extend(diffs.tolist())
            u.max_gap_ms = float(diffs.max())
            u.underruns = int(np.count_nonzero(diffs > UNDERRUN_GAP_S * 1000.0))
        if u.interrupt_at is not None and u.outcome == "interrupted":
            after = heard[times[heard] > u.interrupt_at]
            u.interrupt_to_silence_ms = max(0.0, float(times[after[-1]]) - u.interrupt_at) * 1000.0 if after.size else 0.0
        if s.engine == "tone" and u.played_text is not None:
            pcm = np.concatenate([s.frames[i][1] for i in window])
            decoded = tone.decode(pcm, s.sample_rate)
            u.decoded_text = decoded.strip()
            # A space at either end is a symbol too; compare with and without the ends.
            distance = min(
                _distance(decoded, u.played_text),
                _distance(u.decoded_text, u.played_text.strip()),
            )
            u.accuracy = "exact" if distance == 0 else "off_by_one" if distance <= 1 else "mismatch"
        elif u.played_text is not None:
            u.words_played = len(u.played_text.split())
            u.words_expected = round((u.last_sound_at - u.first_sound_at + 0.02) * words_per_s, 1)
            u.accuracy = "words_error"
    return gaps_ms


def _distance(a: str, b: str) -> int:
    return levenshtein(a, b) if abs(len(a) - len(b)) <= 2 else 99
