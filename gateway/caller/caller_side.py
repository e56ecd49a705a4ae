"""The caller's side of a session: the microphone's audio, echo, the VAD, turns, transcripts, and barge-in.

Everything the session hears goes through `CallerSide`: decoded audio from the
microphone (gateway/caller/mic.py) or a phone call (gateway/phone/twilio_input.py) is cut
into 20 ms frames (gateway/caller/caller_audio.py), the bot's own voice is taken out
(gateway/caller/echo.py, while `echo_cancel` is on and an output is attached), the VAD
(gateway/caller/vad.py) marks the caller's turns, the recognizer (gateway/caller/stt.py) and
the endpointer (gateway/caller/endpoint.py) turn them into text, and `vad_events`
decides what a turn does to the bot's speech. It is the one place that decides
a barge-in; it reaches the rest of the session only through the callbacks it is
made with (what is playing, interrupt, the echo reference, events out).

The barge-in settings (`BargeInSettings`; defaults and ranges are voxgate/config.py's):

- `echo_cancel`: take the bot's own voice out of the microphone before the VAD
  hears it (gateway/caller/echo.py). Off, a session pays nothing for it.
- `min_interrupt_ms`: how much of the caller's speech a turn needs before it
  interrupts the bot. A shorter turn while the bot speaks ("okay", "mm-hmm")
  does not, and is reported as `speech.backchannel`. At or under the VAD's
  `min_speech_ms`, every turn that starts while the bot speaks interrupts it.
  The VAD counts the turn's speech and says `speech.long` once it has enough.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from ...config import MIN_INTERRUPT_RANGE, Settings
from . import speex
from .caller_audio import CallerAudio
from ..media.clock import SessionClock
from .echo import EchoCanceller, ReferenceTap
from ..media.encode_pool import FIRST, encode_pool
from .endpoint import Endpointer, TurnSettings
from ..errors import GatewayError
from ..media.frames import FRAME_MS
from .stt import SpeechToText, TurnTranscriber
from .vad import VadSettings, VoiceActivityDetector

log = logging.getLogger("voxgate.gateway.sessions.session")

# Microphone chunks waiting for the echo canceller's job: a second of audio. Past it the oldest go.
MAX_MIC_QUEUE = 50


@dataclass
class BargeInSettings:
    echo_cancel: bool = Settings.echo_cancel
    min_interrupt_ms: int = Settings.min_interrupt_ms

    def update(self, data: dict) -> None:
        """Apply a client's `barge_in` object; raises ValueError with a message for the client."""
        unknown = set(data) - {"echo_cancel", "min_interrupt_ms"}
        if unknown:
            raise ValueError(f"barge_in has no field {sorted(unknown)[0]!r}; it takes echo_cancel and min_interrupt_ms")
        if "echo_cancel" in data:
            if not isinstance(data["echo_cancel"], bool):
                raise ValueError("barge_in 'echo_cancel' must be true or false")
        if "min_interrupt_ms" in data:
            value = data["min_interrupt_ms"]
            low, high = MIN_INTERRUPT_RANGE
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not low <= value <= high:
                raise ValueError(f"barge_in 'min_interrupt_ms' must be a number from {low} to {high}")
            self.min_interrupt_ms = int(value)
        if "echo_cancel" in data:
            self.echo_cancel = data["echo_cancel"]

    def describe(self) -> dict:
        return {"echo_cancel": self.echo_cancel, "min_interrupt_ms": self.min_interrupt_ms}


class CallerOptions(Protocol):
    """The settings the caller side reads (the session's `SessionOptions` has them), live: a
    `session.update` changes them in place."""

    vad: VadSettings
    barge_in: BargeInSettings
    turn: TurnSettings


