"""What a probe run records: per utterance, per session, the live progress counts, and the summary statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class UtteranceResult:
    id: str
    text: str
    sent_at: float  # seconds since the run started
    outcome: str = "pending"  # done, interrupted, error, timeout, finished_first (ended before the interrupt)
    server_ttfa_ms: float | None = None
    client_ttfa_ms: float | None = None
    first_sound_at: float | None = None
    last_sound_at: float | None = None
    interrupt_at: float | None = None
    interrupt_kind: str | None = None
    reason: str | None = None  # the server's utterance.interrupted reason
    interrupt_to_silence_ms: float | None = None
    played_text: str | None = None
    played_ms: float | None = None
    full_text: str | None = None
    decoded_text: str | None = None
    accuracy: str | None = None  # exact, off_by_one, mismatch (tone); words_error (voice)
    words_played: int | None = None
    words_expected: float | None = None
    max_gap_ms: float | None = None
    underruns: int = 0
    error: str | None = None


@dataclass
class SessionResult:
    index: int
    started_at: float
    connected_at: float | None = None
    closed_at: float | None = None
    session_id: str | None = None
    engine: str | None = None
    failure: str | None = None
    interrupts: bool = False
    utterances: list[UtteranceResult] = field(default_factory=list)
    # Raw material for the analysis; not reported.
    frames: list = field(default_factory=list, repr=False)
    sample_rate: int = 48000


@dataclass
class ProbeProgress:
    sessions: int
    connected: int = 0
    failed: int = 0
    finished: int = 0
    utterances_done: int = 0
    utterances_total: int = 0
    ttfa_ms: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "max": max(values) if values else None,
    }


def format_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
