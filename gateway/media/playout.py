"""What the outbound track plays next: encoded frames grouped by utterance.

Frames are encoded ahead of time and queued here per utterance. The track
takes one frame per tick. An utterance starts once enough audio is buffered
for the current pre-roll; inside an utterance an underrun is filled with
silence (never by stretching) and raises the pre-roll for what follows.
Between utterances the track sends silence. A cancel empties everything, so
the very next frame on the wire is silence.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .frames import FRAME_MS

# Preroll grows by three frames per underrun inside an utterance, up to this cap.
MAX_PREROLL_MS = 200


@dataclass
class UtterancePlay:
    id: str
    # When the utterance could first have been spoken: its first text, or the
    # end of the utterance before it if that came later. TTFA counts from here.
    ready_at: float | None = None
    frames: deque = field(default_factory=deque)
    words: list = field(default_factory=list)  # (text, start_ms, end_ms) in utterance time
    # Words not yet reported in an audio.words event (they wait for audio.started's clock),
    # and where the utterance's first frame lies on the session clock, once sent.
    words_unsent: list = field(default_factory=list)
    started_at_ms: int | None = None
    # Frame counts at which an engine chunk's audio ends (telephony marks them).
    chunk_ends: set = field(default_factory=set)
    queued_ms: int = 0
    sent_frames: int = 0
    input_done: bool = False
    started: bool = False
    # When the first encoded frames reached the playout (perf_counter): splits TTFA in two.
    first_queued_at: float | None = None
    first_frame_at: float | None = None
    underruns: int = 0
    # The producer waiting for the buffer to drain below `low_water_ms`.
    low_water: asyncio.Future | None = None
    low_water_ms: int = 0

    @property
    def played_ms(self) -> int:
        return self.sent_frames * FRAME_MS

    @property
    def buffered_ms(self) -> int:
        return len(self.frames) * FRAME_MS

    def played_text(self) -> str:
        """The words whose middle has gone out on the wire."""
        heard = [w for w, start, end in self.words if (start + end) / 2 <= self.played_ms]
        return _join(heard)

    def full_text(self) -> str:
        return _join([w for w, _, _ in self.words])


def _join(words: list[str]) -> str:
    # Tone-engine "words" are single characters including spaces; voice words are whitespace-split.
    if words and all(len(w) == 1 for w in words):
        return "".join(words)
    return " ".join(words)


@dataclass
class PlayoutStats:
    underruns: int = 0
    utterances: int = 0


class Playout:
    """The queue between the feeder and the output: encoded frames per utterance.

    Encoding runs ahead of time and the output takes one frame per tick, so the
    two meet here; keeping frames grouped by utterance is what lets a cancel drop
    exactly the unplayed audio and say how much of an utterance was heard.
    """

    def __init__(
        self,
        silence: bytes,
        *,
        on_audio_started: Callable[[UtterancePlay, float], None] | None = None,
        on_done: Callable[[UtterancePlay], None] | None = None,
        on_underrun: Callable[[], None] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.silence = silence
        self.queue: deque[UtterancePlay] = deque()
        self.on_audio_started = on_audio_started
        self.on_done = on_done
        self.on_underrun = on_underrun
        # Called when the next utterance has enough audio to start while the
        # output is idle, so the output can send it without waiting for a tick.
        self.on_ready = on_ready
        # Told of every frame handed out (None for silence) and when: the echo canceller's reference.
        self.tap: Callable[[bytes | None, float], None] | None = None
        self.preroll_ms = 0
        self.max_preroll_ms = MAX_PREROLL_MS
        self.stats = PlayoutStats()
        self._rebuffering = False

    # Producer side (the session's feeder)
    def add(self, utt: UtterancePlay) -> None:
        self.queue.append(utt)

    def push(self, utt: UtterancePlay, frames: list[bytes]) -> None:
        if frames and utt.first_queued_at is None:
            utt.first_queued_at = time.perf_counter()
        utt.frames.extend(frames)
        utt.queued_ms += len(frames) * FRAME_MS
        if (
            self.on_ready is not None
            and not utt.started
            and self.queue
            and self.queue[0] is utt
            and utt.buffered_ms >= max(self.preroll_ms, FRAME_MS)
        ):
            self.on_ready()

    def finish(self, utt: UtterancePlay) -> None:
        utt.input_done = True

    async def wait_below(self, utt: UtterancePlay, ms: int) -> None:
        """Wait until less than `ms` of the utterance is buffered (the track draining it)."""
        if utt.buffered_ms < ms:
            return
        utt.low_water_ms = ms
        utt.low_water = asyncio.get_running_loop().create_future()
        try:
            await utt.low_water
        finally:
            utt.low_water = None

    @property
    def current(self) -> UtterancePlay | None:
        return self.queue[0] if self.queue else None

    @property
    def buffered_ms(self) -> int:
        """Audio encoded and not yet played, over every queued utterance: an
        utterance queued now is heard this long from now at the soonest."""
        return sum(utt.buffered_ms for utt in self.queue)

    @property
    def idle(self) -> bool:
        """Nothing queued at all: the output may send less than a frame per tick."""
        return not self.queue

    # Consumer side (the track, once per 20 ms)
    def next_frame(self, now: float | None = None) -> bytes:
        frame = self._next_frame(now)
        if self.tap is not None:
            self.tap(None if frame is self.silence else frame, now if now is not None else time.perf_counter())
        return frame

    def _next_frame(self, now: float | None) -> bytes:
        while self.queue:
            utt = self.queue[0]
            if not utt.started:
                enough = utt.buffered_ms >= max(self.preroll_ms, FRAME_MS)
                if not (enough or (utt.input_done and utt.frames)):
                    if utt.input_done:
                        self._finish_current(now)  # nothing to say at all
                        continue
                    return self.silence
                utt.started = True
                self._rebuffering = False
            if utt.frames:
                if self._rebuffering and not utt.input_done and utt.buffered_ms < self.preroll_ms:
                    return self.silence
                self._rebuffering = False
                frame = utt.frames.popleft()
                utt.sent_frames += 1
                if utt.low_water is not None and utt.buffered_ms < utt.low_water_ms and not utt.low_water.done():
                    utt.low_water.set_result(None)
                if utt.first_frame_at is None:
                    utt.first_frame_at = now if now is not None else time.perf_counter()
                    if self.on_audio_started is not None:
                        self.on_audio_started(utt, utt.first_frame_at)
                return frame
            if utt.input_done:
                self._finish_current(now)
                continue
            # Underrun inside an utterance: silence now, more pre-roll from here on.
            if not self._rebuffering:
                utt.underruns += 1
                self.stats.underruns += 1
                self.preroll_ms = min(self.max_preroll_ms, self.preroll_ms + 3 * FRAME_MS)
                self._rebuffering = True
                if self.on_underrun is not None:
                    self.on_underrun()
            return self.silence
        return self.silence

    def _finish_current(self, now: float | None) -> None:
        utt = self.queue.popleft()
        self.stats.utterances += 1
        if utt.underruns == 0 and self.preroll_ms > 0:
            # The engine kept ahead this time: lean back towards starting at once.
            self.preroll_ms = max(0, self.preroll_ms - FRAME_MS)
        if self.queue and self.queue[0].ready_at is not None:
            t = now if now is not None else time.perf_counter()
            self.queue[0].ready_at = max(self.queue[0].ready_at, t)
        if self.on_done is not None:
            self.on_done(utt)

    def drop(self, utt: UtterancePlay) -> None:
        """Take one utterance out that has not started (its sender went away); the rest play on."""
        assert not utt.started, "a started utterance ends; it is not dropped"
        if utt in self.queue:
            self.queue.remove(utt)

    def clear(self) -> list[UtterancePlay]:
        """Drop everything; returns the dropped utterances, the playing one first."""
        dropped = list(self.queue)
        self.queue.clear()
        self._rebuffering = False
        return dropped
