"""Barge-in that ignores the bot's own voice: the microphone less the echo of what was played.

A caller on a speakerphone, a phone held near a loudspeaker or a client without
echo cancellation sends the bot's speech back in its microphone, 100-800 ms
after it left. The gateway knows exactly what it played and when, so each
session that listens keeps a reference of it and takes it out of the
microphone before the VAD hears it:

1. The tap: every frame the output sends is recorded with its departure time
   (`ReferenceTap`, called by the playout; a bounded deque, nothing decoded).
2. The delay: the microphone's and the reference's 10 ms energy envelopes are
   correlated over the last 2 s, across 0-`MAX_DELAY_MS` lags, a few times a
   second while the bot speaks. Log envelopes, so the echo's level does not
   matter; a correlation under `MIN_CORRELATION` (the caller talking, the bot
   silent) keeps the last estimate.
3. The canceller: libspeexdsp's adaptive filter (gateway/caller/speex.py) gets the
   reference at that delay, `LEAD_MS` early, and learns the rest of the path
   (the room, the codecs) within `FILTER_MS`; its residual-echo suppressor
   takes out most of what the filter leaves.
4. The guard: what is left of the echo is still speech, and a canceller that
   has not converged leaves a lot of it. So a frame can count as the caller's
   voice only if it is louder than the echo could be: the reference's level
   at that delay (the loudest over the room's tail) plus the residue's learnt
   gain (`GUARD_PERCENTILE` of the residue against the reference, over the
   last seconds the caller was quiet) plus `GUARD_MARGIN_DB`. Before the delay
   is known, the guard is the loudest reference over every delay, at full
   level: the caller must be louder than the bot itself. On a phone call, after
   a stall or a drained queue moves the reference, the canceller's bound waits
   `SETTLE_HOPS` past the jump's echo: the far end may now play it a little
   sooner or later than the canceller learnt.
5. The coherence check: a frame over its guard that the canceller failed on
   (it took out less than `FAILED_DB`) counts as the caller only if the
   microphone is not a copy of what the bot played. Its normalized correlation
   with the reference, within `COHERENCE_SPAN_MS` of the delay, must stay
   under `COHERENT`. The far end's playout slipping mid-reply moves the echo
   20-80 ms; until the canceller relearns it, what it takes out is an echo no
   longer there and its output is the echo or more, over a guard that trusted
   it. A caller's voice over the echo keeps the correlation low: theirs is not
   in the reference.

While the bot has been silent for longer than any echo lasts, none of this
runs: the microphone goes to the VAD as it is.

6. Only where there is echo (`needed`, a cheap check on the session's loop):
   browsers cancel their own echo (AEC3), so a WebRTC caller's microphone is
   quiet while the bot talks. Once it has been, over DORMANT_AFTER_FRAMES of
   the bot's talk with no echo delay found, the canceller sleeps: the
   microphone goes to the VAD as it is, nothing is decoded, no job is queued.
   A frame audible over the room while the bot talks wakes it, with what it
   had learnt (one after its last sound is most likely the caller answering:
   an echo is heard during the talk too). While the bot has been
   silent longer than any echo lasts it is not asked at all (its frames would
   pass through it as they are). A phone leg's canceller, and one that has
   found an echo, never sleep. See docs/barge-in.md for how
this was chosen, with figures.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..media import opus
from . import speex
from ..media.encoder import alaw_decode, ulaw_decode
from ..media.resample import Upsampler2x
from .vad import FRAME_SAMPLES, VAD_RATE

HOP = VAD_RATE // 100  # 10 ms: the envelopes' step
MAX_DELAY_MS = 600  # the longest echo delay looked for: network both ways, the client's buffers, the room
FILTER_MS = 128  # the canceller's tail after its reference: the room, and an estimate off by up to ~100 ms
LEAD_MS = 20  # the reference goes to the canceller this much early, so an estimate a little long still works
TAIL_MS = 60  # the room's reverberation: the echo outlasts its reference this long
ESTIMATE_WINDOW_MS = 2000
# Of that window, how much must be the microphone's own sound (after its first packet): before it,
# its envelope is a floor, and the step from that floor to the room (music, noise) as the
# microphone opens, just as the bot starts to talk, correlates with the bot's own step at a lag
# where no echo is.
MIN_HEARD_MS = 300
ESTIMATE_EVERY_FRAMES = 10  # 200 ms
MIN_CORRELATION = 0.6
CONFIRMATIONS = 3  # estimates in a row (600 ms) that must agree before a delay is taken
# The reference has to move for the correlation to mean something: its envelope's spread, in dB.
MIN_SPREAD_DB = 6.0
QUIET_DB = 20.0  # a frame the peer did not send: silence, as the VAD's floor has it (its lowest)
ACTIVE_DB = 30.0  # a reference hop louder than this (VAD scale, 20 log10 of the int16 RMS) is the bot talking
GUARD_MARGIN_DB = 6.0
# A frame the microphone did not decode (a browser's packet marked quiet by its level, DTX) teaches
# the guard only where the reference stands this far above the microphone's noise floor. Its level
# is the room's, not the echo's, and where the bot is faint (a fricative, a word's end) it reads as
# an echo nearly as loud as the bot: a handful of them raised the guard's percentile from -19 to
# -5 dB and hid a caller's "Stop, stop" under it for 1.5 s. Decoded frames teach as before: there,
# what is heard is the residue itself.
FLOOR_HEADROOM_DB = 25.0
# On a phone call, a stall of the output, and the phone's queue draining after it, move where the
# phone plays the audio against the reference (20-40 ms seen on a loaded machine): the canceller's
# residue was then the echo itself, far over a guard that trusted it (the bot stopped itself). Until the jump's echo has been back this long, the guard is the one
# that holds for any delay; the canceller's comes back after. Without stalls nothing changes.
SETTLE_HOPS = 60
# Before the bot has talked for the longest delay, a microphone frame this far over the VAD's noise
# floor (its own margin, vad.py) is loud enough to say something of the echo: it teaches the guard.
AUDIBLE_DB = 9.0
GUARD_PERCENTILE = 95
GUARD_HISTORY = 200  # frames of residue the guard learns from (4 s)
GUARD_MIN_HISTORY = 10  # until this many (200 ms), the guard stays at its cold level
COLD_GAIN_DB = 0.0  # the echo path's gain assumed before anything is learnt: as loud as the bot
# The least gain the guard learns, however quiet the microphone was: an echo that appears later (a
# speakerphone switched on) then still has to be within this of the bot to be let through.
MIN_GAIN_DB = -30.0
# The coherence check (5. above). A caller 6 dB under the echo already brings the correlation of a
# pure copy under 0.9 (0.89); a real room's reverberation keeps an acoustic echo's under it, so there
# the check rarely fires and the guard alone decides, as before. Module trials (tests/gateway/
# test_echo.py): phone replies whose far end slipped 20-80 ms, 7 of 72 false starts without it, 0 with
# it; 24 callers over -10 dB echo, opus and μ-law, heard as often and as soon with it as without.
FAILED_DB = 3.0
COHERENT = 0.9
COHERENCE_FRAMES = 3  # the microphone's last 60 ms: shorter windows correlate with anything
COHERENCE_SPAN_MS = 120  # how far from the delay the echo may have moved (slips add up)
TRACE_FRAMES = 25  # frames describe() shows (500 ms): more than the VAD's window to start a turn
RING = 1 << 15  # reference samples kept (2 s at 16 kHz)
MAX_TAPPED = 150  # departed frames waiting to be decoded (3 s): a session that stops listening cannot grow it
MAX_MISSING_FRAMES = 50  # before the microphone's first packet, at most this much counts as quiet
# 1 s of the bot talking (longer than any echo's delay) over a microphone never audible (AUDIBLE_DB over the
# room: the VAD's own margin, under which no frame is voiced), with no echo found: the canceller sleeps. An
# echo under that could never start a turn; one over it wakes the canceller at its first frame.
DORMANT_AFTER_FRAMES = 50
ECHO_SPAN_S = (MAX_DELAY_MS + FILTER_MS + TAIL_MS) / 1000  # after the bot's last sound, its echo may still come
TALKING_S = 0.1  # the bot's last sound this recent: it is talking (its frames leave every 20 ms)
_LOG_FLOOR = 1e2  # hop energies under this are the floor (silence), in int16 units squared
_MAX_LAG_HOPS = MAX_DELAY_MS // 10
_WINDOW_HOPS = ESTIMATE_WINDOW_MS // 10
_MIN_HEARD_HOPS = MIN_HEARD_MS // 10
_ENV_RING = 1 << 9  # hops of envelope kept: more than a window plus the longest lag
_SPAN = VAD_RATE * COHERENCE_SPAN_MS // 1000
_COHERENCE_SAMPLES = COHERENCE_FRAMES * FRAME_SAMPLES


def _fft_size(n: int) -> int:
    """The least size >= n whose only factors are 2, 3 and 5: numpy's FFT is fastest there
    (5760 for the coherence check: 0.13 ms for its three transforms, 0.22 at 8192)."""
    while True:
        m = n
        for f in (2, 3, 5):
            while m % f == 0:
                m //= f
        if m == 1:
            return n
        n += 1


# The correlation at every lag in one FFT: the microphone's window against the reference's span, no wrap.
_FFT_SIZE = _fft_size(_COHERENCE_SAMPLES * 2 + 2 * _SPAN - 1)


def _db(energy: float) -> float:
    return 10 * math.log10(energy + 1e-9)


class ReferenceTap:
    """What the session's output sent, and when: (departure time, payload or None for silence).

    The playout calls it for every frame it hands out; it only appends to a bounded deque."""

    def __init__(self) -> None:
        self.frames: deque = deque(maxlen=MAX_TAPPED)
        self.sound_at = float("-inf")  # when the last frame with sound left

    def __call__(self, payload: bytes | None, sent_at: float) -> None:
        self.frames.append((sent_at, payload or None))
        if payload:
            self.sound_at = sent_at


class EchoGain:
    """How loud the echo (or what the canceller leaves of it) is against the reference, in dB:
    GUARD_PERCENTILE of the last GUARD_HISTORY frames with the caller quiet; COLD_GAIN_DB
    until GUARD_MIN_HISTORY of them."""

    def __init__(self) -> None:
        self._history: deque = deque(maxlen=GUARD_HISTORY)
        self.gain_db = COLD_GAIN_DB
        self._since = 0

    @property
    def ready(self) -> bool:
        return len(self._history) >= GUARD_MIN_HISTORY

    def add_against(self, level_db: float, reference_db: float, floor_db: float | None = None) -> None:
        """A frame with the caller quiet: its level against the reference's (only while the bot spoke).
        A frame known by its level alone (not decoded) teaches only while the bot spoke loudly enough
        for its echo to be told from the room (`floor_db`, FLOOR_HEADROOM_DB)."""
        if reference_db > ACTIVE_DB and (floor_db is None or reference_db > floor_db + FLOOR_HEADROOM_DB):
            self._add(level_db - reference_db)

    def _add(self, value_db: float) -> None:
        self._history.append(value_db)
        self._since += 1
        # The percentile every fifth frame: sorting 200 values per frame would cost more than the rest.
        if len(self._history) >= GUARD_MIN_HISTORY and self._since >= 5:
            self._since = 0
            self.gain_db = min(COLD_GAIN_DB, max(MIN_GAIN_DB, float(np.percentile(self._history, GUARD_PERCENTILE))))


class EchoCanceller:
    """One session's echo handling: microphone frames in, (frame less echo, guard level) out.

    Not thread-safe: the session runs its frames through it one job at a time.
    """

    def __init__(self, codec: str, tap: ReferenceTap, *, epoch: float) -> None:
        self.codec = codec
        self.tap = tap
        self.epoch = epoch
        if codec == "opus":
            self._opus: opus.Decoder | None = opus.Decoder(VAD_RATE)
            self._law = None
            self._upsampler: Upsampler2x | None = None
        else:
            self._opus = None
            self._law = ulaw_decode if codec == "pcmu" else alaw_decode
            # Not a soxr stream: it hands 8 to 16 kHz over in ~100 ms blocks, which would lay the
            # reference up to 100 ms after its departure, behind its own echo on a short path
            # (the canceller and the guard then look the wrong way). The half-band filter gives
            # each frame's samples at once, `Upsampler2x.DELAY_S` late, the same as the microphone's.
            self._upsampler = Upsampler2x()
        self._filter_delay_s = 0.0 if self._upsampler is None else Upsampler2x.DELAY_S
        self._canceller: speex.EchoCanceller | None = None
        self._ring = np.zeros(RING, dtype=np.int16)
        self._ref_end: int | None = None  # absolute sample position after the last reference sample
        self._first_ref = 0
        self._resync_hop = -(10**9)  # a phone call's last stall or drained queue, as a reference hop (SETTLE_HOPS)
        self._ref_env = np.full(_ENV_RING, _LOG_FLOOR)  # reference hop energies, by hop index mod _ENV_RING
        self._ref_env_end = 0  # hop index after the last complete reference hop
        self._mic_env = np.full(_ENV_RING, _LOG_FLOOR)
        self._mic_end: int | None = None
        self._mic_first_hop: int | None = None  # the first hop of the microphone's own sound
        self._pending = np.zeros(0, dtype=np.int16)
        self._last_active_hop = -(10**9)
        self._talk_start_hop = 0
        self._frames_since_estimate = 0
        self.delay_hops: int | None = None  # the echo's delay behind the reference, in 10 ms hops
        self._candidate: int | None = None  # a delay seen in the last estimates, not yet confirmed
        self._seen = 0
        self.correlation = 0.0
        # The last frame's (level dB, reference dB, the gain it teaches), until learn().
        self._last: list[tuple[float, float, EchoGain]] | None = None
        self._unlocked = EchoGain()  # the microphone against the loudest reference over every delay
        self._locked = EchoGain()  # the canceller's residue against the reference at the delay
        self.frames = 0
        self.cancelled = 0  # frames that went through the canceller
        self.coherent = 0  # frames over their guard that the coherence check held back as the bot's echo
        self._raw = np.zeros(_COHERENCE_SAMPLES, dtype=np.int16)  # the microphone's last frames, before the canceller
        self.delay_changes = 0
        # (hop, microphone dB, heard dB, guard dB, voiced) of the last frames: kept only at debug level (describe()).
        self._trace: deque = deque(maxlen=TRACE_FRAMES)
        self._estimates: deque = deque(maxlen=TRACE_FRAMES // 3)  # (hop, best lag, its correlation)
        self._raw_db = 0.0  # the last frame's level before the canceller
        self.started_trace: str | None = None  # describe() where the VAD's last turn started over the guard
        self.dormant = False  # asleep: no echo heard over DORMANT_AFTER_FRAMES of the bot's talk (`needed`)
        self._quiet_talk = 0  # frames of the bot's talk (and its echo's span) with the microphone quiet, in a row
        self.woken = 0

    def needed(self, pcm: np.ndarray | None, level_db: float | None, floor_db: float, now: float) -> bool:
        """Whether a microphone frame (None: not decoded, `level_db` its level if known) must go through
        the canceller; the session's loop asks, with no job of the canceller's running. A few µs: asleep,
        a frame costs this and the VAD alone. Phone legs, and a canceller that found an echo, always."""
        if self._law is not None or self.delay_hops is not None:
            return True
        if now - self.tap.sound_at > ECHO_SPAN_S:
            return False  # no echo can be in it: the VAD alone, as process() would hand it on (_bot_silent)
        if pcm is not None:
            samples = pcm.astype(np.float64)
            level = _db(float(np.dot(samples, samples)) / max(1, len(samples)))
        else:
            level = QUIET_DB if level_db is None else level_db
        if level > floor_db + AUDIBLE_DB:
            if self.dormant and now - self.tap.sound_at > TALKING_S:
                return False  # after the bot's last sound: the caller answering, most likely; an echo shows in the talk
            self._quiet_talk = 0  # the caller, or an echo: awake until the bot has talked over quiet again
            if self.dormant:
                self.dormant = False
                self.woken += 1
        elif not self.dormant:
            self._quiet_talk += 1
            self.dormant = self._quiet_talk >= DORMANT_AFTER_FRAMES
        return not self.dormant

    # Positions: samples at 16 kHz since `epoch`, on the session's clock (perf_counter).
    def _position(self, t: float) -> int:
        return int(round((t - self.epoch) * VAD_RATE))

    def _take_reference(self) -> None:
        frames = self.tap.frames
        while frames:
            sent_at, payload = frames.popleft()
            if payload is None and self._upsampler is not None:
                pcm = self._upsampler.process(np.zeros(FRAME_SAMPLES // 2, dtype=np.int16))  # its filter runs on
            elif payload is None:
                pcm = np.zeros(FRAME_SAMPLES, dtype=np.int16)
            elif self._opus is not None:
                try:
                    pcm = self._opus.decode(payload)
                except opus.OpusError:
                    pcm = np.zeros(FRAME_SAMPLES, dtype=np.int16)
            else:
                assert self._law is not None and self._upsampler is not None
                pcm = self._upsampler.process(self._law(payload))
            start = self._position(sent_at - self._filter_delay_s)
            if self._ref_end is None:
                self._ref_end = self._first_ref = start
            if payload is None and self._law is not None and start < self._ref_end - HOP:
                # A phone call is sent nothing between utterances, so the phone's queue drains: a
                # reference laid behind the clock (the frames of a stall, played one after another)
                # waits for it here, and the next reply is laid where the phone plays it, on time.
                self._resync_hop = start // HOP
                continue
            # Frames leave every 20 ms within a few ms: lay them end to end. A jump (DTX between
            # utterances, a stall) leaves silence in between.
            gap = start - self._ref_end
            if gap > HOP:
                self._write(np.zeros(min(gap, RING), dtype=np.int16))
                self._ref_end = start
                if self._law is not None:
                    # A phone call's stall: the phone plays what it then gets one frame after
                    # another, behind, until its queue drains (a browser's jitter buffer follows
                    # by itself, and counting its late ticks kept its caller under the guard).
                    self._resync_hop = start // HOP
            self._write(pcm)

    def _write(self, pcm: np.ndarray) -> None:
        assert self._ref_end is not None
        n = len(pcm)
        if n == 0:
            return
        at = self._ref_end % RING
        first = min(n, RING - at)
        self._ring[at : at + first] = pcm[:first]
        if first < n:
            self._ring[: n - first] = pcm[first:]
        self._ref_end += n
        # Whole hops of the reference now known: their energies.
        hop_end = self._ref_end // HOP
        for hop in range(max(self._ref_env_end, hop_end - RING // HOP + 1), hop_end):
            seg = self._read(hop * HOP, HOP).astype(np.float64)
            energy = float(np.dot(seg, seg)) / HOP
            self._ref_env[hop % _ENV_RING] = max(energy, _LOG_FLOOR)
            if _db(energy) > ACTIVE_DB:
                if hop - self._last_active_hop > _MAX_LAG_HOPS:
                    self._talk_start_hop = hop  # the bot starts talking after a silence
                self._last_active_hop = hop
        self._ref_env_end = hop_end

    def _read(self, start: int, n: int) -> np.ndarray:
        """Reference samples [start, start + n): zeros where none were sent or kept."""
        out = np.zeros(n, dtype=np.int16)
        if self._ref_end is None:
            return out
        lo, hi = max(start, self._ref_end - RING), min(start + n, self._ref_end)
        if lo >= hi:
            return out
        a, b = lo % RING, (hi - 1) % RING + 1
        if a < b:
            out[lo - start : hi - start] = self._ring[a:b]
        else:
            split = RING - a
            out[lo - start : lo - start + split] = self._ring[a:]
            out[lo - start + split : hi - start] = self._ring[:b]
        return out

    def process(self, pcm: np.ndarray, arrived_at: float, floor_db: float) -> list[tuple[np.ndarray, float | None]]:
        """Microphone PCM (16 kHz int16) that arrived at `arrived_at`: whole frames, each less the
        echo, with the level (VAD scale, dB) it must exceed to count as the caller's voice, or None
        where no echo can be in it."""
        self._take_reference()
        pcm = np.asarray(pcm, dtype=np.int16)
        self._follow(arrived_at, len(pcm) + len(self._pending), floor_db)
        buf = np.concatenate([self._pending, pcm]) if len(self._pending) else pcm
        n = len(buf) // FRAME_SAMPLES
        self._pending = buf[n * FRAME_SAMPLES :]
        return [self._frame(buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES], floor_db) for i in range(n)]

    def skip(self, frames: int, level_db: float | None, arrived_at: float, caller_quiet: bool, floor_db: float) -> None:
        """Frames the microphone did not decode (DTX, loss, its level gate; `level_db` their level
        where the peer said it): time moves on, and a quiet microphone while the bot speaks
        teaches the guard that its echo is faint (`floor_db`: the VAD's noise floor)."""
        self._take_reference()
        self._follow(arrived_at, frames * FRAME_SAMPLES, floor_db)
        self._quiet(frames, QUIET_DB if level_db is None else level_db, caller_quiet, floor_db)

    def _quiet(self, frames: int, level: float, caller_quiet: bool, floor_db: float) -> None:
        assert self._mic_end is not None
        energy = max(10 ** (level / 10), _LOG_FLOOR)
        for _ in range(frames):
            hop = self._mic_end // HOP
            self._mic_end += FRAME_SAMPLES
            self._mic_env[hop % _ENV_RING] = self._mic_env[(hop + 1) % _ENV_RING] = energy
            if self._bot_silent(hop):
                continue
            self._tick(hop)
            if caller_quiet and self._teaches(hop):
                # Not decoded, so not cancelled either: its level is the most its residue could be.
                for _, reference_db, gain in self._references(hop):
                    gain.add_against(level, reference_db, floor_db)

    def _follow(self, arrived_at: float, samples: int, floor_db: float) -> None:
        """Where the microphone's next samples lie: after the last ones, unless the arrivals say
        otherwise by more than two frames (the first packet, a stall, the peer's clock)."""
        start = self._position(arrived_at) - samples
        if self._mic_end is None:
            # Nothing came before: the peer had nothing to send (a phone bridge sends no silence, a
            # browser its DTX), which is what a gap says too. Up to a second of it teaches the guard.
            missing = 0 if self._ref_end is None else min(MAX_MISSING_FRAMES, max(0, start - self._first_ref) // FRAME_SAMPLES)
            self._mic_end = start - missing * FRAME_SAMPLES
            self._mic_first_hop = -(-start // HOP)
            self._quiet(missing, QUIET_DB, True, floor_db)
        elif abs(start - self._mic_end) > 2 * FRAME_SAMPLES:
            if start > self._mic_end:
                # Frames that went to the VAD alone (`needed`): quiet, for the delay estimate, as a gap is.
                hops = np.arange(max(self._mic_end // HOP, start // HOP - _ENV_RING), start // HOP)
                self._mic_env[hops % _ENV_RING] = _LOG_FLOOR
            self._mic_end = start

    def _teaches(self, hop: int) -> bool:
        """Whether a quiet frame at `hop` says anything about the echo: only once the bot has been
        talking for longer than any echo's delay (before that, its echo may just not be back yet),
        and only while it still talks (`_talking`)."""
        return hop - self._talk_start_hop >= _MAX_LAG_HOPS and self._talking(hop)

    def _talking(self, hop: int) -> bool:
        """The bot talks at `hop`, or stopped within the room's tail. After that, what the microphone
        hears may be the caller answering, and the guard (cold after a short reply: the bot's own
        level) holds their first words under it, so the VAD calls them quiet: taught as echo, they
        raised the guard of the next reply over the caller's voice (a caller with no echo at all
        could no longer interrupt; tests/gateway/test_echo.py)."""
        return hop <= self._last_active_hop + TAIL_MS // 10

    def _bot_silent(self, hop: int) -> bool:
        """The bot silent for longer than any echo lasts: nothing to take out."""
        return hop - self._last_active_hop > _MAX_LAG_HOPS + (FILTER_MS + TAIL_MS) // 10

    def _tick(self, hop: int) -> None:
        self._frames_since_estimate += 1
        if self._frames_since_estimate >= ESTIMATE_EVERY_FRAMES:
            self._frames_since_estimate = 0
            self._estimate(hop + 2)

    def _references(self, hop: int) -> list[tuple[str, float, "EchoGain"]]:
        """The reference levels a frame at `hop` is held against: the loudest over every delay,
        and, once the delay is known, the loudest over the room's tail at that delay."""
        out = [("any", self._loudest(hop - _MAX_LAG_HOPS, hop + 2), self._unlocked)]
        if self.delay_hops is not None:
            out.append(("at", self._loudest(hop - self.delay_hops - TAIL_MS // 10, hop - self.delay_hops + 2), self._locked))
        return out

    def _frame(self, frame: np.ndarray, floor_db: float) -> tuple[np.ndarray, float | None]:
        assert self._mic_end is not None
        m = self._mic_end
        self._mic_end += FRAME_SAMPLES
        self.frames += 1
        hop = m // HOP
        samples = frame.astype(np.float64)
        for k in range(2):
            seg = samples[k * HOP : (k + 1) * HOP]
            self._mic_env[(hop + k) % _ENV_RING] = max(float(np.dot(seg, seg)) / HOP, _LOG_FLOOR)
        if self._bot_silent(hop):
            return frame, None
        self._tick(hop)
        references = self._references(hop)
        _, loudest, _ = references[0]
        level_db = self._raw_db = _db(float(np.dot(samples, samples)) / FRAME_SAMPLES)
        # Any delay, at the gain learnt of the microphone against that (full level until then).
        guard = loudest + self._unlocked.gain_db + GUARD_MARGIN_DB
        learn = [(level_db, loudest, self._unlocked)]
        if self.delay_hops is not None:
            self._raw[:-FRAME_SAMPLES] = self._raw[FRAME_SAMPLES:]
            self._raw[-FRAME_SAMPLES:] = frame
            _, aligned, _ = references[1]
            if self._canceller is None:
                self._canceller = speex.EchoCanceller(FRAME_SAMPLES, VAD_RATE * FILTER_MS // 1000, VAD_RATE)
            lead = VAD_RATE * LEAD_MS // 1000
            frame = self._canceller.process(frame, self._read(m - self.delay_hops * HOP + lead, FRAME_SAMPLES))
            self.cancelled += 1
            r = frame.astype(np.float64)
            heard_db = _db(float(np.dot(r, r)) / FRAME_SAMPLES)
            learn.append((heard_db, aligned, self._locked))
            if self._locked.ready and hop >= self._resync_hop + self.delay_hops + SETTLE_HOPS:
                # Either bound holds the echo under it; the lower lets more of the caller through.
                guard = min(guard, aligned + self._locked.gain_db + GUARD_MARGIN_DB)
            if heard_db > guard and heard_db >= level_db - FAILED_DB and self._coherent(m + FRAME_SAMPLES):
                self.coherent += 1
                guard = heard_db + GUARD_MARGIN_DB
        if self._teaches(hop):
            self._last = learn
        elif level_db > floor_db + AUDIBLE_DB and self._talking(hop):
            # Before the bot has talked for the longest delay, a quiet microphone proves nothing (its
            # echo may not be back yet), but a loud one is its echo (or the caller, as the VAD will
            # say): the guard for any delay learns it. Otherwise a pause could be all it learnt: the
            # bot's first words' echo gone by before teaching began, their reference still the
            # loudest, the microphone near the room (-30 dB from 10 frames where the echo was -10
            # dB: its next words went past the guard).
            self._last = learn[:1]
        else:
            self._last = None
        return frame, guard

    def _coherent(self, end: int) -> bool:
        """Whether the microphone's last COHERENCE_FRAMES, up to sample `end`, are a copy of the
        reference somewhere within COHERENCE_SPAN_MS of the echo's delay: their normalized
        correlation at the best lag is at least COHERENT."""
        assert self.delay_hops is not None
        n = _COHERENCE_SAMPLES
        mic = self._raw.astype(np.float64)
        mic_energy = float(np.dot(mic, mic))
        if mic_energy <= 0.0:
            return False
        ref = self._read(end - n - self.delay_hops * HOP - _SPAN, n + 2 * _SPAN).astype(np.float64)
        # corr[k]: the microphone against ref[k : k + n], each lag's reference energy from a running sum.
        corr = np.fft.irfft(np.fft.rfft(ref, _FFT_SIZE) * np.conj(np.fft.rfft(mic, _FFT_SIZE)), _FFT_SIZE)[: 2 * _SPAN + 1]
        energy = np.concatenate(([0.0], np.cumsum(ref * ref)))
        windows = energy[n : n + 2 * _SPAN + 1] - energy[: 2 * _SPAN + 1]
        best = float(np.max(corr / np.sqrt(np.maximum(windows * mic_energy, 1e-9))))
        return best >= COHERENT

    def learn(self, caller_quiet: bool) -> None:
        """After the VAD's verdict on the last frame: a frame with the caller quiet teaches the
        guard how loud the echo (or its residue) is against the reference."""
        last, self._last = self._last, None
        if last is None or not caller_quiet:
            return
        for level_db, reference_db, gain in last:
            gain.add_against(level_db, reference_db)

    def _loudest(self, lo_hop: int, hi_hop: int) -> float:
        """The loudest reference hop in [lo_hop, hi_hop), in dB."""
        lo_hop = max(lo_hop, self._ref_env_end - _ENV_RING + 1, 0)
        hi_hop = min(hi_hop, self._ref_env_end)
        if lo_hop >= hi_hop:
            return _db(_LOG_FLOOR)
        idx = np.arange(lo_hop, hi_hop) % _ENV_RING
        return _db(float(self._ref_env[idx].max()))

    def _estimate(self, end_hop: int) -> None:
        """Correlate the last window of microphone envelope (what of it the microphone has heard)
        with the reference's at every lag."""
        window = _WINDOW_HOPS
        if self._mic_first_hop is not None:
            window = min(window, end_hop - self._mic_first_hop)
        if window < _MIN_HEARD_HOPS:
            return  # the microphone has not been heard for long enough yet
        first = end_hop - window - _MAX_LAG_HOPS
        if first < self._ref_env_end - _ENV_RING + 1 or end_hop > self._ref_env_end + 1:
            return  # not enough kept yet, or the reference lags the microphone (a stall)
        mic = np.log(self._mic_env[np.arange(end_hop - window, end_hop) % _ENV_RING])
        ref = np.log(self._ref_env[np.arange(first, end_hop) % _ENV_RING])
        if 10 / math.log(10) * float(ref.std()) < MIN_SPREAD_DB:
            return
        mic = mic - mic.mean()
        mic_norm = float(np.sqrt(np.dot(mic, mic)))
        if mic_norm == 0.0:
            return
        # windows[j] is the reference _MAX_LAG_HOPS - j hops behind the microphone's window.
        windows = np.lib.stride_tricks.sliding_window_view(ref, window)
        centred = windows - windows.mean(axis=1, keepdims=True)
        norms = np.sqrt(np.einsum("ij,ij->i", centred, centred))
        corr = centred @ mic / np.maximum(norms * mic_norm, 1e-9)
        best = int(np.argmax(corr))
        self.correlation = float(corr[best])
        self._estimates.append((end_hop, _MAX_LAG_HOPS - best, self.correlation))
        if self.correlation < MIN_CORRELATION:
            return
        lag = _MAX_LAG_HOPS - best
        if self.delay_hops is not None and abs(lag - self.delay_hops) <= 1:
            self._candidate, self._seen = None, 0
            return  # the same delay within a hop: the canceller's filter covers that
        # A chance likeness (the caller's speech against the bot's) jumps from lag to lag; an
        # echo stays put. A delay counts once CONFIRMATIONS estimates in a row agree on it.
        if self._candidate is not None and abs(lag - self._candidate) <= 1:
            self._seen += 1
        else:
            self._candidate, self._seen = lag, 1
        if self._seen < CONFIRMATIONS:
            return
        self._candidate, self._seen = None, 0
        if self.delay_hops is not None:
            self.delay_changes += 1
            # A new path: what the guard learnt of the old one's residue no longer holds.
            self._locked = EchoGain()
        self.delay_hops = lag

    def trace_frame(self, frame: np.ndarray, guard: float | None, voiced: bool) -> None:
        """Keep a frame's judgement for describe() (debug logging only)."""
        samples = frame.astype(np.float64)
        hop = -1 if self._mic_end is None else self._mic_end // HOP - 2
        self._trace.append((hop, self._raw_db, _db(float(np.dot(samples, samples)) / FRAME_SAMPLES), guard, voiced))

    def describe(self) -> str:
        """The canceller's state, its last delay estimates and frames, for a log line: why a frame
        passed the guard."""
        estimates = " ".join(f"{h}:{lag}@{c:.2f}" for h, lag, c in self._estimates)
        frames = " ".join(f"{h}:{raw:.0f}>{lv:.0f}/{'-' if g is None else f'{g:.0f}'}{'*' if v else ''}"
                          for h, raw, lv, g, v in self._trace)
        return (f"delay={self.delay_hops} corr={self.correlation:.2f} changes={self.delay_changes} coherent={self.coherent} "
                f"gain_any={self._unlocked.gain_db:.1f}({len(self._unlocked._history)}) "
                f"gain_at={self._locked.gain_db:.1f}({len(self._locked._history)}) resync_hop={self._resync_hop} "
                f"talk_start={self._talk_start_hop} ref_end_hop={self._ref_env_end} "
                f"estimates hop:lag@corr: {estimates} frames hop:mic>heard/guard(*voiced): {frames}")

    def close(self) -> None:
        if self._canceller is not None:
            self._canceller.close()
            self._canceller = None
