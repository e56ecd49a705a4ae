"""Voice activity on the inbound microphone, for barge-in.

webrtcvad classifies 20 ms frames at 16 kHz. On its own it fires on steady
noise (fans, hiss), so a frame also has to stand clearly above an adaptive
noise floor to count as speech. Speech starts after `min_speech_ms` of voiced
frames within a short window, and stops after `hangover_ms` without any.

A turn's voiced frames are counted from its start; once they reach
`interrupt_ms` the detector says `speech.long` (the session's own event, never
sent): the turn has been long enough to interrupt the bot (gateway/caller/caller_side.py).

With `pause_ms` set (the session's shortest end-of-turn silence,
gateway/caller/endpoint.py), a turn that falls silent that long says `speech.paused`,
and its next voiced frame says `speech.resumed` (before or after
`speech.stopped`): the session's own events too, for deciding when the
caller's turn is over.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import webrtcvad

from ...config import Settings
from ...config_fields import bounds

VAD_RATE = 16000
FRAME_SAMPLES = VAD_RATE // 50
FLOOR_MIN_DB = 20.0  # the lowest the noise floor goes: digital silence must not drag it to nothing


@dataclass
class VadSettings:
    """Barge-in by voice; the defaults are the --vad* flags' (voxgate/config.py), and a client's
    `vad` object is held to the same ranges."""

    enabled: bool = Settings.vad
    aggressiveness: int = Settings.vad_aggressiveness  # webrtcvad mode
    min_speech_ms: int = Settings.vad_min_speech_ms
    hangover_ms: int = 500
    # Decibels above the tracked noise floor a frame needs to count as speech.
    floor_margin_db: float = 9.0

    def update(self, data: dict) -> None:
        """Apply a client's `vad` object; raises ValueError with a message for the client."""
        if "enabled" in data:
            if not isinstance(data["enabled"], bool):
                raise ValueError("vad 'enabled' must be true or false")
            self.enabled = data["enabled"]
        if "aggressiveness" in data:
            self.aggressiveness = _int_in(data["aggressiveness"], "aggressiveness", *bounds(Settings, "vad_aggressiveness"))
        if "min_speech_ms" in data:
            self.min_speech_ms = _int_in(data["min_speech_ms"], "min_speech_ms", *bounds(Settings, "vad_min_speech_ms"))
        if "hangover_ms" in data:
            self.hangover_ms = _int_in(data["hangover_ms"], "hangover_ms", 100, 10000)


def _int_in(value: object, name: str, low: float, high: float) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not low <= value <= high:
        raise ValueError(f"vad '{name}' must be a number from {low} to {high}")
    return int(value)


