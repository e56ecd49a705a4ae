"""DTMF digits as in-band tones: the two frequencies of each key (ITU-T Q.23), as 8 kHz μ-law
20 ms frames for a phone call's output (gateway/phone/twilio_output.py). Twilio Media Streams carry no
outbound DTMF event, but the call carries audio, and telephone equipment detects these tones in it.
"""

from __future__ import annotations

import numpy as np

from ..media.encoder import ulaw_encode

RATE = 8000
FRAME = 160  # 20 ms at 8 kHz
ROWS = (697.0, 770.0, 852.0, 941.0)
COLUMNS = (1209.0, 1336.0, 1477.0, 1633.0)
KEYS = ("123A", "456B", "789C", "*0#D")
TONE_MS = 100  # Q.24 asks for at least 40 ms of tone and 40 ms of pause; carriers use about 100 each
PAUSE_MS = 100
WAIT_MS = 500  # 'w' in a digit string: a half-second pause, as the vendors' sendDigits takes it
AMPLITUDE = 0.25  # each of the two tones, of full scale: about -12 dBFS apiece, under clipping together


def frequencies(digit: str) -> tuple[float, float]:
    for row, keys in zip(ROWS, KEYS):
        column = keys.find(digit.upper())
        if column >= 0:
            return row, COLUMNS[column]
    raise ValueError(f"{digit!r} is not a DTMF key")


def _silence(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, np.float64)


def tones(digits: str) -> list[bytes]:
    """`digits` (0-9, *, #, A-D, w) as 20 ms μ-law frames: each key's tone, then a pause."""
    parts = []
    t = np.arange(RATE * TONE_MS // 1000) / RATE
    for digit in digits:
        if digit.lower() == "w":
            parts.append(_silence(WAIT_MS))
            continue
        low, high = frequencies(digit)
        parts.append(AMPLITUDE * (np.sin(2 * np.pi * low * t) + np.sin(2 * np.pi * high * t)))
        parts.append(_silence(PAUSE_MS))
    pcm = np.concatenate(parts) if parts else np.zeros(0)
    pcm = np.concatenate([pcm, np.zeros(-len(pcm) % FRAME)])
    data = ulaw_encode((pcm * 32767).astype(np.int16))
    return [data[i:i + FRAME] for i in range(0, len(data), FRAME)]
