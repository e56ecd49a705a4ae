"""A corpus for barge-in: callers who are not the bot, the room they are in, and the bot's own echo.

Callers are espeak-ng (a Debian package) in several voices and variants, never
the bot's Piper voice, so the echo of the bot and the caller are different
speakers. Room noise and music are synthesized here from seeds. The echo is
not in this file: it is made live, by a client whose microphone picks up what
its speaker plays (`EchoMicTrack`), so it is the bot's real output as the
client decoded it, delayed and attenuated.

Levels: a caller phrase is scaled so that its active speech (frames within
30 dB of its loudest) has the RMS of `SPEECH_RMS`, about the active level of
the joe voice as the gateway sends it; an echo at -10 dB is then 10 dB under
the caller.
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import io
import math
import subprocess
import time
import wave

import numpy as np
import soxr

RATE = 48000
SPEECH_RMS = 3000.0  # active-speech RMS of a caller phrase (about joe's, as sent)

# espeak-ng voices and variants: men, women, several accents; none is the bot's.
CALLER_VOICES = (
    "en-us", "en-gb+f3", "en-gb-scotland+m3", "en-029+f2", "en-us-nyc+m5", "en-gb-x-rp+f4",
    "en-gb-x-gbclan+m2", "en-us+f5",
)
INTERRUPTIONS = (
    "Wait, hold on, I have a question.",
    "Sorry, can I stop you there for a second?",
    "No no, that is not what I asked about.",
    "Hang on, go back to the part about the price.",
    "Excuse me, I need to ask you something.",
    "Stop, stop, that is wrong.",
    "Actually, I would rather talk about something else.",
    "Hold on, what did you just say?",
)
BACKCHANNELS = ("Okay.", "Mm-hmm.", "Yeah.", "Uh-huh.", "Right.", "Sure.")
# Long bot replies: each gives several seconds of speech to talk over.
BOT_REPLIES = (
    "Thanks for calling. Your order left our warehouse this morning and should reach you on Thursday, "
    "and I can send the tracking number to your phone if that helps.",
    "The new plan costs twelve dollars a month, includes unlimited calls and texts, and you can cancel "
    "it at any time without a fee, so there is no risk in trying it.",
    "I looked at your account and I can see two payments in March, one on the fourth and one on the "
    "eighteenth, both for the same amount, which is why the balance looks high.",
    "Our opening hours are nine to five on weekdays and ten to two on Saturdays, and the shop on the "
    "high street also stays open late on Thursday evenings.",
)


@functools.lru_cache(maxsize=256)
def espeak(text: str, voice: str, rate: int = RATE, words_per_minute: int = 175) -> np.ndarray:
    """`text` spoken by espeak-ng's `voice`, mono int16 at `rate`, at the corpus's speech level."""
    out = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "--stdout", text],
        check=True, capture_output=True, timeout=30,
    ).stdout
    with wave.open(io.BytesIO(out)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        native = w.getframerate()
    pcm = soxr.resample(pcm.astype(np.float32), native, rate)
    pcm = _trim(pcm, rate)
    return _to_level(pcm, rate, SPEECH_RMS)


def onset_s(pcm: np.ndarray, rate: int = RATE) -> float:
    """Where speech starts in a clip: its first 10 ms within 30 dB of its loudest."""
    levels = _levels_db(pcm, rate // 100)
    return float(np.argmax(levels > levels.max() - 30)) * 0.01


def _levels_db(pcm: np.ndarray, hop: int) -> np.ndarray:
    n = len(pcm) // hop
    frames = np.asarray(pcm[: n * hop], dtype=np.float64).reshape(n, hop)
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1e-3)


def _trim(pcm: np.ndarray, rate: int) -> np.ndarray:
    levels = _levels_db(pcm, rate // 100)
    active = np.nonzero(levels > levels.max() - 40)[0]
    hop = rate // 100
    return pcm[active[0] * hop : (active[-1] + 1) * hop]


def _to_level(pcm: np.ndarray, rate: int, rms: float) -> np.ndarray:
    levels = _levels_db(pcm, rate // 50)
    active = levels > levels.max() - 30
    hop = rate // 50
    frames = np.asarray(pcm[: len(levels) * hop], dtype=np.float64).reshape(len(levels), hop)[active]
    gain = rms / math.sqrt(float(np.mean(frames**2)))
    return np.clip(np.asarray(pcm, dtype=np.float64) * gain, -32768, 32767).astype(np.int16)


def room_noise(seconds: float, dbfs: float, seed: int, rate: int = RATE) -> np.ndarray:
    """A room: pink-ish noise (a fan, traffic) and a faint mains hum, at `dbfs` RMS."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    white = rng.standard_normal(n)
    spectrum = np.fft.rfft(white)
    freqs = np.fft.rfftfreq(n, 1 / rate)
    spectrum /= np.sqrt(np.maximum(freqs, 20.0))  # 1/f power
    noise = np.fft.irfft(spectrum, n)
    t = np.arange(n) / rate
    noise = noise / np.std(noise) + 0.2 * np.sin(2 * np.pi * 50 * t) + 0.1 * np.sin(2 * np.pi * 150 * t)
    return _scaled(noise, dbfs)


