"""Speech out to a phone call: μ-law frames paced in real time, marks, clear.

Twilio plays whatever it is sent, in order, and only `clear` takes back what
is buffered there. So frames leave on the same monotonic 20 ms schedule as
the WebRTC track and never more than one frame ahead: a barge-in then has
nothing stale queued at the phone side but the frame in flight. Silence
between utterances is not sent at all (the phone side plays nothing, which is
silence); the schedule keeps ticking so timing stays honest.

Marks tell which audio was actually played: one at each engine chunk
boundary, one every `MARK_EVERY_FRAMES` frames in between, and one at the end of
each utterance, named `<utterance id>:<ms sent>` (the end
mark with a `:end` suffix). The phone side echoes a mark when the audio
before it has played; after a `clear` it echoes the pending ones at once,
and those count as cleared, not played.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections import deque
from typing import Awaitable, Callable

from . import dtmf
from ..media.pacer import Pacer
from ..sessions.session_output import SpeechOutput

MARK_EVERY_FRAMES = 10  # a mark every 200 ms between chunk boundaries (see above)
MAX_TONE_FRAMES = 500  # DTMF tones waiting to be sent (10 s); more digits are refused

log = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]


class TwilioOutput:
    def __init__(self, output: SpeechOutput, *, stream_sid: str, send: Send, pacer: Pacer | None = None) -> None:
        self.output = output  # the session's speech output: its playout, and each frame's departure
        self.stream_sid = stream_sid
        self._send_raw = send
        self.mark_every = MARK_EVERY_FRAMES
        self.pacer = pacer or Pacer()
        self.frames_sent = 0
        self.marks_sent = 0
        self.marks_played = 0
        self.marks_cleared = 0
        self.clears = 0
        self.played: dict | None = None  # the last mark echoed as played: {"id", "ms", "end"}
        self._outstanding: deque[str] = deque()
        self._cleared: set[str] = set()
        self._pending_marks: list[str] = []
        self._clear_task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._tones: deque[bytes] = deque()  # in-band DTMF frames, sent where speech leaves silence

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        for task in (self._task, self._clear_task):
            if task is not None and not task.done():
                task.cancel()

    # Session events (called synchronously from inside the session)
    def on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "utterance.done":
            self._pending_marks.append(f"{event['id']}:{event['audio_ms']}:end")
        elif kind == "utterance.interrupted" and self._clear_task is None and event.get("reason") != "writer_gone":
            # One interrupt reports every dropped utterance; one clear covers them all. An utterance
            # dropped with its writer was never sent: what plays at the phone plays on.
            self._clear_task = asyncio.ensure_future(self._clear())

    def send_digits(self, digits: str) -> bool:
        """Queue `digits` as in-band DTMF tones (gateway/phone/dtmf.py), sent from the next frame on, speech
        pausing for them; False (nothing queued) if that would hold more than MAX_TONE_FRAMES."""
        frames = dtmf.tones(digits)
        if len(self._tones) + len(frames) > MAX_TONE_FRAMES:
            return False
        self._tones.extend(frames)
        return True

    # Phone side
    def on_mark(self, name: str) -> None:
        if name in self._cleared:
            self._cleared.discard(name)
            self.marks_cleared += 1
            return
        # Echoes come in order; anything before this one has played too.
        while self._outstanding:
            if self._outstanding.popleft() == name:
                break
        self.marks_played += 1
        uid, _, rest = name.partition(":")
        ms, _, end = rest.partition(":")
        try:
            self.played = {"id": uid, "ms": int(ms), "end": end == "end"}
        except ValueError:
            log.warning("stream %s: mark %r is not one of ours", self.stream_sid, name)

    def describe(self) -> dict:
        return {
            "frames_sent": self.frames_sent,
            "marks_sent": self.marks_sent,
            "marks_played": self.marks_played,
            "marks_cleared": self.marks_cleared,
            "clears": self.clears,
            "played": self.played,
        }

    # Wire
    async def _send(self, message: dict) -> None:
        async with self._lock:  # keeps media, marks and clears in the order they were decided
            await self._send_raw(message)

    async def _mark(self, name: str) -> None:
        self._outstanding.append(name)
        self.marks_sent += 1
        await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def _clear(self) -> None:
        try:
            self._cleared.update(self._outstanding)
            self._outstanding.clear()
            self._pending_marks.clear()
            self.clears += 1
            await self._send({"event": "clear", "streamSid": self.stream_sid})
        finally:
            self._clear_task = None

    async def _run(self) -> None:
        playout = self.output.playout
        try:
            while True:
                await self.pacer.wait()
                now = time.perf_counter()
                if self._tones:
                    # DTMF tones go out as they came, ahead of speech, which waits for them (it is not dropped).
                    await self._send({"event": "media", "streamSid": self.stream_sid,
                                      "media": {"payload": base64.b64encode(self._tones.popleft()).decode("ascii")}})
                    self.frames_sent += 1
                    self.output.on_departure(now)
                    continue
                frame = playout.next_frame(now)
                # Ends of utterances finished by this tick go out before its frame.
                while self._pending_marks:
                    await self._mark(self._pending_marks.pop(0))
                if frame is not playout.silence:
                    current = playout.current
                    await self._send(
                        {"event": "media", "streamSid": self.stream_sid, "media": {"payload": base64.b64encode(frame).decode("ascii")}}
                    )
                    self.frames_sent += 1
                    if current is not None and (
                        current.sent_frames % self.mark_every == 0 or current.sent_frames in current.chunk_ends
                    ):
                        await self._mark(f"{current.id}:{current.played_ms}")
                self.output.on_departure(now)
        except asyncio.CancelledError:
            pass
        except (ConnectionError, RuntimeError) as exc:
            log.info("stream %s: output ended: %s", self.stream_sid, exc)
