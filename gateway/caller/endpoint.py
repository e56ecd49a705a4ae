"""The end of the caller's turn, as a decision; and what they are saying while they say it.

A fixed silence is either slow (every answer waits for it) or rude (a caller
who pauses mid-sentence is answered before they finish). Here a turn ends
after a short silence (`min_silence_ms`) when what the caller said reads as
finished, and after a long one (`max_silence_ms`) when it does not:

1. At the turn's first silence of `pause_ms` (the VAD's `speech.paused`:
   SPECULATE_MS, or `min_silence_ms` if shorter), the turn so far is recognized
   at once, speculatively: the decode overlaps the rest of the short silence.
2. If the caller goes on (`speech.resumed`, or a new `speech.started` within
   `max_silence_ms`), that result is thrown away and the turn goes on.
3. Otherwise, when the text reads as finished (`reads_finished`: Whisper's
   closing punctuation, and no trailing "and", "so", "um", "because", "to"...),
   it is the turn's final `speech.transcript`, sent once `min_silence_ms` of
   silence have passed (or the decode is done, if later): the decode ran during
   the silence, so the final is there as the short silence ends. When it does not, the turn waits until `max_silence_ms` of silence and
   then sends the same text.

While the caller speaks, `partial_ms` paces partial transcripts
(`speech.transcript` with `final: false`) of the turn so far: at most one
decode in flight per session, none while the recognizer has no free slot,
and only from recognizers cheap enough for it (`partials`: Whisper's).

The final transcript is the end of the turn: answer it. A backend may start
its LLM on a partial and throw the result away if the final differs.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...config import Settings
from ...config_fields import bounds
from ..errors import SttError
from ..media.frames import FRAME_MS
from .stt import SpeechToText, TurnTranscriber

log = logging.getLogger(__name__)

# Silence after which the turn so far is recognized, ahead of the decision at min_silence_ms: a decode of a
# 2-3 s turn takes 60-100 ms on one thread here, so it is done by then (measured: bench/bench_conversation.py).
SPECULATE_MS = 150

# A turn whose last word is one of these is not finished: conjunctions, fillers, articles,
# prepositions, auxiliaries and pronouns that need more after them.
UNFINISHED = frozenset("""
and or but so because cause um umm uh uhh er erm hmm mm like to the a an of for with from at in on into onto
about by as than then if that which who whose when where while my your our their his her its this these those
some any i i'm i'd i'll we we're we'd you you're he she they is are was were am be been being do does did have
has had not can could would should will shall may might must want wanted need needed gonna wanna let let's also
plus just really very more most um-hmm well actually maybe what how why whether until unless although though
""".split())
_WORD = re.compile(r"[a-z']+(?:-[a-z']+)?")


def reads_finished(text: str, punctuated: bool = True) -> bool:
    """Whether a turn's text reads as finished: its last word needs nothing after it and, from a
    recognizer that punctuates (Whisper writes it from the prosody: a pause is "," or "..."), it
    closes with . ? or !."""
    text = text.strip()
    if punctuated and (not text or text.endswith(("...", "…", ",", "-", "—")) or text[-1] not in ".?!"):
        return False
    words = _WORD.findall(text.lower())
    return bool(words) and words[-1] not in UNFINISHED


MODALS = frozenset("can could would will may shall".split())
SHORT_WORDS = 5  # a sentence this short may be the start of a longer one: "I need to change." "Could you send?"


def judge(text: str, punctuated: bool = True) -> str:
    """How a turn's text reads: `finished`; `unfinished` (wait the longest silence); `short`, a request of
    SHORT_WORDS - 1 words or fewer with nothing after its verb ("Could you send?", "Can you tell me?": wait
    halfway); or `pitch`, a statement of SHORT_WORDS or fewer, finished if its pitch fell at its end and
    otherwise waits halfway ("I need to change." ... "the address"). Longer sentences read as finished."""
    if not reads_finished(text, punctuated):
        return "unfinished"
    if not punctuated:
        return "finished"
    last = _WORD.findall(re.split(r"[.?!]\s", text.strip())[-1].lower())
    if text.rstrip().endswith("?") and len(last) < SHORT_WORDS and last and last[0] in MODALS:
        return "short"
    if text.rstrip().endswith(".") and len(last) <= SHORT_WORDS:
        return "pitch"
    return "finished"


RATE = 16000
FALLING_ST = -2.0  # a statement's last 80 ms of pitch this far under the turn's median: it fell, it is done
PITCH_SPAN_S = 3.0  # the pitch is tracked over the turn's last seconds only
STIRRED_S = 0.6  # after a voiced frame past the VAD's stop: longer than speech.started takes (2 x 200 ms)
ENERGY_SHARE = 0.1  # frames this share of the loudest's RMS, or more, count for the pitch


def end_pitch_st(pcm: np.ndarray) -> float | None:
    """The pitch of the turn's last 80 ms of voice against its median, in semitones; None with too
    little voice. Autocorrelation pitch (70-400 Hz) of 30 ms frames every 10 ms, by FFT."""
    x = np.asarray(pcm[-int(RATE * PITCH_SPAN_S):], dtype=np.float64)
    hop, win = RATE // 100, 3 * RATE // 100
    if len(x) < win * 4:
        return None
    frames = np.lib.stride_tricks.sliding_window_view(x, win)[::hop] * np.hanning(win)
    energy = np.sqrt(np.mean(frames**2, axis=1))
    ac = np.fft.irfft(np.abs(np.fft.rfft(frames, 2 * win, axis=1)) ** 2, axis=1)[:, :win]
    lo, hi = RATE // 400, RATE // 70
    lags = lo + np.argmax(ac[:, lo:hi], axis=1)
    periodic = ac[np.arange(len(ac)), lags] > 0.3 * ac[:, 0]
    voiced = np.flatnonzero(periodic & (energy > ENERGY_SHARE * energy.max()))
    if len(voiced) < 8:
        return None
    f0 = RATE / lags[voiced]
    st = float(12 * np.log2(np.median(f0[-8:]) / np.median(f0)))
    # A weak tail's pitch is often found an octave off (a sub- or second harmonic): fold it back.
    while st > 6.0:
        st -= 12.0
    while st < -9.0:
        st += 12.0
    return st


@dataclass
class TurnSettings:
    """The end-of-turn rule's silences and the partials' pace; defaults are the flags', and a
    client's `turn` object (session.update) is held to the same ranges."""

    min_silence_ms: int = Settings.turn_min_silence_ms
    max_silence_ms: int = Settings.turn_max_silence_ms
    partial_ms: int = Settings.stt_partial_ms

    def update(self, data: dict) -> None:
        """Apply a client's `turn` object; raises ValueError with a message for the client."""
        unknown = set(data) - {"min_silence_ms", "max_silence_ms", "partial_ms"}
        if unknown:
            raise ValueError(f"turn takes min_silence_ms, max_silence_ms and partial_ms, not {sorted(unknown)}")
        low = min_silence = _int_in(data.get("min_silence_ms", self.min_silence_ms), "min_silence_ms",
                                    *bounds(Settings, "turn_min_silence_ms"))
        max_silence = _int_in(data.get("max_silence_ms", self.max_silence_ms), "max_silence_ms",
                              *bounds(Settings, "turn_max_silence_ms"))
        if max_silence < low:
            raise ValueError(f"turn 'max_silence_ms' ({max_silence}) must be at least min_silence_ms ({low})")
        partial = _int_in(data.get("partial_ms", self.partial_ms), "partial_ms", *bounds(Settings, "stt_partial_ms"))
        self.min_silence_ms, self.max_silence_ms, self.partial_ms = min_silence, max_silence, partial

    @property
    def pause_ms(self) -> int:
        """The silence after which the VAD says `speech.paused` and the turn so far is recognized."""
        return min(SPECULATE_MS, self.min_silence_ms)

    def describe(self) -> dict:
        return {"min_silence_ms": self.min_silence_ms, "max_silence_ms": self.max_silence_ms,
                "partial_ms": self.partial_ms}


