"""`voxgate probe`: a barge-in and load tester for any Voxgate server.

Opens N WebRTC sessions (ramped up), has each speak scripted or random texts,
whole or streamed as tokens, interrupts some of them with `cancel` or by
talking into the microphone, and measures what a listener gets: time to first
audio (server- and client-side), cancel- and barge-in-to-silence, how well
`played_text` matches the audio that arrived, frame gaps and underruns, and
connection failures. Reports go to the terminal, JSON and a self-contained
HTML page with SVG plots. See docs/probe.md.

    voxgate probe http://127.0.0.1:8080 --sessions 8 --ramp-s 2 \
        --interrupt random --json probe.json --html probe.html
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import math
import random
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

SILENCE_RMS = 300.0  # received frames quieter than this count as silence
UNDERRUN_GAP_S = 0.060  # a frame arriving this long after the previous one, inside speech
DRAIN_SILENCE_S = 0.35  # the tail of an utterance is over after this much received silence
FALLBACK_WORDS_PER_S = 2.6  # for the voice when no utterance of the run finished

WORDS = (
    "the a quick small bright quiet river window morning garden train number signal voice system "
    "message weather coffee city road answer question friend music paper light water minute today "
    "runs waits brings keeps finds opens sends hears makes takes starts turns slowly gently again "
    "before after around over under through every always never really simply"
).split()

BARGE_IN_SPEECH = "Wait, stop, I have a question about that."


# Configuration
@dataclass
class ProbeConfig:
    url: str
    sessions: int = 1
    ramp_s: float = 0.0
    texts: list[str] = field(default_factory=list)  # empty: random texts
    utterances: int = 1  # per session
    stream: bool = False
    tokens_per_s: float = 20.0
    interrupt_at_ms: float | None = None  # after the first audible audio
    interrupt_random: bool = False
    interrupt_share: float = 1.0  # share of sessions that interrupt, when interrupting
    barge_in: str = "cancel"  # or "voice"
    voice: str | None = None
    seed: int = 1
    timeout_s: float = 60.0  # per utterance
    pause_s: float = 0.2  # between a session's utterances

    @property
    def interrupting(self) -> bool:
        return self.interrupt_at_ms is not None or self.interrupt_random

    def interrupts(self, session_index: int) -> bool:
        if not self.interrupting:
            return False
        count = round(self.interrupt_share * self.sessions)
        return session_index < count


# Results
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


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def random_text(rng: random.Random, words: int | None = None) -> str:
    n = words or rng.randint(8, 14)
    picked = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(picked).capitalize() + "."


def synthesize_speech_48k(text: str = BARGE_IN_SPEECH) -> np.ndarray:
    """Real speech from the embedded Piper voice at 48 kHz, for the probe's microphone."""
    import soxr

    from .engine.base import SynthesisOptions
    from .engine.piper_engine import PiperEngine

    engine = PiperEngine(threads=1)
    engine.load()
    chunks = list(engine.synthesize(text, SynthesisOptions()))
    pcm = np.concatenate([c.pcm for c in chunks])
    return soxr.resample(pcm, chunks[0].sample_rate, 48000).astype(np.int16)


def leading_silence_s(pcm: np.ndarray, rate: int, threshold: float = SILENCE_RMS) -> float:
    n = rate // 100
    for i in range(0, len(pcm) - n, n):
        if np.sqrt(np.mean(pcm[i : i + n].astype(np.float64) ** 2)) > threshold:
            return i / rate
    return 0.0


def _rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if len(pcm) else 0.0


# Server metrics
def parse_histogram(text: str, name: str) -> dict:
    """Buckets, sum and count of one Prometheus histogram (no labels)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            m = re.search(r'le="([^"]+)"\}\s+([0-9.eE+-]+)', line)
            if m:
                buckets[float(m.group(1))] = float(m.group(2))
        elif line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return {"buckets": buckets, "sum": total, "count": count}


def parse_counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def histogram_delta(before: dict, after: dict) -> dict:
    """What one run added to a server histogram: count, mean and bucket-bound quantiles."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"count": 0}
    buckets = sorted((le, after["buckets"].get(le, 0.0) - before["buckets"].get(le, 0.0)) for le in after["buckets"])

    def quantile(q: float) -> float | None:
        for le, cum in buckets:
            if cum >= q * count:
                return le * 1000.0
        return None

    return {
        "count": int(count),
        "mean_ms": (after["sum"] - before["sum"]) / count * 1000.0,
        "p50_ms_at_most": quantile(0.5),
        "p95_ms_at_most": quantile(0.95),
    }


def fetch_metrics(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=3) as resp:
            return resp.read().decode("utf-8", "replace")
    except Exception:
        return None