def music(seconds: float, dbfs: float, seed: int, rate: int = RATE) -> np.ndarray:
    """Music in the room: a chord progression, a melody over it and a beat, at `dbfs` RMS."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    out = np.zeros(n)
    beat = 0.5  # 120 bpm
    roots = [220.0, 174.6, 261.6, 196.0]  # A F C G
    for bar in range(int(seconds / (4 * beat)) + 1):
        root = roots[bar % 4]
        start = bar * 4 * beat
        for ratio in (1.0, 1.26, 1.5):  # a major triad, held for the bar
            out += _note(t, start, 4 * beat, root * ratio, 0.25, harmonics=4)
        for step in range(8):  # eighth notes of melody
            note = root * 2 * 2 ** (int(rng.choice([0, 2, 4, 7, 9, 12])) / 12)
            out += _note(t, start + step * beat / 2, beat / 2, note, 0.35, harmonics=6)
        for step in range(4):  # a kick-like thump on each beat
            at = start + step * beat
            mask = (t >= at) & (t < at + 0.12)
            out[mask] += 0.8 * np.sin(2 * np.pi * 60 * (t[mask] - at)) * np.exp(-(t[mask] - at) * 30)
    return _scaled(out, dbfs)


def _note(t: np.ndarray, start: float, length: float, freq: float, amp: float, harmonics: int) -> np.ndarray:
    out = np.zeros_like(t)
    mask = (t >= start) & (t < start + length)
    local = t[mask] - start
    envelope = np.minimum(1.0, local / 0.01) * np.exp(-local * 3.0)
    tone = sum(np.sin(2 * np.pi * freq * k * local) / k for k in range(1, harmonics + 1))
    out[mask] = amp * envelope * tone
    return out


def _scaled(signal: np.ndarray, dbfs: float) -> np.ndarray:
    rms = 32767 * 10 ** (dbfs / 20)
    signal = signal / (np.sqrt(np.mean(signal**2)) + 1e-12) * rms
    return np.clip(signal, -32768, 32767).astype(np.int16)


class Speaker:
    """What a client's loudspeaker plays: the bot's audio as the client decoded it, in real time.

    The client's recorder `feed`s each decoded frame; the microphone takes 20 ms
    from here per tick, which is what the loudspeaker is playing at that moment.
    What waits is capped, so a stalled microphone cannot make it grow.
    """

    MAX_WAITING = RATE // 5  # 200 ms

    def __init__(self) -> None:
        self._waiting = np.zeros(0, dtype=np.int16)

    def feed(self, pcm48k: np.ndarray) -> None:
        waiting = np.concatenate([self._waiting, np.asarray(pcm48k, dtype=np.int16)])
        self._waiting = waiting[-self.MAX_WAITING :]

    def take(self, n: int) -> np.ndarray:
        chunk, self._waiting = self._waiting[:n], self._waiting[n:]
        if len(chunk) < n:
            chunk = np.concatenate([chunk, np.zeros(n - len(chunk), dtype=np.int16)])
        return chunk


def make_echo_mic_track():
    """An `EchoMicTrack` class (imported here so the corpus itself needs no aiortc)."""
    import av
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

    class EchoMicTrack(MediaStreamTrack):
        """A client microphone in a room: the bot's echo (the loudspeaker, `delay_ms` later, at
        `echo_db`), plus whatever is `play`ed into it (a caller, noise, music), in real time.

        `played_at[i]` is when the i-th `play`ed clip's first sample went out on this track
        (perf_counter): a caller's onset is that plus the clip's own `onset_s`.
        """

        kind = "audio"

        def __init__(self, speaker: Speaker, *, echo_db: float | None, delay_ms: int = 150,
                     background: np.ndarray | None = None) -> None:
            super().__init__()
            self.speaker = speaker
            self.gain = None if echo_db is None else 10 ** (echo_db / 20)
            self._delay = np.zeros(int(RATE * delay_ms / 1000), dtype=np.float64)
            self._clips: list[list] = []  # [pcm, position, index]
            self._background = background
            self._bg_pos = 0
            self.played_at: list[float | None] = []
            self._pts = 0
            self._start: float | None = None

        def play(self, pcm48k: np.ndarray) -> int:
            """Start a clip on the next frame; returns its index for `played_at`."""
            self._clips.append([np.asarray(pcm48k, dtype=np.int16), 0, len(self.played_at)])
            self.played_at.append(None)
            return len(self.played_at) - 1

        @property
        def busy(self) -> bool:
            return bool(self._clips)

        async def recv(self):
            if self.readyState != "live":
                raise MediaStreamError
            n = RATE // 50
            if self._start is None:
                self._start = time.monotonic()
            wait = self._start + self._pts / RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            mix = np.zeros(n, dtype=np.float64)
            heard = self.speaker.take(n).astype(np.float64)
            if self.gain is not None:
                line = np.concatenate([self._delay, heard])
                mix += line[:n] * self.gain
                self._delay = line[n:]
            if self._background is not None:
                bg = np.take(self._background, np.arange(self._bg_pos, self._bg_pos + n), mode="wrap")
                self._bg_pos = (self._bg_pos + n) % len(self._background)
                mix += bg
            now = time.perf_counter()
            for clip in list(self._clips):
                pcm, pos, index = clip
                if pos == 0:
                    self.played_at[index] = now
                piece = pcm[pos : pos + n]
                mix[: len(piece)] += piece
                clip[1] = pos + n
                if clip[1] >= len(pcm):
                    self._clips.remove(clip)
            frame = av.AudioFrame.from_ndarray(
                np.clip(mix, -32768, 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
            )
            frame.sample_rate = RATE
            frame.pts = self._pts
            frame.time_base = fractions.Fraction(1, RATE)
            self._pts += n
            return frame

    return EchoMicTrack


def echo_client(url: str, speaker: Speaker | None = None, *, echo_db: float | None, delay_ms: int = 150,
                background: np.ndarray | None = None):
    """An RtcClient whose microphone is an `EchoMicTrack` fed by its own loudspeaker."""
    from voxgate.rtc_client import RtcClient

    speaker = speaker or Speaker()
    client = RtcClient(url, mic=True)
    client.mic = make_echo_mic_track()(speaker, echo_db=echo_db, delay_ms=delay_ms, background=background)
    record = client.audio.add

    def add(at: float, pcm: np.ndarray) -> None:  # the loudspeaker plays what the client decodes
        record(at, pcm)
        speaker.feed(pcm)

    client.audio.add = add
    return client
