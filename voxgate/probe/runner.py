"""The WebRTC side of a probe: one `SessionRunner` per session (connect, speak, interrupt, record), and `run_probe`."""

from __future__ import annotations

import asyncio
import random
import re
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from .analysis import analyse, leading_silence_s, rms
from .config import (
    BARGE_IN_SPEECH,
    DRAIN_SILENCE_S,
    SILENCE_RMS,
    ProbeConfig,
    plan_texts,
)
from .metrics import fetch_metrics

if TYPE_CHECKING:
    from ..rtc_client import RtcClient
from .progress import ProgressTracker
from .report import ProbeReport
from .results import ProbeProgress, SessionResult, UtteranceResult


def synthesize_speech_48k(text: str = BARGE_IN_SPEECH) -> np.ndarray:
    """Real speech from the embedded Piper voice at 48 kHz, for the probe's microphone."""
    import soxr

    from ..engine.base import SynthesisOptions
    from ..engine.piper.piper_engine import PiperEngine

    engine = PiperEngine(threads=1)
    engine.load()
    chunks = list(engine.synthesize(text, SynthesisOptions()))
    pcm = np.concatenate([c.pcm for c in chunks])
    return soxr.resample(pcm, chunks[0].sample_rate, 48000).astype(np.int16)


# One session
class SessionRunner:
    def __init__(self, config: ProbeConfig, index: int, t0: float, texts: list[str], speech: np.ndarray | None, progress: ProgressTracker) -> None:
        self.config = config
        self.index = index
        self.t0 = t0
        self.texts = texts
        self.speech = speech
        self.speech_lead_s = leading_silence_s(speech, 48000) if speech is not None else 0.0
        self.progress = progress
        self.rng = random.Random(config.seed * 1000 + index)
        self.result = SessionResult(index=index, started_at=0.0, interrupts=config.interrupts(index))
        self._client: RtcClient | None = None

    @property
    def client(self) -> RtcClient:
        """The session's client, from the moment `run` makes it."""
        assert self._client is not None, "the session has not started"
        return self._client

    def _rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.t0

    async def run(self) -> SessionResult:
        from ..rtc_client import RtcClient

        cfg = self.config
        self.result.started_at = time.perf_counter() - self.t0
        client = RtcClient(cfg.url, mic=cfg.barge_in == "voice", voice=cfg.voice)
        self._client = client
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
                if t >= since and rms(pcm) > SILENCE_RMS:
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


async def run_probe(config: ProbeConfig, progress: Callable[[ProbeProgress], None] | None = None) -> ProbeReport:
    from .. import rtc_client  # noqa: F401  (aiortc takes seconds to import: not inside the timed run)

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