# One session
class SessionRunner:
    def __init__(self, config: ProbeConfig, index: int, t0: float, texts: list[str], speech: np.ndarray | None, progress: "ProgressTracker") -> None:
        self.config = config
        self.index = index
        self.t0 = t0
        self.texts = texts
        self.speech = speech
        self.speech_lead_s = leading_silence_s(speech, 48000) if speech is not None else 0.0
        self.progress = progress
        self.rng = random.Random(config.seed * 1000 + index)
        self.result = SessionResult(index=index, started_at=0.0, interrupts=config.interrupts(index))
        self.client = None

    def _rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.t0

    async def run(self) -> SessionResult:
        from .rtc_client import RtcClient

        cfg = self.config
        self.result.started_at = time.perf_counter() - self.t0
        client = RtcClient(cfg.url, mic=cfg.barge_in == "voice", voice=cfg.voice)
        self.client = client
        try:
            try:
                ready = await client.connect(timeout=min(cfg.timeout_s, 30.0))
            except Exception as exc:
                self.result.failure = f"{type(exc).__name__}: {exc}"[:300]
                self.progress.failed()
                return self.result
            self.result.connected_at = time.perf_counter() - self.t0
            self.result.session_id = client.session_id
            self.result.engine = ready.get("engine")
            self.progress.connected()
            for k, text in enumerate(self.texts):
                if k:
                    await asyncio.sleep(cfg.pause_s)
                await self._utterance(f"s{self.index}u{k + 1}", text)
                self.progress.utterance_done(self.result.utterances[-1])
                if self.result.failure:
                    break
        finally:
            # Frame arrival times, like every time in the results, count from the run's start.
            self.result.frames = [(t - self.t0, pcm) for t, pcm in client.audio.frames]
            self.result.sample_rate = client.audio.sample_rate
            self.result.closed_at = time.perf_counter() - self.t0
            try:
                await client.close()
            except Exception:
                pass
            self.progress.finished()
        return self.result

    async def _utterance(self, uid: str, text: str) -> None:
        cfg = self.config
        client = self.client
        sent = time.perf_counter()
        utt = UtteranceResult(id=uid, text=text, sent_at=sent - self.t0)
        self.result.utterances.append(utt)
        stop_sending = asyncio.Event()
        outcome = asyncio.get_running_loop().create_future()

        async def send() -> None:
            if not cfg.stream:
                client.send({"type": "speak", "text": text, "id": uid})
                return
            tokens = re.findall(r"\S+\s*", text)
            for token in tokens:
                if stop_sending.is_set():
                    return
                client.send({"type": "text.delta", "text": token, "id": uid})
                await asyncio.sleep(1.0 / cfg.tokens_per_s)
            if not stop_sending.is_set():
                client.send({"type": "text.end", "id": uid})

        async def interrupt() -> None:
            first = await self._first_sound(sent, outcome)
            if first is None:
                return
            if cfg.interrupt_at_ms is not None:
                offset = cfg.interrupt_at_ms / 1000.0
            else:
                offset = self.rng.uniform(0.3, 1.5)
            await asyncio.sleep(max(0.0, first + offset - time.perf_counter()))
            if outcome.done():
                return
            if cfg.barge_in == "voice" and client.mic is not None and self.speech is not None:
                client.mic.play(self.speech)
                utt.interrupt_at = (client.mic.playing_since or time.perf_counter()) + self.speech_lead_s - self.t0
                utt.interrupt_kind = "voice"
            else:
                utt.interrupt_at = client.send({"type": "cancel"}) - self.t0
                utt.interrupt_kind = "cancel"
                stop_sending.set()

        sender = asyncio.ensure_future(send())
        interrupter = asyncio.ensure_future(interrupt()) if self.result.interrupts else None
        deadline = sent + cfg.timeout_s
        try:
            while not outcome.done():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    utt.outcome = "timeout"
                    outcome.set_result(None)
                    break
                try:
                    event = await asyncio.wait_for(client.events.get(), remaining)
                except asyncio.TimeoutError:
                    continue
                self._on_event(event, uid, utt, outcome, stop_sending)
        finally:
            stop_sending.set()
            for task in (sender, interrupter):
                if task is not None and not task.done():
                    task.cancel()
        if utt.interrupt_kind and utt.outcome == "done":
            utt.outcome = "finished_first"
        await self._drain()
        utt.first_sound_at = self._rel(client.audio.first_sound_after(sent, SILENCE_RMS))
        if utt.first_sound_at is not None:
            utt.client_ttfa_ms = (utt.first_sound_at - utt.sent_at) * 1000.0

    def _on_event(self, event: dict, uid: str, utt: UtteranceResult, outcome: asyncio.Future, stop_sending: asyncio.Event) -> None:
        kind = event.get("type")
        if kind == "connection.state" and event.get("state") in ("failed", "closed"):
            self.result.failure = f"connection {event.get('state')} during {uid}"
            utt.outcome = "error"
            utt.error = self.result.failure
            if not outcome.done():
                outcome.set_result(None)
            return
        if event.get("id") != uid:
            return
        if kind == "audio.started":
            utt.server_ttfa_ms = event.get("ttfa_ms")
        elif kind == "utterance.done":
            utt.outcome = "done"
            utt.full_text = event.get("text")
            utt.played_ms = event.get("audio_ms")
            utt.played_text = event.get("text")
            outcome.set_result(None)
        elif kind == "utterance.interrupted":
            stop_sending.set()
            utt.outcome = "interrupted"
            utt.played_text = event.get("played_text")
            utt.played_ms = event.get("played_ms")
            utt.reason = event.get("reason")
            if utt.interrupt_kind is None:
                utt.interrupt_kind = event.get("reason")
            outcome.set_result(None)
        elif kind == "error" and event.get("code") != "utterance_interrupted":
            utt.outcome = "error"
            utt.error = f"{event.get('code')}: {event.get('message')}"
            stop_sending.set()
            outcome.set_result(None)

    async def _first_sound(self, since: float, outcome: asyncio.Future) -> float | None:
        frames = self.client.audio.frames
        i = 0
        while not outcome.done():
            while i < len(frames):
                t, pcm = frames[i]
                i += 1
                if t >= since and _rms(pcm) > SILENCE_RMS:
                    return t
            await asyncio.sleep(0.01)
        return None

    async def _drain(self) -> None:
        """Wait until the received audio has been silent for a while: the utterance's tail is in."""
        frames = self.client.audio.frames
        deadline = time.perf_counter() + 5.0
        while time.perf_counter() < deadline:
            last = self.client.audio.last_sound(SILENCE_RMS)
            now = time.perf_counter()
            if frames and (last is None or now - last >= DRAIN_SILENCE_S) and now - frames[-1][0] < 0.2:
                return
            await asyncio.sleep(0.05)