class VoiceActivityDetector:
    def __init__(self, settings: VadSettings | None = None) -> None:
        self.settings = settings or VadSettings()
        self._vad = webrtcvad.Vad(self.settings.aggressiveness)
        self._mode = self.settings.aggressiveness
        self._pending = np.zeros(0, dtype=np.int16)
        self._floor_db: float | None = None  # tracked noise floor
        self._recent: deque = deque()
        self._voiced = 0  # how many of _recent are True
        self._silent_ms = 0
        self.speaking = False
        self.voiced = False  # how the last frame was judged
        self.interrupt_ms = 0  # speech a turn needs to say speech.long (0: never says it)
        self.turn_voiced_ms = 0  # voiced speech in the current (or last) turn
        self._long = False
        self.pause_ms = 0  # silence in a turn that says speech.paused (0: never says it)
        self._paused = False

    def process(self, pcm16k: np.ndarray) -> list[str]:
        """Feed 16 kHz mono int16; returns 'speech.started' / 'speech.stopped' events."""
        if self._mode != self.settings.aggressiveness:
            self._vad.set_mode(self.settings.aggressiveness)
            self._mode = self.settings.aggressiveness
        pcm16k = np.asarray(pcm16k, dtype=np.int16)
        buf = np.concatenate([self._pending, pcm16k]) if len(self._pending) else pcm16k
        events: list[str] = []
        n = len(buf) // FRAME_SAMPLES
        for i in range(n):
            frame = buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES]
            events.extend(self._frame(frame))
        self._pending = buf[n * FRAME_SAMPLES :]
        return events

    def _frame(self, frame: np.ndarray, guard_db: float | None = None) -> tuple[str, ...]:
        s = self.settings
        # A dot product, not np.mean of squares: numpy's mean costs more in Python than the sum.
        samples = frame.astype(np.float64)
        rms = math.sqrt(float(np.dot(samples, samples)) / len(samples)) + 1e-9
        level_db = 20 * math.log10(rms)
        if self._floor_db is None:
            self._floor_db = level_db
        floor_db = self._floor_db
        # The energy gate first: webrtcvad runs only on frames loud enough to count, over the
        # room's noise and over what the bot's own echo could be (gateway/caller/echo.py).
        voiced = (
            level_db > floor_db + s.floor_margin_db
            and (guard_db is None or level_db > guard_db)
            and self._vad.is_speech(frame.tobytes(), VAD_RATE)
        )
        self.voiced = voiced
        if not voiced:
            self._follow_floor(level_db)
        return self._decide(voiced)

    def frame(self, frame: np.ndarray, guard_db: float | None) -> tuple[str, ...]:
        """One whole frame (FRAME_SAMPLES), voiced only if louder than `guard_db` too (None: no
        guard); its events. `voiced` then says how the frame was judged."""
        if self._mode != self.settings.aggressiveness:
            self._vad.set_mode(self.settings.aggressiveness)
            self._mode = self.settings.aggressiveness
        return self._frame(frame, guard_db)

    def _follow_floor(self, level_db: float) -> None:
        """The floor follows quiet frames quickly and loud ones slowly, so it settles on
        steady noise but not on speech."""
        floor_db = level_db if self._floor_db is None else self._floor_db
        rate = 0.2 if level_db < floor_db else 0.01
        floor_db += rate * (level_db - floor_db)
        self._floor_db = max(floor_db, FLOOR_MIN_DB)

    @property
    def floor_db(self) -> float:
        """The room's noise floor as this detector tracks it (FLOOR_MIN_DB before the first frame)."""
        return FLOOR_MIN_DB if self._floor_db is None else self._floor_db

    @property
    def quiet(self) -> bool:
        """No turn, and not one voiced frame within the window that starts one."""
        return not self.speaking and self._voiced == 0

    def skip(self, frames: int, level_db: float | None = None) -> list[str]:
        """Frames that were not decoded count as silence: ones that never arrived (the
        peer's DTX, or loss), or ones the microphone's level gate passed over, whose level
        (`level_db`, on this detector's scale) the noise floor still follows, so that the
        first speech after them stands out against the room and not against itself."""
        events: list[str] = []
        for _ in range(frames):
            if level_db is not None:
                self._follow_floor(level_db)
            events.extend(self._decide(False))
        return events

    def _decide(self, voiced: bool) -> tuple[str, ...]:
        s = self.settings
        window = max(1, s.min_speech_ms // 20) * 2
        self._recent.append(voiced)
        self._voiced += voiced
        while len(self._recent) > window:
            self._voiced -= self._recent.popleft()
        if not self.speaking:
            # A voiced frame after a pause that outlasted the hangover: the caller may be going on.
            stirred: tuple[str, ...] = ("speech.resumed",) if voiced and self._paused else ()
            if stirred:
                self._paused = False
            if self._voiced * 20 >= s.min_speech_ms:
                self.speaking = True
                self._silent_ms = 0
                self.turn_voiced_ms = self._voiced * 20
                self._long = not self.interrupt_ms or self.turn_voiced_ms >= self.interrupt_ms
                return stirred + (("speech.started", "speech.long") if self._long and self.interrupt_ms
                                  else ("speech.started",))
            return stirred
        else:
            self._silent_ms = 0 if voiced else self._silent_ms + 20
            if voiced and self._paused:
                self._paused = False
                resumed: tuple[str, ...] = ("speech.resumed",)
            else:
                resumed = ()
            if self.pause_ms and not voiced and not self._paused and self._silent_ms >= self.pause_ms \
                    and self._silent_ms < s.hangover_ms:
                self._paused = True
                return ("speech.paused",)
            if voiced:
                self.turn_voiced_ms += 20
                if not self._long and self.turn_voiced_ms >= self.interrupt_ms:
                    self._long = True
                    return resumed + ("speech.long",)
            if self._silent_ms >= s.hangover_ms:
                self.speaking = False  # a pause said stays said: its end is speech.resumed, even now
                self._recent.clear()
                self._voiced = 0
                return ("speech.stopped",)
            return resumed
        return ()
