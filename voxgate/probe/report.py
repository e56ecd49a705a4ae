"""The probe's report: figures from the results, the terminal summary, and the JSON and HTML files."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .config import FALLBACK_WORDS_PER_S, UNDERRUN_GAP_S, ProbeConfig
from .results import SessionResult, UtteranceResult, format_ms, percentile, summarize


@dataclass
class ProbeReport:
    config: ProbeConfig
    sessions: list[SessionResult]
    duration_s: float
    started: float
    words_per_s: float = FALLBACK_WORDS_PER_S
    gaps_ms: list[float] = field(default_factory=list)
    server: dict | None = None

    @property
    def utterances(self) -> list[UtteranceResult]:
        return [u for s in self.sessions for u in s.utterances]

    def figures(self) -> dict:
        utts = self.utterances
        outcomes: dict[str, int] = {}
        for u in utts:
            outcomes[u.outcome] = outcomes.get(u.outcome, 0) + 1
        interrupts = {}
        for kind in ("cancel", "voice"):
            values = [u.interrupt_to_silence_ms for u in utts if u.interrupt_kind == kind and u.interrupt_to_silence_ms is not None]
            if values:
                interrupts[kind] = summarize(values)
        tone_checked = [u for u in utts if u.accuracy in ("exact", "off_by_one", "mismatch")]
        voice_checked = [u for u in utts if u.accuracy == "words_error"]
        accuracy: dict = {}
        if tone_checked:
            accuracy["tone"] = {
                "checked": len(tone_checked),
                "exact": sum(u.accuracy == "exact" for u in tone_checked),
                "off_by_one": sum(u.accuracy == "off_by_one" for u in tone_checked),
                "mismatch": sum(u.accuracy == "mismatch" for u in tone_checked),
            }
        if voice_checked:
            # analysis.py sets both counts wherever it says "words_error".
            errors = [abs(played - expected) for u in voice_checked
                      if (played := u.words_played) is not None and (expected := u.words_expected) is not None]
            accuracy["voice"] = {
                "checked": len(voice_checked),
                "mean_abs_word_error": float(np.mean(errors)),
                "within_2_words": sum(e <= 2 for e in errors),
                "words_per_s": round(self.words_per_s, 2),
            }
        failures = [{"session": s.index, "reason": s.failure} for s in self.sessions if s.failure]
        return {
            "sessions": {
                "total": len(self.sessions),
                "connected": sum(s.connected_at is not None for s in self.sessions),
                "failed": len(failures),
                "failures": failures,
            },
            "utterances": {"total": len(utts), "outcomes": outcomes},
            "ttfa_server_ms": summarize([u.server_ttfa_ms for u in utts if u.server_ttfa_ms is not None]),
            "ttfa_client_ms": summarize([u.client_ttfa_ms for u in utts if u.client_ttfa_ms is not None]),
            "interrupt_to_silence_ms": interrupts,
            "played_text": accuracy,
            "frames": {
                "gaps": len(self.gaps_ms),
                "max_gap_ms": max(self.gaps_ms) if self.gaps_ms else None,
                "p99_gap_ms": percentile(self.gaps_ms, 99),
                "underruns": sum(u.underruns for u in utts),
            },
            "server": self.server,
        }

    def to_dict(self) -> dict:
        def session(s: SessionResult) -> dict:
            d = asdict(s)
            d.pop("frames", None)
            return d

        return {
            "probe": 1,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "duration_s": round(self.duration_s, 3),
            "config": asdict(self.config),
            "figures": self.figures(),
            "sessions": [session(s) for s in self.sessions],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def summary_text(self) -> str:
        f = self.figures()
        lines = [f"voxgate probe: {self.config.url}, {f['sessions']['total']} sessions, {self.duration_s:.1f} s"]
        s = f["sessions"]
        lines.append(f"  sessions       {s['connected']} connected, {s['failed']} failed")
        for failure in s["failures"][:5]:
            lines.append(f"    session {failure['session']}: {failure['reason']}")
        outcomes = ", ".join(f"{n} {k}" for k, n in sorted(f["utterances"]["outcomes"].items()))
        lines.append(f"  utterances     {f['utterances']['total']} ({outcomes})")
        lines.append(_stat_line("ttfa server", f["ttfa_server_ms"]))
        lines.append(_stat_line("ttfa client", f["ttfa_client_ms"]))
        for kind, stats in f["interrupt_to_silence_ms"].items():
            lines.append(_stat_line(f"{kind}→silence", stats))
        server = f.get("server") or {}
        c2s = server.get("cancel_to_silence") or {}
        if c2s.get("count"):
            lines.append(
                f"  server cancel→silence  n={c2s['count']}  mean {c2s['mean_ms']:.1f} ms  p95 ≤ {format_ms(c2s.get('p95_ms_at_most'))}"
            )
        acc = f["played_text"]
        if "tone" in acc:
            t = acc["tone"]
            lines.append(f"  played_text    {t['exact']} exact, {t['off_by_one']} off by one, {t['mismatch']} mismatched of {t['checked']} (tone, decoded)")
        if "voice" in acc:
            v = acc["voice"]
            lines.append(
                f"  played_text    mean |words − audible estimate| {v['mean_abs_word_error']:.1f}, "
                f"{v['within_2_words']}/{v['checked']} within 2 words (voice, {v['words_per_s']} words/s)"
            )
        fr = f["frames"]
        lines.append(f"  frame gaps     max {format_ms(fr['max_gap_ms'])}, p99 {format_ms(fr['p99_gap_ms'])}, {fr['underruns']} underruns (> {UNDERRUN_GAP_S * 1000:.0f} ms inside speech)")
        if server:
            lines.append(f"  server pacer underruns during the run: {server.get('pacer_underruns', 0):.0f}")
        return "\n".join(lines)


def _stat_line(name: str, stats: dict) -> str:
    if not stats.get("count"):
        return f"  {name:<14} -"
    return f"  {name:<14} p50 {format_ms(stats['p50'])}  p95 {format_ms(stats['p95'])}  max {format_ms(stats['max'])}  (n={stats['count']})"
