"""The caller's audio as 20 ms frames on the session's clock, for the VAD, the recognizer and backends.

The microphone (`mic.py`) and a phone call (`signaling/twilio_stream.py`)
hand over decoded 16 kHz mono chunks with the capture time of their first
sample, and the frames they did not decode: ones the caller never sent (DTX,
loss) or sent quieter than the level gate. `CallerAudio` cuts the chunks into
20 ms frames, each with its capture time, and hands every frame to the
session (`on_frame`: PCM, or None for a frame that was not decoded) and, as
binary messages, to every backend that asked for the audio (`taps`).

A tap's message is one frame: `FRAME_HEADER` (the frame's sequence number,
unsigned 32-bit, and its capture time in ms on the session's clock, signed
32-bit: audio captured before the session was made is negative; both
little-endian) then 320 samples of PCM16 little-endian. Sequence numbers are
the session's, one per frame of the caller's time, silence included, so a
frame a slow backend lost shows as a gap; a frame not decoded goes out as
digital silence.
"""

from __future__ import annotations

import math
import struct
from typing import Callable

import numpy as np

from ..media.frames import FRAME_MS, frame_samples

RATE = 16000
FRAME_SAMPLES = frame_samples(RATE)
FRAME_HEADER = struct.Struct("<Ii")  # sequence number, capture time (session ms)
# A chunk placed further than this from where the last one ended does not continue it: the
# frames jump to where the chunk was placed. Nearer, the frames stay contiguous and move
# towards the placement by at most SLEW_MS a frame, so capture times keep 20 ms (+-5 %) apart.
CONTIGUOUS_MS = 100.0
SLEW_MS = 1.0
_SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.int16)

FrameListener = Callable[[np.ndarray | None, float, float | None], None]


def pack_frame(seq: int, capture_ms: float, pcm: np.ndarray) -> bytes:
    """One tap message: the header, then the frame's PCM16 little-endian."""
    return FRAME_HEADER.pack(seq & 0xFFFFFFFF, math.floor(capture_ms)) + pcm.astype("<i2", copy=False).tobytes()


def unpack_frame(message: bytes) -> tuple[int, int, np.ndarray]:
    """(sequence number, capture ms, PCM) from a tap message, as a backend reads it."""
    seq, capture_ms = FRAME_HEADER.unpack_from(message)
    return seq, capture_ms, np.frombuffer(message, dtype="<i2", offset=FRAME_HEADER.size)


class CallerAudio:
    """Cuts one session's inbound audio into frames on the session's clock and fans them out."""

    def __init__(self, on_frame: FrameListener) -> None:
        self.on_frame = on_frame
        # Backends that asked for the audio: name -> callable taking one tap message.
        self.taps: dict[str, Callable[[bytes], None]] = {}
        self.seq = 0  # the next frame's sequence number
        self.frames = 0  # frames handed on, decoded or not
        self._rest = np.zeros(0, dtype=np.int16)  # samples short of a whole frame
        self._next_ms: float | None = None  # where the last frame ended

    def audio(self, pcm: np.ndarray, start_ms: float) -> None:
        """Decoded 16 kHz mono samples whose first was captured at `start_ms` (session ms): where
        the capture clock placed them, which gets better as faster packets arrive (clock.py)."""
        pcm = np.asarray(pcm, dtype=np.int16).reshape(-1)
        if self._next_ms is not None:
            follows = self._next_ms + len(self._rest) * 1000.0 / RATE  # where this chunk would continue
            lead = start_ms - follows
            if abs(lead) <= CONTIGUOUS_MS:
                slew = SLEW_MS * max(1, len(pcm) // FRAME_SAMPLES)
                start_ms = follows + min(slew, max(-slew, lead))
                if len(self._rest):
                    pcm = np.concatenate([self._rest, pcm])
                    start_ms -= len(self._rest) * 1000.0 / RATE
        self._rest = self._rest[:0]
        whole = len(pcm) // FRAME_SAMPLES * FRAME_SAMPLES
        for i in range(0, whole, FRAME_SAMPLES):
            self._frame(pcm[i : i + FRAME_SAMPLES], start_ms + i * 1000.0 / RATE, None)
        if whole < len(pcm):
            self._rest = pcm[whole:].copy()
            self._next_ms = start_ms + whole * 1000.0 / RATE

    def gap(self, frames: int, level_db: float | None = None) -> None:
        """`frames` frames that were not decoded, right after the last one: never sent, or quiet
        by their own level (`level_db`, for the VAD's noise floor)."""
        self._rest = self._rest[:0]
        start = self._next_ms if self._next_ms is not None else 0.0
        for i in range(frames):
            self._frame(None, start + i * FRAME_MS, level_db)

    def _frame(self, pcm: np.ndarray | None, capture_ms: float, level_db: float | None) -> None:
        self._next_ms = capture_ms + FRAME_MS
        self.frames += 1
        if self.taps:
            message = pack_frame(self.seq, capture_ms, _SILENCE if pcm is None else pcm)
            for tap in list(self.taps.values()):
                tap(message)
        self.seq += 1
        self.on_frame(pcm, capture_ms, level_db)
