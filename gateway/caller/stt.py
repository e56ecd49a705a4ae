"""What the caller said, as text: a speech recognizer run on each of the VAD's turns.

One home for speech recognition. A recognizer is small (`Recognizer`): it
turns one turn's audio (16 kHz mono int16) into text, either in a thread
(`threaded`, e.g. Whisper on CTranslate2: gateway/caller/stt_whisper.py, or pocketsphinx:
gateway/caller/stt_pocketsphinx.py, whose thread waits on a worker process, since its decoder holds the GIL) or as a coroutine (an OpenAI-compatible endpoint: gateway/caller/stt_openai.py).
`load_recognizer` picks the one the settings name (--stt, --stt-url).

`SpeechToText` is the process's one service around it: at most
--stt-max-concurrent recognitions at once (threads included: a thread that
outlives its timeout keeps its slot until it ends), a bounded number waiting,
and every turn's whole time, waiting included, bounded by --stt-timeout-s.
Nothing of it ever runs on the event loop. The slots are shared out by
session (`Slots`): a session holds at most one, from when its turn gets it
until that decode really ends (a turn that timed out included), and its next
turn waits behind every other session's. A decode cannot be taken back once
started, so one caller whose turns are long or slow to decode (loud noise:
issue 53) holds one slot at most, and the others share the rest.

`TurnTranscriber` is a session's: it keeps the caller's recent 20 ms frames
(caller_audio.py) and cuts one turn from `speech.started` to
`speech.stopped` (with the speech that came before the VAD decided), or a
piece every --stt-max-turn-s of a longer one, and sends one
`speech.transcript` {text, final, start_ms, end_ms} per piece, in order, or
one `error` (stt_timeout, stt_failed, stt_busy) and nothing else. A piece is
bounded by its count of frames, not by their capture times: those follow the
packets' arrival (clock.py), so a caller sending faster than real time would
otherwise fit minutes of audio into one "turn" of --stt-max-turn-s (issue 53),
and the frames kept are bounded by count too. Sessions of
a server with `--stt none` have none: no frame is kept, nothing is decoded
for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import numpy as np

from ...config import ConfigError, Settings
from ..errors import SttError
from ..media.frames import FRAME_MS

log = logging.getLogger(__name__)

RATE = 16000
# Audio kept ahead of a turn: the VAD decides `speech.started` once min_speech_ms of voiced
# frames fell within a window of twice that, so the turn began up to that long before; plus a margin.
MARGIN_MS = 300
MAX_PENDING_PER_SESSION = 4  # turns of one session recognized or waiting to be reported
WAITING_PER_SLOT = 16  # turns waiting for a recognizer, process-wide, per concurrent slot


class Recognizer(Protocol):
    """Turns one turn's audio into text. `threaded`: `recognize(pcm) -> str` runs in a thread of
    the service's; otherwise `recognize_async(pcm) -> str` is awaited on the loop (it must not block)."""

    name: str
    threaded: bool

    def recognize(self, pcm: np.ndarray) -> str: ...

    async def recognize_async(self, pcm: np.ndarray) -> str: ...

    async def close(self) -> None: ...


def load_recognizer(settings: Settings) -> Recognizer | None:
    """The recognizer the settings name, loaded; None for --stt none. Raises ConfigError."""
    if settings.stt_url:
        from .stt_openai import OpenAITranscriptions

        return OpenAITranscriptions(settings.stt_url, model=settings.stt_model, api_key=settings.stt_api_key)
    if settings.stt == "pocketsphinx":
        from .stt_pocketsphinx import Pocketsphinx

        # One process per slot, up to one per core: more would only share the cores (and cost ~60 MB each).
        return Pocketsphinx(workers=min(settings.stt_max_concurrent, os.cpu_count() or 1))
    if settings.stt == "whisper":
        from .stt_whisper import Whisper

        # One model replica per slot, one thread each (measured on 2 cores: gateway/caller/stt_whisper.py).
        return Whisper(workers=min(settings.stt_max_concurrent, os.cpu_count() or 1))
    if settings.stt != "none":
        raise ConfigError(f"--stt {settings.stt!r}: no such recognizer")
    return None


class Slots:
    """--stt-max-concurrent recognizer slots, shared out by owner (a session's TurnTranscriber).

    An owner holds at most one slot; a free slot goes to the turn that has waited longest among
    those whose owner holds none. `acquire` may be cancelled while waiting (a timeout)."""

    def __init__(self, count: int) -> None:
        self.free = count
        self.held: dict[object, int] = {}
        self._waiting: deque[tuple[object, asyncio.Future]] = deque()

    async def acquire(self, owner: object) -> None:
        if self.free > 0 and not self.held.get(owner):
            self._take(owner)
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (owner, granted)
        self._waiting.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(owner)  # given a slot just as the wait ended: handed on
            else:
                self._waiting.remove(entry)
            raise

    def release(self, owner: object) -> None:
        left = self.held[owner] - 1
        if left:
            self.held[owner] = left
        else:
            del self.held[owner]
        self.free += 1
        self._hand_on()

    def _take(self, owner: object) -> None:
        self.free -= 1
        self.held[owner] = self.held.get(owner, 0) + 1

    def _hand_on(self) -> None:
        for entry in list(self._waiting):
            if self.free <= 0:
                return
            owner, granted = entry
            if not self.held.get(owner) and not granted.done():
                self._waiting.remove(entry)
                self._take(owner)
                granted.set_result(None)