def _hear(echo: EchoCanceller | None, vad: VoiceActivityDetector, items: list[tuple],
          origin: float) -> list[tuple[list[str], int]]:
    """The echo canceller and the VAD over queued caller frames, in order: the VAD's events, with
    the session time (ms) of the end of the frame that brought them.

    Runs as an encode-pool job, on the event loop between frames or on a pool thread; only one
    job per session runs at a time, so the canceller and the VAD need no lock. `origin` is the
    session clock's, so a frame's capture time is on the clock its departures are (perf_counter)."""
    out: list[tuple[list[str], int]] = []
    # At debug level the canceller keeps its last frames, to say why speech started over the bot.
    tracing = echo is not None and log.isEnabledFor(logging.DEBUG)
    for pcm, capture_ms, level_db in items:
        end = origin + (capture_ms + FRAME_MS) / 1000.0
        if pcm is None:
            if echo is not None:
                echo.skip(1, level_db, end, caller_quiet=vad.quiet, floor_db=vad.floor_db)
            events = vad.skip(1, level_db)
        elif echo is None:
            events = vad.process(pcm)
        else:
            events = []
            for frame, guard in echo.process(pcm, end, vad.floor_db):
                heard = vad.frame(frame, guard)
                events.extend(heard)
                echo.learn(caller_quiet=vad.quiet)
                if tracing:
                    echo.trace_frame(frame, guard, vad.voiced)
                    if "speech.started" in heard and guard is not None:
                        echo.started_trace = echo.describe()
        if events:
            out.append((events, int(capture_ms) + FRAME_MS))
    return out