# Progress
class ProgressTracker:
    def __init__(self, config: ProbeConfig, callback: Callable[[ProbeProgress], None] | None) -> None:
        self.state = ProbeProgress(sessions=config.sessions, utterances_total=config.sessions * max(1, len(config.texts) or config.utterances))
        self.callback = callback

    def _changed(self) -> None:
        if self.callback is not None:
            self.callback(self.state)

    def connected(self) -> None:
        self.state.connected += 1
        self._changed()

    def failed(self) -> None:
        self.state.failed += 1
        self._changed()

    def finished(self) -> None:
        self.state.finished += 1
        self._changed()

    def utterance_done(self, utt: UtteranceResult) -> None:
        self.state.utterances_done += 1
        if utt.server_ttfa_ms is not None:
            self.state.ttfa_ms.append(utt.server_ttfa_ms)
        self._changed()


class TerminalProgress:
    """A one-line progress bar, redrawn with \\r on a terminal; silent elsewhere."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def __call__(self, p: ProbeProgress) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and p.finished < p.sessions:
            return
        self._last = now
        width = 30
        total = max(1, p.utterances_total)
        filled = int(width * min(p.utterances_done, total) / total)
        ttfa = f"  ttfa p50 {percentile(p.ttfa_ms, 50):.0f} ms" if p.ttfa_ms else ""
        line = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {p.utterances_done}/{total} utterances"
            f"  {p.connected}/{p.sessions} connected  {p.failed} failed{ttfa}"
        )
        self.stream.write(line)
        self.stream.flush()

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# The run
def plan_texts(config: ProbeConfig) -> list[list[str]]:
    rng = random.Random(config.seed)
    plans = []
    for i in range(config.sessions):
        if config.texts:
            count = max(config.utterances, 1)
            plans.append([config.texts[(i + k) % len(config.texts)] for k in range(count)])
        else:
            plans.append([random_text(rng) for _ in range(max(config.utterances, 1))])
    return plans


async def run_probe(config: ProbeConfig, progress: Callable[[ProbeProgress], None] | None = None) -> "ProbeReport":
    from . import rtc_client  # noqa: F401  (aiortc takes seconds to import: not inside the timed run)

    loop = asyncio.get_running_loop()
    speech = None
    if config.barge_in == "voice" and config.interrupting:
        speech = await loop.run_in_executor(None, synthesize_speech_48k, BARGE_IN_SPEECH)
    metrics_before = await loop.run_in_executor(None, fetch_metrics, config.url)
    tracker = ProgressTracker(config, progress)
    plans = plan_texts(config)
    tracker.state.utterances_total = sum(len(p) for p in plans)
    t0 = time.perf_counter()
    started = time.time()

    async def one(i: int) -> SessionResult:
        if config.sessions > 1 and config.ramp_s > 0:
            await asyncio.sleep(config.ramp_s * i / config.sessions)
        runner = SessionRunner(config, i, t0, plans[i], speech, tracker)
        try:
            return await runner.run()
        except Exception as exc:  # a probe bug costs one session's figures, not the run
            runner.result.failure = runner.result.failure or f"{type(exc).__name__}: {exc}"
            return runner.result

    results = await asyncio.gather(*(one(i) for i in range(config.sessions)))
    duration = time.perf_counter() - t0
    metrics_after = await loop.run_in_executor(None, fetch_metrics, config.url)
    report = await loop.run_in_executor(None, analyse, config, list(results), duration, started, metrics_before, metrics_after)
    return report


# Analysis
def analyse(
    config: ProbeConfig, sessions: list[SessionResult], duration: float, started: float, before: str | None, after: str | None
) -> "ProbeReport":
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
    from .engine import tone

    if not s.frames:
        return []
    times = np.array([t for t, _ in s.frames])
    loud = np.array([_rms(p) > SILENCE_RMS for _, p in s.frames])
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
            errors = [abs(u.words_played - u.words_expected) for u in voice_checked]
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

    def write_html(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(render_html(self))

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
                f"  server cancel→silence  n={c2s['count']}  mean {c2s['mean_ms']:.1f} ms  p95 ≤ {_ms(c2s.get('p95_ms_at_most'))}"
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
        lines.append(f"  frame gaps     max {_ms(fr['max_gap_ms'])}, p99 {_ms(fr['p99_gap_ms'])}, {fr['underruns']} underruns (> {UNDERRUN_GAP_S * 1000:.0f} ms inside speech)")
        if server:
            lines.append(f"  server pacer underruns during the run: {server.get('pacer_underruns', 0):.0f}")
        return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def _stat_line(name: str, stats: dict) -> str:
    if not stats.get("count"):
        return f"  {name:<14} -"
    return f"  {name:<14} p50 {_ms(stats['p50'])}  p95 {_ms(stats['p95'])}  max {_ms(stats['max'])}  (n={stats['count']})"


# HTML and SVG
COLORS = {
    "server": "#7a869a",
    "client": "#1f6feb",
    "cancel": "#d1242f",
    "voice": "#bf3989",
    "speech": "#2da44e",
    "waiting": "#e3b341",
    "tail": "#d1242f",
    "connecting": "#afb8c1",
    "silence": "#eaeef2",
}


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


class _Plot:
    """An SVG canvas with a plot area and labelled axes."""

    def __init__(self, width: int, height: int, left: int = 70, right: int = 20, top: int = 40, bottom: int = 55) -> None:
        self.w, self.h = width, height
        self.left, self.right, self.top, self.bottom = left, right, top, bottom
        self.parts: list[str] = []

    @property
    def pw(self) -> float:
        return self.w - self.left - self.right

    @property
    def ph(self) -> float:
        return self.h - self.top - self.bottom

    def add(self, s: str) -> None:
        self.parts.append(s)

    def title(self, text: str) -> None:
        self.add(f'<text x="{self.left}" y="22" class="title">{html.escape(text)}</text>')

    def axes(self, xticks, xmap, xlabel, yticks, ymap, ylabel) -> None:
        x0, y0, x1, y1 = self.left, self.top + self.ph, self.left + self.pw, self.top
        for t in yticks:
            y = ymap(t)
            self.add(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" class="grid"/>')
            self.add(f'<text x="{x0 - 8}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
        for t in xticks:
            x = xmap(t)
            self.add(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 5}" class="axis"/>')
            self.add(f'<text x="{x:.1f}" y="{y0 + 19}" class="tick" text-anchor="middle">{_fmt(t)}</text>')
        self.add(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" class="axis"/>')
        self.add(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" class="axis"/>')
        self.add(f'<text x="{x0 + self.pw / 2:.1f}" y="{self.h - 12}" class="label" text-anchor="middle">{html.escape(xlabel)}</text>')
        if ylabel:
            cy = self.top + self.ph / 2
            self.add(f'<text x="16" y="{cy:.1f}" class="label" text-anchor="middle" transform="rotate(-90 16 {cy:.1f})">{html.escape(ylabel)}</text>')

    def legend(self, items: list[tuple[str, str, str]], y: float = 18) -> None:
        """(label, color, shape) right-aligned at height y; shape is 'box', 'dot' or 'line'."""
        x = self.w - self.right
        for label, color, shape in reversed(items):
            width = 7.2 * len(label) + 22
            x -= width
            if shape == "dot":
                mark = f'<circle cx="{x + 6}" cy="{y}" r="5" fill="{color}"/>'
            elif shape == "line":
                mark = f'<line x1="{x + 5}" y1="{y - 7}" x2="{x + 5}" y2="{y + 7}" stroke="{color}" stroke-width="3"/>'
            else:
                mark = f'<rect x="{x}" y="{y - 6}" width="12" height="12" fill="{color}" rx="2"/>'
            self.add(mark + f'<text x="{x + 16}" y="{y + 4}" class="legend">{html.escape(label)}</text>')

    def svg(self, label: str) -> str:
        body = "\n".join(self.parts)
        return f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" viewBox="0 0 {self.w} {self.h}" width="{self.w}" height="{self.h}" role="img" aria-label="{html.escape(label)}">\n{body}\n</svg>'

    def empty(self, message: str) -> None:
        self.add(f'<text x="{self.left + self.pw / 2}" y="{self.top + self.ph / 2}" class="label" text-anchor="middle">{html.escape(message)}</text>')


def svg_ttfa_histogram(report: ProbeReport, width: int = 1080, height: int = 320) -> str:
    utts = report.utterances
    series = {
        "client (send → first sound)": ([u.client_ttfa_ms for u in utts if u.client_ttfa_ms is not None], COLORS["client"]),
        "server (audio.started ttfa_ms)": ([u.server_ttfa_ms for u in utts if u.server_ttfa_ms is not None], COLORS["server"]),
    }
    plot = _Plot(width, height)
    plot.title("Time to first audio")
    values = [v for vs, _ in series.values() for v in vs]
    if not values:
        plot.empty("no utterance produced audio")
        return plot.svg("TTFA histogram")
    hi = max(values)
    edges = nice_ticks(0.0, hi * 1.05 if hi > 0 else 1.0, 14)
    if edges[-1] <= hi:
        edges.append(edges[-1] + (edges[1] - edges[0]))
    counts = {name: np.histogram(vs, bins=edges)[0] for name, (vs, _) in series.items()}
    top = max(1, max(int(c.max()) for c in counts.values()))
    yticks = [t for t in nice_ticks(0, top, 5) if t == int(t)]
    ymax = max(yticks[-1], top)
    xmap = lambda v: plot.left + (v - edges[0]) / (edges[-1] - edges[0]) * plot.pw
    ymap = lambda v: plot.top + plot.ph - v / ymax * plot.ph
    plot.axes(edges[:: max(1, len(edges) // 10)], xmap, "time to first audio (ms)", yticks, ymap, "utterances")
    names = list(series)
    for b in range(len(edges) - 1):
        bw = (xmap(edges[b + 1]) - xmap(edges[b])) / len(names)
        for j, name in enumerate(names):
            n = int(counts[name][b])
            if n:
                x = xmap(edges[b]) + j * bw
                y = ymap(n)
                plot.add(
                    f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(1.0, bw - 2):.1f}" height="{plot.top + plot.ph - y:.1f}" '
                    f'fill="{series[name][1]}"><title>{html.escape(name)}: {n} in {_fmt(edges[b])}–{_fmt(edges[b + 1])} ms</title></rect>'
                )
    for j, (name, (vs, color)) in enumerate(series.items()):
        if vs:
            p50 = percentile(vs, 50)
            x = xmap(p50)
            plot.add(f'<line x1="{x:.1f}" y1="{plot.top - 4}" x2="{x:.1f}" y2="{plot.top + plot.ph}" stroke="#1f2328" stroke-dasharray="5 4" stroke-width="1.5"/>')
            label = f"{name.split()[0]} p50 {p50:.0f} ms"
            plot.add(f'<text x="{x + 5:.1f}" y="{plot.top + 12 + 15 * j}" class="legend" fill="{color}" style="fill:{color};font-weight:600">{html.escape(label)}</text>')
    plot.legend([(f"{name}" , color, "box") for name, (_, color) in series.items()] + [("median", "#1f2328", "line")])
    return plot.svg("TTFA histogram")


def svg_latency_over_time(report: ProbeReport, width: int = 1080, height: int = 320) -> str:
    utts = report.utterances
    points = [
        ("client ttfa", COLORS["client"], [(u.sent_at, u.client_ttfa_ms) for u in utts if u.client_ttfa_ms is not None]),
        ("server ttfa", COLORS["server"], [(u.sent_at, u.server_ttfa_ms) for u in utts if u.server_ttfa_ms is not None]),
        ("cancel → silence", COLORS["cancel"], [(u.interrupt_at, u.interrupt_to_silence_ms) for u in utts if u.interrupt_kind == "cancel" and u.interrupt_to_silence_ms is not None]),
        ("voice → silence", COLORS["voice"], [(u.interrupt_at, u.interrupt_to_silence_ms) for u in utts if u.interrupt_kind == "voice" and u.interrupt_to_silence_ms is not None]),
    ]
    points = [p for p in points if p[2]]
    plot = _Plot(width, height)
    plot.title("Latency over the run")
    if not points:
        plot.empty("no latencies measured")
        return plot.svg("latency over time")
    xmax = max(report.duration_s, max(x for _, _, ps in points for x, _ in ps)) or 1.0
    ymax_raw = max(y for _, _, ps in points for _, y in ps) or 1.0
    xticks = nice_ticks(0, xmax, 10)
    yticks = nice_ticks(0, ymax_raw * 1.05, 5)
    xmap = lambda v: plot.left + v / xticks[-1] * plot.pw
    ymap = lambda v: plot.top + plot.ph - v / yticks[-1] * plot.ph
    plot.axes(xticks, xmap, "time since the run started (s): when the text was sent, or when the interruption began", yticks, ymap, "latency (ms)")
    for name, color, ps in points:
        for x, y in ps:
            plot.add(f'<circle cx="{xmap(x):.1f}" cy="{ymap(y):.1f}" r="4.5" fill="{color}" fill-opacity="0.8"><title>{html.escape(name)}: {y:.1f} ms at {x:.2f} s</title></circle>')
    plot.legend([(name, color, "dot") for name, color, _ in points])
    return plot.svg("latency over time")


def svg_timeline(report: ProbeReport, width: int = 1080) -> str:
    sessions = report.sessions
    row = 26
    plot = _Plot(width, 64 + 55 + row * max(1, len(sessions)), left=90, top=64)
    plot.title("Sessions: speech, interruptions and silence")
    end = max([report.duration_s] + [s.closed_at or 0 for s in sessions]) or 1.0
    xticks = nice_ticks(0, end, 10)
    xmap = lambda v: plot.left + v / xticks[-1] * plot.pw
    y0 = plot.top
    plot.axes(xticks, xmap, "time since the run started (s)", [], lambda v: 0, "")
    for i, s in enumerate(sessions):
        y = y0 + i * row + 4
        h = row - 8
        plot.add(f'<text x="{plot.left - 8}" y="{y + h - 4}" class="tick" text-anchor="end">session {s.index}</text>')
        if s.connected_at is None:
            plot.add(f'<rect x="{xmap(s.started_at):.1f}" y="{y}" width="{max(2.0, xmap(s.closed_at or end) - xmap(s.started_at)):.1f}" height="{h}" fill="none" stroke="{COLORS["cancel"]}" stroke-dasharray="4 3"/>')
            plot.add(f'<text x="{xmap(s.started_at) + 6:.1f}" y="{y + h - 5}" class="fail">connection failed: {html.escape((s.failure or "")[:80])}</text>')
            continue
        plot.add(_bar(xmap, s.started_at, s.connected_at, y + h / 2 - 2, 4, COLORS["connecting"], "connecting"))
        plot.add(_bar(xmap, s.connected_at, s.closed_at or end, y, h, COLORS["silence"], "silence"))
        for u in s.utterances:
            if u.first_sound_at is not None:
                plot.add(_bar(xmap, u.sent_at, u.first_sound_at, y + h / 2 - 2, 4, COLORS["waiting"], f"{u.id}: waiting for first audio {u.client_ttfa_ms or 0:.0f} ms"))
                speech_end = u.last_sound_at or u.first_sound_at
                interrupted = u.interrupt_at is not None and u.outcome == "interrupted"
                cut = min(speech_end, u.interrupt_at) if interrupted else speech_end
                plot.add(_bar(xmap, u.first_sound_at, cut, y, h, COLORS["speech"], f"{u.id}: speech ({u.outcome})"))
                if interrupted and speech_end > u.interrupt_at:
                    plot.add(_bar(xmap, u.interrupt_at, speech_end, y, h, COLORS["tail"], f"{u.id}: still audible after the interruption {u.interrupt_to_silence_ms or 0:.0f} ms"))
            if u.interrupt_at is not None:
                x = xmap(u.interrupt_at)
                color = COLORS["voice"] if u.interrupt_kind == "voice" else COLORS["cancel"]
                plot.add(f'<line x1="{x:.1f}" y1="{y - 3}" x2="{x:.1f}" y2="{y + h + 3}" stroke="{color}" stroke-width="2.5"><title>{u.id}: {u.interrupt_kind} at {u.interrupt_at:.2f} s</title></line>')
    plot.legend([
        ("connecting", COLORS["connecting"], "box"),
        ("waiting for audio", COLORS["waiting"], "box"),
        ("speech", COLORS["speech"], "box"),
        ("audible after interrupt", COLORS["tail"], "box"),
        ("silence", COLORS["silence"], "box"),
        ("cancel", COLORS["cancel"], "line"),
        ("voice barge-in", COLORS["voice"], "line"),
    ], y=46)
    return plot.svg("session timeline")


def _bar(xmap, t0: float, t1: float, y: float, h: float, color: str, title: str) -> str:
    x0, x1 = xmap(t0), xmap(max(t0, t1))
    return f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(1.5, x1 - x0):.1f}" height="{h:.1f}" fill="{color}" rx="2"><title>{html.escape(title)}</title></rect>'


_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 24px auto; max-width: 1100px; padding: 0 12px; }
h1 { font-size: 22px; margin: 0 0 4px; } .sub { color: #57606a; margin-bottom: 16px; }
.cards { display: grid; grid-template-columns: repeat(4, 1fr); gap: 10px; margin: 16px 0; }
.card { border: 1px solid #d0d7de; border-radius: 8px; padding: 10px 12px; }
.card .k { color: #57606a; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 600; } .card .d { color: #57606a; font-size: 12px; }
.bad .v { color: #d1242f; }
section { margin: 22px 0; } svg.plot { width: 100%; height: auto; border: 1px solid #d0d7de; border-radius: 8px; background: #fff; }
svg .title { font-size: 16px; font-weight: 600; fill: #1f2328; } svg .tick { font-size: 12px; fill: #57606a; }
svg .label { font-size: 13px; fill: #1f2328; } svg .legend { font-size: 12px; fill: #1f2328; }
svg .grid { stroke: #eaeef2; } svg .axis { stroke: #8c959f; } svg .fail { font-size: 12px; fill: #d1242f; }
table { border-collapse: collapse; width: 100%; font-size: 13px; } th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eaeef2; }
th { color: #57606a; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
"""


