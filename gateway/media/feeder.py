"""Engine audio in, encoded frames out: one session's utterances, in order, into its playout.

Per utterance: engine chunks (any rate) -> resample to the encoder's rate ->
whole 20 ms frames -> packets, on the shared encode pool -> the playout.
An utterance's first 60 ms are encoded on their own and ahead of everyone
else's work, so first audio does not wait for a whole chunk; the rest goes in
0.1 s slices, and only up to a second ahead of playout, so encoding follows
the audio instead of arriving in bursts that hold the GIL while other
sessions' frames are due.

The voice starts every utterance with 20-60 ms of near-digital silence, which
a caller hears as latency: `LeadingSilence` cuts it from an utterance's first
audio, keeping KEEP_MS before the first sample over SILENCE_LEVEL so the onset
is not clipped, and the words' times move back by what was cut, so they stay
on the audio as played (`played_text`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

import numpy as np

from ...engine.errors import EngineCrashed, EngineStreamError, EngineUnavailable, public_engine_error
from ...engine.stream import TTSStream
from .encode_pool import FIRST, LATER, encode_pool
from .encoder import FrameEncoder
from .frames import FRAME_MS, FRAME_S, Framer
from .playout import Playout, UtterancePlay
from .resample import StreamResampler, held_back_s
from .session_metrics import SessionMetrics

FIRST_SLICE_S = 0.06
SLICE_S = 0.1
ENCODE_AHEAD_MS = 1000
SILENCE_LEVEL = 50  # int16 steps (about -56 dBFS): the voice's leading silence stays within +-2
KEEP_MS = 5  # kept before the first sample over it, so the onset is not clipped
MAX_TRIM_MS = 200  # at most this much is cut, however quietly an utterance begins


class LeadingSilence:
    """Cuts the silence an utterance's audio begins with (engine PCM, its own rate), once."""

    def __init__(self, rate: int) -> None:
        self.keep = int(rate * KEEP_MS / 1000)
        self.budget = int(rate * MAX_TRIM_MS / 1000)
        self.rate = rate
        self.done = False
        self.trimmed = 0  # samples cut
        self._held = np.zeros(0, np.int16)  # the last KEEP_MS of an all-quiet chunk, until the next

    @property
    def trimmed_s(self) -> float:
        return self.trimmed / self.rate

    def cut(self, pcm: np.ndarray) -> np.ndarray:
        """The audio to play of the next chunk: less the silence, while it lasts."""
        if self.done:
            return pcm
        if len(self._held):
            pcm = np.concatenate([self._held, pcm])
        loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > SILENCE_LEVEL)
        drop = max(0, (loud[0] if len(loud) else len(pcm)) - self.keep)
        drop = min(drop, self.budget)
        self.budget -= drop
        self.trimmed += drop
        self.done = bool(len(loud)) or self.budget == 0
        if self.done:
            self._held = pcm[:0]
            return pcm[drop:]
        self._held = pcm[drop:]
        return pcm[:0]

    def rest(self) -> np.ndarray:
        """What is held back when the audio ends before anything was loud."""
        held, self._held = self._held, self._held[:0]
        return held


class UtteranceAudio:
    """Engine PCM to wire packets for one utterance: resample, cut into frames, encode.

    Used by one pool job at a time (the feeder awaits each), so its state needs no lock.
    """

    def __init__(self, encoder: FrameEncoder, in_rate: int) -> None:
        self.encoder = encoder
        self.resampler = StreamResampler(in_rate, encoder.sample_rate)
        self.framer = Framer(encoder.sample_rate)

    def encode(self, pcm: np.ndarray, last: bool = False) -> list[bytes]:
        frames = self.framer.push(self.resampler.process(pcm, last=last), last=last)
        return self.encoder.encode(frames) if len(frames) else []


def listener_lag_s(engine_rate: int, wire_rate: int) -> float:
    """How much of an utterance's audio UtteranceAudio keeps from the listener
    until its last chunk, on average: the resampler's hold, and half a frame in
    the framer (what is left over is less than a frame). The engine worker's
    deadlines subtract it (EngineClient.stream's held_s): without it, a stream's
    listener ran dry that much before the worker reckoned."""
    return held_back_s(engine_rate, wire_rate) + FRAME_S / 2