def _int_in(value: object, name: str, low: float, high: float) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not low <= value <= high:
        raise ValueError(f"turn '{name}' must be a number from {low:g} to {high:g}")
    return int(value)


class Endpointer:
    """One session's turns: when each ends, and its partial transcripts. Fed the VAD's events
    (`event`) and every caller frame's time (`frame`); ends turns through `transcriber`."""

    def __init__(self, transcriber: TurnTranscriber, settings: TurnSettings, emit: Callable[[dict], None],
                 vad_speaking: Callable[[], bool]) -> None:
        self.transcriber = transcriber
        self.vad_speaking = vad_speaking  # whether the VAD is in a turn (between its started and stopped)
        self._stirred: asyncio.TimerHandle | None = None
        self.stt: SpeechToText = transcriber.stt
        self.settings = settings
        self.emit = emit
        self.partials = bool(getattr(self.stt.recognizer, "partials", False))
        self.punctuated = bool(getattr(self.stt.recognizer, "punctuates", False))
        self.state = "idle"  # idle, speaking, paused
        self.turn = 0  # counts turns: a partial of an ended turn is not sent
        self._epoch = 0  # counts pauses and resumptions: a decision of a pause the caller spoke over is dropped
        self._decision: asyncio.Task | None = None
        self._partial: asyncio.Task | None = None
        self._last_partial_ms = 0.0
        self.decided = {"finished": 0, "level": 0, "short": 0, "unfinished": 0, "resumed": 0}  # how pauses went (tests, benches)

    @staticmethod
    def suits(stt: SpeechToText) -> bool:
        """Whether turns recognized by `stt` are decided here: the rule reads the punctuation Whisper writes.
        Other recognizers' turns are the VAD's (speech.started to speech.stopped)."""
        return bool(getattr(stt.recognizer, "punctuates", False))

    def event(self, kind: str, at_ms: int) -> None:
        """A VAD event: speech.started, speech.paused, speech.resumed, speech.stopped."""
        if not self.transcriber.enabled:
            return
        if kind in ("speech.started", "speech.resumed"):
            if self._stirred is not None:
                self._stirred.cancel()
                self._stirred = None
            if self.state == "idle" and kind == "speech.resumed" and not self.vad_speaking():
                return  # a click long after the turn ended: a new turn begins with speech.started
            if self.state == "idle":
                self.turn += 1
                self.transcriber.started(at_ms)
                self._last_partial_ms = at_ms
            elif self.state == "paused":
                self.decided["resumed"] += 1
                self._drop_decision()
                if kind == "speech.resumed" and not self.vad_speaking():
                    # A voiced frame after the VAD's stop: speech.started follows within twice its min_speech_ms
                    # if the caller goes on; if not (a click, a breath), the pause is decided again.
                    self._stirred = asyncio.get_running_loop().call_later(STIRRED_S, self._still_paused, at_ms)
            self.state = "speaking"
        elif kind in ("speech.paused", "speech.stopped") and self.state == "speaking":
            self._pause(at_ms)

    def frame(self, capture_ms: float) -> None:
        """A caller frame was kept: time for a partial?"""
        s = self.settings
        if (self.state != "speaking" or not self.partials or not s.partial_ms or self._partial is not None
                or capture_ms - self._last_partial_ms < s.partial_ms):
            return
        if self.stt.running >= self.stt.max_concurrent or self.stt.waiting:
            return  # the recognizer is busy: finals first, this partial is skipped
        audio = self.transcriber.turn_audio(capture_ms + FRAME_MS)
        if audio is None:
            return
        self._last_partial_ms = capture_ms
        self._partial = asyncio.ensure_future(self._send_partial(self.turn, *audio))

    async def _send_partial(self, turn: int, pcm, start_ms: int, end_ms: int) -> None:
        try:
            text = await self.stt.recognize(pcm, self.transcriber)  # the session's one slot (stt.Slots)
        except SttError:
            return
        finally:
            self._partial = None
        if turn == self.turn and self.state != "idle" and text:
            self.emit({"type": "speech.transcript", "text": text, "final": False, "start_ms": start_ms,
                       "end_ms": end_ms})

    def _pause(self, at_ms: int, silent_ms: int | None = None) -> None:
        """The caller has been silent `silent_ms` (the VAD's pause_ms): recognize the turn so far now."""
        self.state = "paused"
        self._epoch += 1
        audio = self.transcriber.turn_audio(at_ms)
        s = self.settings
        silent_since = asyncio.get_running_loop().time() - (s.pause_ms if silent_ms is None else silent_ms) / 1000.0
        self._decision = asyncio.ensure_future(self._decide(self._epoch, audio, at_ms, silent_since))

    async def _decide(self, epoch: int, audio, at_ms: int, silent_since: float) -> None:
        loop = asyncio.get_running_loop()
        s = self.settings
        began = loop.time()
        text = None
        if audio is not None:
            try:
                text = await self.stt.recognize(audio[0], self.transcriber)
            except SttError:
                text = None  # the turn's end recognizes it again, and reports the error if it fails again
        if epoch != self._epoch:
            return
        decoded = loop.time()
        rule = judge(text, self.punctuated) if text is not None else "unfinished"
        if rule == "pitch":
            # A short statement whose pitch did not fall may be a pause on a word that could end it ("I need to
            # change... the address"): it waits halfway to the longest silence.
            pitch = await asyncio.to_thread(end_pitch_st, audio[0]) if audio is not None else None
            if epoch != self._epoch:
                return
            rule = "finished" if pitch is not None and pitch <= FALLING_ST else "level"
        end_after_ms = {"finished": s.min_silence_ms, "unfinished": s.max_silence_ms}.get(
            rule, (s.min_silence_ms + s.max_silence_ms) // 2)
        self.decided[rule] += 1
        wait_s = silent_since + end_after_ms / 1000.0 - loop.time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
            if epoch != self._epoch:
                return
        self.state = "idle"
        self._decision = None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("turn ended", extra={"fields": {
                "end_ms": audio[2] if audio is not None else at_ms, "rule": rule,
                "decode_ms": round((decoded - began) * 1000, 1),
                "silence_ms": round((loop.time() - silent_since) * 1000, 1)}})
        self.transcriber.stopped(at_ms, text)

    def _still_paused(self, at_ms: int) -> None:
        self._stirred = None
        if self.state == "speaking" and not self.vad_speaking():
            self._pause(at_ms, int(STIRRED_S * 1000))

    def _drop_decision(self) -> None:
        self._epoch += 1
        if self._decision is not None:
            self._decision.cancel()  # its decode, in a thread, runs out and is thrown away
            self._decision = None

    def close(self) -> None:
        self._drop_decision()
        if self._stirred is not None:
            self._stirred.cancel()
            self._stirred = None
        if self._partial is not None:
            self._partial.cancel()
            self._partial = None
        self.state = "idle"