def render_html(report: ProbeReport) -> str:
    f = report.figures()
    cfg = report.config

    def card(key: str, value: str, detail: str = "", bad: bool = False) -> str:
        return f'<div class="card{" bad" if bad else ""}"><div class="k">{html.escape(key)}</div><div class="v">{html.escape(value)}</div><div class="d">{html.escape(detail)}</div></div>'

    def p(stats: dict, key: str) -> str:
        v = stats.get(key) if stats else None
        return "-" if v is None else f"{v:.0f} ms"

    cards = [
        card("sessions", f"{f['sessions']['connected']}/{f['sessions']['total']}", f"{f['sessions']['failed']} connection failures", f["sessions"]["failed"] > 0),
        card("ttfa client p50", p(f["ttfa_client_ms"], "p50"), f"p95 {p(f['ttfa_client_ms'], 'p95')}, max {p(f['ttfa_client_ms'], 'max')}"),
        card("ttfa server p50", p(f["ttfa_server_ms"], "p50"), f"p95 {p(f['ttfa_server_ms'], 'p95')}, max {p(f['ttfa_server_ms'], 'max')}"),
    ]
    for kind, stats in f["interrupt_to_silence_ms"].items():
        cards.append(card(f"{kind} → silence p50", p(stats, "p50"), f"p95 {p(stats, 'p95')}, max {p(stats, 'max')}"))
    acc = f["played_text"]
    if "tone" in acc:
        t = acc["tone"]
        cards.append(card("played_text exact", f"{t['exact']}/{t['checked']}", f"{t['off_by_one']} off by one, {t['mismatch']} mismatched", t["mismatch"] > 0))
    if "voice" in acc:
        v = acc["voice"]
        cards.append(card("played_text (voice)", f"±{v['mean_abs_word_error']:.1f} words", f"{v['within_2_words']}/{v['checked']} within 2 words"))
    fr = f["frames"]
    cards.append(card("frame gaps", f"max {fr['max_gap_ms']:.0f} ms" if fr["max_gap_ms"] is not None else "-", f"p99 {_ms(fr['p99_gap_ms'])}, {fr['underruns']} underruns", fr["underruns"] > 0))

    rows = []
    for s in report.sessions:
        for u in s.utterances or [None]:
            if u is None:
                rows.append(f"<tr><td>{s.index}</td><td colspan=8>{html.escape(s.failure or 'no utterances')}</td></tr>")
                continue
            rows.append(
                "<tr>" + "".join([
                    f"<td>{s.index}</td><td>{html.escape(u.id)}</td><td>{html.escape(u.outcome)}</td>",
                    f'<td class="num">{_num(u.server_ttfa_ms)}</td><td class="num">{_num(u.client_ttfa_ms)}</td>',
                    f"<td>{html.escape(u.interrupt_kind or '')}</td><td class=\"num\">{_num(u.interrupt_to_silence_ms)}</td>",
                    f"<td>{html.escape(u.accuracy or '')}</td><td>{html.escape((u.played_text or '')[:80])}</td>",
                ]) + "</tr>"
            )
    mode = "streamed tokens" if cfg.stream else "whole texts"
    interrupt = "no interruptions"
    if cfg.interrupting:
        at = "random offsets" if cfg.interrupt_random else f"{cfg.interrupt_at_ms:.0f} ms"
        interrupt = f"{cfg.barge_in} interruptions at {at} into the audio, {round(cfg.interrupt_share * cfg.sessions)} of {cfg.sessions} sessions"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>voxgate probe report</title><style>{_CSS}</style></head>