class Speech(Protocol):
    """What the feeder reads and marks of an utterance (the utterance queue's `Utterance`)."""

    id: str
    stream: TTSStream
    play: UtterancePlay
    started_sent: bool


class Feeder:
    """Feeds the session's utterances, oldest first, until stopped."""

    def __init__(
        self,
        encoder: FrameEncoder,
        playout: Playout,
        *,
        next_utterance: Callable[[], Speech | None],
        emit: Callable[[dict], None],
        metrics: SessionMetrics,
        on_words: Callable[[UtterancePlay, list], None] | None = None,
    ) -> None:
        self.encoder = encoder
        self.on_words = on_words
        self.playout = playout
        self.next_utterance = next_utterance
        self.emit = emit
        self.metrics = metrics
        self._wake = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    def wake(self) -> None:
        """A new utterance was queued."""
        self._wake.set()

    def stop(self) -> None:
        self.task.cancel()

    async def _run(self) -> None:
        try:
            while True:
                utt = self.next_utterance()
                if utt is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._feed(utt)
        except asyncio.CancelledError:
            pass

    async def _feed(self, utt: Speech) -> None:
        play = utt.play
        if not utt.started_sent:
            utt.started_sent = True
            self.emit({"type": "utterance.started", "id": utt.id})
        audio: UtteranceAudio | None = None
        lead: LeadingSilence | None = None
        position_s = 0.0
        first_audio = True
        try:
            async for chunk in utt.stream:
                if audio is None or lead is None:
                    audio = UtteranceAudio(self.encoder, chunk.sample_rate)
                    lead = LeadingSilence(chunk.sample_rate)
                    if chunk.unit_sent_at and utt.stream.first_text_at:
                        self.metrics.aggregation_wait(chunk.unit_sent_at - utt.stream.first_text_at)
                        # Engine time alone: until the chunk arrived, not until this utterance's turn came.
                        self.metrics.first_chunk((chunk.received_at or time.perf_counter()) - chunk.unit_sent_at)
                if chunk.duration > 0:
                    self.metrics.engine_chunk(chunk.synth_s, chunk.duration)
                pcm = lead.cut(chunk.pcm)
                # Words first, so a cancel while the chunk is being encoded still knows them; on the audio as
                # played, which begins lead.trimmed_s into the engine's.
                at_s = position_s - lead.trimmed_s
                words = [(word.text, max(0.0, at_s + word.start) * 1000.0, max(0.0, at_s + word.end) * 1000.0)
                         for word in chunk.words]
                play.words.extend(words)
                if words and self.on_words is not None:
                    self.on_words(play, words)
                position_s += chunk.duration
                if len(chunk.pcm) and not len(pcm):
                    continue  # all silence so far: nothing to play yet
                for i, piece in enumerate(_slices(pcm, chunk.sample_rate, first=first_audio)):
                    if play.started:
                        await self.playout.wait_below(play, ENCODE_AHEAD_MS)
                    priority = FIRST if first_audio and i == 0 else LATER
                    self.playout.push(play, await encode_pool.submit(audio.encode, piece, priority=priority))
                first_audio = first_audio and not len(pcm)
                play.chunk_ends.add(play.queued_ms // FRAME_MS)
        except (EngineCrashed, EngineStreamError, EngineUnavailable) as exc:
            code = "engine_crashed" if isinstance(exc, EngineCrashed) else "engine_error"
            self.emit({"type": "error", "code": code, "message": public_engine_error(exc), "id": utt.id})
        if audio is not None and lead is not None:
            self.playout.push(play, await encode_pool.submit(audio.encode, lead.rest(), True))
        self.playout.finish(play)


def _slices(pcm: np.ndarray, rate: int, first: bool) -> list[np.ndarray]:
    step = int(rate * SLICE_S)
    head = int(rate * FIRST_SLICE_S) if first else 0
    cuts = ([head] if 0 < head < len(pcm) else []) + list(range(head + step, len(pcm), step))
    return np.split(pcm, cuts) if len(pcm) else [pcm]