class CallerSide:
    """One session's caller: audio in, turns and transcripts out, and every barge-in decision.

    It is made with what it needs of the rest of the session, as callbacks: `emit` (events out),
    `interrupt` (stop the bot's speech, with a reason), `playing` (the id of the utterance the
    caller hears now, or None), `use_reference` (where the output copies what it plays, for the
    echo canceller; None: nowhere) and `on_activity` (the caller did something: not idle).
    """

    def __init__(
        self,
        session_id: str,
        *,
        options: CallerOptions,
        clock: SessionClock,
        emit: Callable[[dict], None],
        interrupt: Callable[[str], None],
        playing: Callable[[], str | None],
        use_reference: Callable[[ReferenceTap | None], None],
        on_activity: Callable[[], None],
        stt: SpeechToText | None = None,
    ) -> None:
        self.session_id = session_id
        self.options = options
        self.clock = clock
        self.emit = emit
        self._interrupt = interrupt
        self._playing = playing
        self._use_reference = use_reference
        self._on_activity = on_activity
        self._closed = False
        self.output_codec: str | None = None  # the output's codec: what the echo canceller models
        self.vad = VoiceActivityDetector(options.vad)
        self.vad.interrupt_ms = options.barge_in.min_interrupt_ms
        # The caller's audio in 20 ms frames, for the VAD and for backends that take it.
        self.audio = CallerAudio(self._on_frame)
        # The caller's turns as text (gateway/caller/stt.py), where the server has a recognizer (--stt, --stt-url).
        self.transcriber = (TurnTranscriber(stt, emit, lookback_ms=lambda: 2 * options.vad.min_speech_ms)
                            if stt is not None else None)
        # When each of the caller's turns ends, and its partial transcripts (gateway/caller/endpoint.py): with a
        # recognizer that punctuates (Whisper); others' turns are the VAD's, speech.started to speech.stopped.
        self.endpointer = (Endpointer(self.transcriber, options.turn, emit, lambda: self.vad.speaking)
                           if stt is not None and self.transcriber is not None and Endpointer.suits(stt) else None)
        self.vad.pause_ms = options.turn.pause_ms if self.endpointer is not None else 0
        # The echo canceller (gateway/caller/echo.py), while barge_in.echo_cancel is on and an output is attached;
        # microphone audio then waits here for it, and it runs as an encode-pool job (off the frame path).
        self.echo: EchoCanceller | None = None
        self._mic_queue: deque = deque()
        self._listen_job: asyncio.Future | None = None
        self.mic_dropped = 0  # microphone chunks dropped because the canceller fell behind
        # Whether the caller's current turn began while the bot spoke (and which utterance): one that
        # ends before it is long enough to interrupt is a backchannel.
        self._turn_over: str | None = None
        # Whether the caller's speech may interrupt the utterance playing (a relay's `interruptible`, gateway/backends/relay.py).
        self.speech_interrupts = True
        # Whether a key the caller presses interrupts the utterance playing (its id): a relay's `interruptible`.
        # None: keys never interrupt (a backend that wants them to hears call.dtmf and sends cancel).
        self.dtmf_interrupts: Callable[[str], bool] | None = None

    # Settings
    def update(self, msg: dict) -> None:
        """The caller's part of a `session.update` (vad, barge_in, stt, turn); a GatewayError for the client."""
        if isinstance(msg.get("vad"), dict):
            try:
                self.options.vad.update(msg["vad"])
            except (ValueError, TypeError) as exc:
                raise GatewayError("invalid_field", str(exc)) from None
            self._configure_echo()  # with the VAD off, nothing listens: no canceller, no reference tap
        if isinstance(msg.get("barge_in"), dict):
            try:
                self.options.barge_in.update(msg["barge_in"])
            except (ValueError, TypeError) as exc:
                raise GatewayError("invalid_field", str(exc)) from None
            self.vad.interrupt_ms = self.options.barge_in.min_interrupt_ms
            self._configure_echo()
        if isinstance(msg.get("stt"), dict):
            self._update_stt(msg["stt"])
        if isinstance(msg.get("turn"), dict):
            try:
                self.options.turn.update(msg["turn"])
            except (ValueError, TypeError) as exc:
                raise GatewayError("invalid_field", str(exc)) from None
            if self.endpointer is not None:
                self.vad.pause_ms = self.options.turn.pause_ms

    def _update_stt(self, data: dict) -> None:
        if set(data) - {"enabled"} or not isinstance(data.get("enabled", False), bool):
            raise GatewayError("invalid_field", "'stt' takes one field, enabled: true or false")
        if "enabled" in data:
            if self.transcriber is None:
                if data["enabled"]:
                    raise GatewayError("stt_unavailable", "this server recognizes no speech (--stt none); "
                                       "its operator can start it with --stt pocketsphinx or --stt-url")
            else:
                self.transcriber.enabled = data["enabled"]

    def describe(self) -> dict:
        """The caller's settings, as `session.ready` and `session.updated` show them."""
        vad = self.options.vad
        return {
            "vad": {"enabled": vad.enabled, "aggressiveness": vad.aggressiveness, "min_speech_ms": vad.min_speech_ms},
            "barge_in": self.options.barge_in.describe(),
            "stt": {"enabled": self.transcriber is not None and self.transcriber.enabled,
                    "recognizer": self.transcriber.stt.name if self.transcriber is not None else None},
            "turn": self.options.turn.describe(),
        }

    def attach_output(self, codec: str) -> None:
        """An output is attached (its codec: 'opus', 'pcmu', 'pcma', 'none'): its echo may need cancelling."""
        self.output_codec = codec
        self._configure_echo()

    def _configure_echo(self) -> None:
        """Start or stop the echo canceller as barge_in.echo_cancel and the VAD say, where there is audio to cancel."""
        want = (self.options.barge_in.echo_cancel and self.options.vad.enabled
                and self.output_codec in ("opus", "pcmu", "pcma") and not self._closed and speex.available())
        if want and self.echo is None:
            tap = ReferenceTap()
            self.echo = EchoCanceller(self.output_codec or "opus", tap, epoch=self.clock.origin)
            self._use_reference(tap)
        elif not want and self.echo is not None:
            # A job still running keeps its own reference; the canceller goes with it.
            self.echo = None
            self._use_reference(None)

    # Inbound audio (microphone / caller)
    @property
    def listening(self) -> bool:
        """Whether inbound audio is wanted at all: with the VAD off and no backend taking
        the caller's audio, nothing is decoded."""
        return (self.options.vad.enabled or bool(self.audio.taps)) and not self._closed

    @property
    def wants_every_frame(self) -> bool:
        """Whether quiet frames must be decoded too: a backend takes the caller's audio."""
        return bool(self.audio.taps)

    def add_audio_tap(self, name: str, tap: Callable[[bytes], None]) -> None:
        """`tap` receives every frame of the caller's audio from now on (caller_audio.py's messages)."""
        self.audio.taps[name] = tap

    def remove_audio_tap(self, name: str) -> None:
        self.audio.taps.pop(name, None)

    def on_inbound_audio(self, pcm16k: np.ndarray, capture_ms: float) -> None:
        """Decoded caller audio, 16 kHz mono, its first sample captured at `capture_ms` (session ms)."""
        self.audio.audio(pcm16k, capture_ms)

    def on_inbound_gap(self, frames: int, level_db: float | None = None) -> None:
        """Frames the peer did not send (its DTX during silence), or sent quieter than the
        microphone's level gate (`level_db`: their level, for the VAD's noise floor)."""
        self.audio.gap(frames, level_db)

    def _on_frame(self, pcm: np.ndarray | None, capture_ms: float, level_db: float | None) -> None:
        """One 20 ms frame of the caller's audio (None: not decoded, silence for the VAD)."""
        if not self.options.vad.enabled:
            return
        if self.transcriber is not None:
            self.transcriber.frame(pcm, capture_ms)
        if self.endpointer is not None:
            self.endpointer.frame(capture_ms)
        if self.echo is not None and (self._listen_job is not None
                                      or self.echo.needed(pcm, level_db, self.vad.floor_db, time.perf_counter())):
            self._listen((pcm, capture_ms, level_db))
            return
        events = self.vad.process(pcm) if pcm is not None else self.vad.skip(1, level_db)
        if events:
            self.vad_events(events, int(capture_ms) + FRAME_MS)

    def _listen(self, item: tuple) -> None:
        """Caller frames for the echo canceller and the VAD, in order, as one job at a time
        on the encode pool: first in its queue, and never ahead of a frame that is due."""
        if len(self._mic_queue) >= MAX_MIC_QUEUE:
            self._mic_queue.popleft()  # the pool fell this far behind: old audio is worth least
            self.mic_dropped += 1
        self._mic_queue.append(item)
        if self._listen_job is None:
            self._start_listen_job()

    def _start_listen_job(self) -> None:
        items = list(self._mic_queue)
        self._mic_queue.clear()
        self._listen_job = encode_pool.submit(_hear, self.echo, self.vad, items, self.clock.origin, priority=FIRST)
        self._listen_job.add_done_callback(self._heard)

    def _heard(self, job: asyncio.Future) -> None:
        self._listen_job = None
        if job.cancelled() or self._closed:
            return
        error = job.exception()
        if error is not None:
            log.error("session %s: echo cancellation failed; listening without it", self.session_id, exc_info=error,
                      extra={"session_id": self.session_id})
            self.echo = None
            self._use_reference(None)
            self._mic_queue.clear()
            return
        if self.echo is not None and self.echo.started_trace:
            log.debug("session %s: speech started over the bot's echo guard: %s", self.session_id,
                      self.echo.started_trace, extra={"session_id": self.session_id})
            self.echo.started_trace = None
        for events, at_ms in job.result():
            self.vad_events(events, at_ms)
        if self._mic_queue and self.echo is not None:
            self._start_listen_job()

    # Turns and barge-in
    def vad_events(self, events: list[str], at_ms: int) -> None:
        """The VAD's events for a frame that ended at `at_ms`: the caller's turns out, and the
        barge-in decision (interrupt the bot, or a backchannel)."""
        for event in events:
            self._on_activity()
            current = self._playing()
            if event == "speech.long":  # the turn is long enough to interrupt (BargeInSettings.min_interrupt_ms)
                if self._turn_over is not None and current is not None and self.speech_interrupts:
                    self._turn_over = None
                    self._interrupt("barge_in")
                continue
            if self.endpointer is not None:
                self.endpointer.event(event, at_ms)
            if event in ("speech.paused", "speech.resumed"):  # the endpointer's alone, never sent
                continue
            self.emit({"type": event, "at_ms": at_ms})
            if self.endpointer is None and self.transcriber is not None:
                (self.transcriber.started if event == "speech.started" else self.transcriber.stopped)(at_ms)
            if event == "speech.started":
                self._turn_over = current
            elif event == "speech.stopped":
                if self._turn_over is not None:
                    # Too short to interrupt while the bot spoke: "okay", "mm-hmm". The backend still hears of it.
                    self.emit({"type": "speech.backchannel", "id": self._turn_over,
                               "speech_ms": self.vad.turn_voiced_ms, "at_ms": at_ms})
                self._turn_over = None

    def on_dtmf(self, digit: str, call_sid: str | None) -> None:
        """A key the caller pressed on a phone call (signaling/twilio_stream.py): `call.dtmf` out, and
        a barge-in where `dtmf_interrupts` says the utterance playing may be cut short by one."""
        self.emit({"type": "call.dtmf", "digit": digit, "call_sid": call_sid})
        current = self._playing()
        if current is not None and self.dtmf_interrupts is not None and self.dtmf_interrupts(current):
            self._interrupt("barge_in")

    def close(self) -> None:
        """Stop listening: the canceller's job, the recognizer and the endpointer."""
        if self._closed:
            return
        self._closed = True
        if self._listen_job is not None:
            self._listen_job.cancel()
        self._mic_queue.clear()
        self.echo = None
        self._use_reference(None)
        if self.endpointer is not None:
            self.endpointer.close()
        if self.transcriber is not None:
            self.transcriber.close()