class SpeechToText:
    """The process's recognizer, bounded: concurrency (shared out by session), waiting turns, and time."""

    def __init__(self, recognizer: Recognizer, *, max_concurrent: int = Settings.stt_max_concurrent,
                 timeout_s: float = Settings.stt_timeout_s, max_turn_s: float = Settings.stt_max_turn_s) -> None:
        self.recognizer = recognizer
        self.name = recognizer.name
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self.max_turn_s = max_turn_s
        self.max_waiting = WAITING_PER_SLOT * max_concurrent
        self.waiting = 0
        self.running = 0
        self.turns = 0
        self.errors: dict[str, int] = {}
        # Called with each turn's outcome: transcript, stt_busy, stt_timeout, stt_failed (the gateway's /metrics).
        self.on_outcome: Callable[[str], None] | None = None
        self._slots = Slots(max_concurrent)
        self._pool = (ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="stt")
                      if recognizer.threaded else None)

    @classmethod
    def from_settings(cls, settings: Settings) -> "SpeechToText | None":
        recognizer = load_recognizer(settings)
        if recognizer is None:
            return None
        return cls(recognizer, max_concurrent=settings.stt_max_concurrent, timeout_s=settings.stt_timeout_s,
                   max_turn_s=settings.stt_max_turn_s)

    async def recognize(self, pcm: np.ndarray, owner: object = None) -> str:
        """The text of one turn of `owner`'s (a session's; None: a caller of its own); raises SttError
        (stt_busy, stt_timeout, stt_failed)."""
        owner = object() if owner is None else owner
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        if self.waiting >= self.max_waiting:
            raise SttError("stt_busy", f"{self.waiting} turns are waiting for the recognizer; this one was not recognized")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(owner), self.timeout_s)
        except asyncio.TimeoutError:
            raise SttError("stt_timeout", f"no recognizer was free within {self.timeout_s:g} s") from None
        finally:
            self.waiting -= 1
        self.running += 1
        self.turns += 1
        if self._pool is not None:
            work = loop.run_in_executor(self._pool, self.recognizer.recognize, pcm)
            # When the thread ends, not when the wait does: the slot is the owner's until then.
            work.add_done_callback(lambda done: self._release(done, owner))
            waited = asyncio.shield(work)
        else:
            work = asyncio.ensure_future(self.recognizer.recognize_async(pcm))
            work.add_done_callback(lambda done: self._release(done, owner))
            waited = work  # cancelled on timeout: the request ends with it
        try:
            text = await asyncio.wait_for(waited, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise SttError("stt_timeout", f"the recognizer ({self.name}) took longer than {self.timeout_s:g} s") from None
        except SttError:
            raise
        except Exception as exc:
            log.warning("recognizer %s failed: %s", self.name, exc)
            raise SttError("stt_failed", f"the recognizer ({self.name}) failed: {type(exc).__name__}") from None
        if not isinstance(text, str):
            raise SttError("stt_failed", f"the recognizer ({self.name}) gave no text")
        return " ".join(text.split())

    def _release(self, work: asyncio.Future, owner: object) -> None:
        self.running -= 1
        self._slots.release(owner)
        if not work.cancelled():
            work.exception()  # retrieved: a thread that failed after its timeout is not logged as unhandled

    def count(self, outcome: str) -> None:
        """One turn's outcome: `transcript`, or the error code it got."""
        if outcome != "transcript":
            self.errors[outcome] = self.errors.get(outcome, 0) + 1
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    async def close(self) -> None:
        await self.recognizer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class TurnTranscriber:
    """One session's turns, cut from its caller frames and recognized by `stt`; events go to `emit`."""

    def __init__(self, stt: SpeechToText, emit: Callable[[dict], None], *, lookback_ms: Callable[[], int]) -> None:
        self.stt = stt
        self.emit = emit
        self.enabled = True
        self.lookback_ms = lookback_ms  # how long before speech.started a turn may have begun
        self.max_turn_ms = int(stt.max_turn_s * 1000)
        self.max_turn_frames = max(1, self.max_turn_ms // FRAME_MS)
        self._frames: deque = deque()  # (capture_ms, pcm or None), in order of arrival
        self._turn_frames = 0  # frames in the current turn's next piece, so far
        self._turn_from: float | None = None  # where the current turn's next piece begins, when in one
        self._last_end = float("-inf")  # where the last piece ended: pieces never overlap
        self._pending: deque[asyncio.Task] = deque()
        self.dropped = 0

    def frame(self, pcm: np.ndarray | None, capture_ms: float) -> None:
        """One 20 ms frame of the caller's audio (None: not decoded, silence)."""
        if not self.enabled:
            return
        self._frames.append((capture_ms, pcm))
        if self._turn_from is None:
            ahead_ms = self.lookback_ms() + MARGIN_MS
            keep_from = capture_ms - ahead_ms
            while self._frames and self._frames[0][0] < keep_from:
                self._frames.popleft()
            while len(self._frames) > ahead_ms // FRAME_MS + 1:  # whatever their capture times say
                self._frames.popleft()
            return
        self._turn_frames += 1
        if self._turn_frames >= self.max_turn_frames or capture_ms + FRAME_MS - self._turn_from >= self.max_turn_ms:
            # A turn as long as --stt-max-turn-s: this piece is recognized now, the rest goes on.
            end = capture_ms + FRAME_MS
            self._piece(self._turn_from, end, whole=True)
            self._turn_from = end

    def started(self, at_ms: float) -> None:
        if not self.enabled:
            return
        self._turn_from = max(at_ms - self.lookback_ms() - MARGIN_MS, self._last_end)
        self._turn_frames = sum(1 for capture_ms, _ in self._frames if capture_ms + FRAME_MS > self._turn_from)

    def stopped(self, at_ms: float, text: str | None = None) -> None:
        """The turn ends at `at_ms`; `text`: what its audio was already recognized as (gateway/caller/endpoint.py)."""
        if self._turn_from is None:
            return
        start, self._turn_from = self._turn_from, None
        if self.enabled and at_ms > start:
            self._piece(start, at_ms, text)

    def turn_audio(self, end_ms: float) -> tuple[np.ndarray, int, int] | None:
        """The current turn's audio up to `end_ms`, left in place (PCM, start_ms, end_ms); None outside a turn."""
        if self._turn_from is None or not self.enabled:
            return None
        start = self._turn_from
        frames = [(t, pcm) for t, pcm in self._frames if t + FRAME_MS > start and t < end_ms]
        if not frames:
            return None
        pcm = np.concatenate([np.zeros(RATE * FRAME_MS // 1000, np.int16) if p is None else p for _, p in frames])
        return pcm, int(frames[0][0]), int(frames[-1][0] + FRAME_MS)

    def _piece(self, start: float, end: float, text: str | None = None, whole: bool = False) -> None:
        """Recognize the frames kept from `start` to `end` (capture ms), at most --stt-max-turn-s of
        them; `text`: what the audio was already recognized as;
        `whole`: every frame kept goes, the earliest only from `start` (a piece cut by its count)."""
        chunks: list[np.ndarray] = []
        first = last = None
        self._turn_frames = 0
        while self._frames and (whole or self._frames[0][0] < end) and len(chunks) < self.max_turn_frames:
            capture_ms, pcm = self._frames.popleft()
            if capture_ms + FRAME_MS <= start and not chunks:
                continue
            first = capture_ms if first is None else first
            last = capture_ms + FRAME_MS
            chunks.append(np.zeros(RATE * FRAME_MS // 1000, np.int16) if pcm is None else pcm)
        self._last_end = end
        if first is None or last is None:
            return
        start_ms, end_ms = int(first), int(last)
        self._pending = deque(t for t in self._pending if not t.done())
        if len(self._pending) >= MAX_PENDING_PER_SESSION:
            self.dropped += 1
            self._error(SttError("stt_busy", f"{len(self._pending)} turns of this session are still being recognized"),
                        start_ms, end_ms)
            return
        before = self._pending[-1] if self._pending else None
        self._pending.append(asyncio.ensure_future(self._recognize(np.concatenate(chunks), start_ms, end_ms, before,
                                                                   text)))

    async def _recognize(self, pcm: np.ndarray, start_ms: int, end_ms: int, before: asyncio.Task | None,
                         known: str | None = None) -> None:
        try:
            text = known if known is not None else await self.stt.recognize(pcm, self)
            event = {"type": "speech.transcript", "text": text, "final": True, "start_ms": start_ms, "end_ms": end_ms}
        except SttError as exc:
            event = None
            error = exc
        if before is not None:
            await asyncio.wait({before})  # transcripts go out in the order the caller spoke
        if event is None:
            self._error(error, start_ms, end_ms)
        else:
            self.stt.count("transcript")
            self.emit(event)

    def _error(self, exc: SttError, start_ms: int, end_ms: int) -> None:
        self.stt.count(exc.code)
        self.emit({"type": "error", "code": exc.code, "message": exc.message, "start_ms": start_ms, "end_ms": end_ms})

    def close(self) -> None:
        self.enabled = False
        self._frames.clear()
        self._turn_from = None
        for task in self._pending:
            task.cancel()
        self._pending.clear()