<body>
<h1>Voxgate probe report</h1>
<div class="sub">{html.escape(cfg.url)} · {cfg.sessions} sessions ramped over {cfg.ramp_s:g} s · {mode} · {html.escape(interrupt)} · {report.duration_s:.1f} s · {html.escape(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.started)))}</div>
<div class="cards">{"".join(cards)}</div>
<section>{svg_ttfa_histogram(report)}</section>
<section>{svg_latency_over_time(report)}</section>
<section>{svg_timeline(report)}</section>
<section><h2>Utterances</h2><table><tr><th>session</th><th>id</th><th>outcome</th><th>ttfa server</th><th>ttfa client</th><th>interrupt</th><th>→ silence</th><th>played_text check</th><th>played_text</th></tr>
{"".join(rows)}</table></section>
<section><h2>Figures</h2><pre>{html.escape(json.dumps(f, indent=2))}</pre></section>
</body></html>
"""


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.0f} ms"


# Command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8080", help="the Voxgate server (default http://127.0.0.1:8080)")
    parser.add_argument("--sessions", type=int, default=1, help="WebRTC sessions to open")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="spread the session starts over this many seconds")
    parser.add_argument("--text", action="append", default=None, help="a text to speak (repeatable; default: random texts)")
    parser.add_argument("--texts-file", default=None, help="texts to speak, one a line")
    parser.add_argument("--utterances", type=int, default=1, help="utterances per session")
    parser.add_argument("--stream", action="store_true", help="stream each text as text.delta tokens, then text.end")
    parser.add_argument("--tokens-per-s", type=float, default=20.0, help="token rate with --stream")
    parser.add_argument("--interrupt-at-ms", type=float, default=None, help="interrupt this long after the first audible audio")
    parser.add_argument("--interrupt", choices=["random"], default=None, help="interrupt at a random offset (0.3-1.5 s into the audio)")
    parser.add_argument("--interrupt-share", type=float, default=1.0, help="share of the sessions that interrupt (0-1)")
    parser.add_argument("--barge-in", choices=["cancel", "voice"], default="cancel", help="interrupt with a cancel message, or by talking into the microphone")
    parser.add_argument("--voice", default=None, help="server voice to ask for")
    parser.add_argument("--seed", type=int, default=1, help="seed for random texts and offsets")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="give up on an utterance after this long")
    parser.add_argument("--json", dest="json_path", default=None, help="write the JSON report here")
    parser.add_argument("--html", dest="html_path", default=None, help="write the HTML report here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from(args: argparse.Namespace) -> ProbeConfig:
    texts = list(args.text or [])
    if args.texts_file:
        with open(args.texts_file, encoding="utf-8") as f:
            texts.extend(line.strip() for line in f if line.strip())
    if args.sessions < 1:
        raise SystemExit("voxgate probe: --sessions must be at least 1")
    if not 0.0 <= args.interrupt_share <= 1.0:
        raise SystemExit("voxgate probe: --interrupt-share must be from 0 to 1")
    return ProbeConfig(
        url=args.url,
        sessions=args.sessions,
        ramp_s=args.ramp_s,
        texts=texts,
        utterances=max(args.utterances, 1),
        stream=args.stream,
        tokens_per_s=args.tokens_per_s,
        interrupt_at_ms=args.interrupt_at_ms,
        interrupt_random=args.interrupt == "random",
        interrupt_share=args.interrupt_share,
        barge_in=args.barge_in,
        voice=args.voice,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )


def main(args: argparse.Namespace) -> int:
    config = config_from(args)
    bar = TerminalProgress()
    report = asyncio.run(run_probe(config, None if args.quiet else bar))
    bar.end()
    print(report.summary_text())
    if args.json_path:
        report.write_json(args.json_path)
        print(f"  JSON report: {args.json_path}")
    if args.html_path:
        report.write_html(args.html_path)
        print(f"  HTML report: {args.html_path}")
    figures = report.figures()
    return 1 if figures["sessions"]["failed"] else 0
