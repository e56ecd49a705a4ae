"""One session per listener: the utterance queue, speech output, barge-in.

A session is independent of transport. Messages arrive from the WebRTC data
channel or a backend WebSocket and go through `handle_message`; events go
out to every attached listener. Speech goes out through one output (a WebRTC
track, or a telephony stream) which pulls 20 ms frames from `playout`.

Per utterance: text -> TTSStream (segmenter + engine worker) -> feeder
(resample, frame, encode in a thread) -> Playout -> track. A cancel or
barge-in empties the playout at once, cancels every engine stream, and
reports how much of the current utterance was heard.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from ..config import Settings
from ..engine.client import EngineClient
from .caller_audio import CallerAudio
from .clock import SessionClock
from . import speex
from .barge_in import BargeInSettings
from .echo import EchoCanceller, ReferenceTap
from .encode_pool import FIRST, encode_pool
from .encoder import FrameEncoder, OpusSettings
from .fec import SignalPolicy
from .feeder import Feeder
from .frames import FRAME_MS
from .playout import Playout
from .errors import GatewayError, checked_voice
from .protocol import Limits, RateLimiter, parse
from .session_metrics import SessionMetrics
from .session_output import SessionOutput
from .session_queue import Utterance, UtteranceQueue
from .endpoint import Endpointer, TurnSettings
from .stt import SpeechToText, TurnTranscriber
from .text_pump import TextPump
from .vad import VadSettings, VoiceActivityDetector

log = logging.getLogger(__name__)

Listener = Callable[[dict], None]
# Microphone chunks waiting for the echo canceller's job: a second of audio. Past it the oldest go.
MAX_MIC_QUEUE = 50


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


@dataclass(kw_only=True)
class SessionOptions:
    """A session's settings; the defaults are the flags' (voxgate/config.py)."""

    voice: str | None = Settings.voice  # None: the engine's own
    rate: float = 1.0
    vad: VadSettings = field(default_factory=VadSettings)
    barge_in: BargeInSettings = field(default_factory=BargeInSettings)
    turn: TurnSettings = field(default_factory=TurnSettings)
    opus: OpusSettings = field(default_factory=OpusSettings)
    limits: Limits = field(default_factory=Limits)
    max_utterance_chars: int = Settings.max_utterance_chars
    max_queued_utterances: int = Settings.max_queued_utterances
    words: bool = True  # audio.words events (session.update {"words": false} turns them off)


class Session(SessionOutput, UtteranceQueue):
    """One listener's conversation: messages in, events out, speech through one output.

    It is the one place that knows an utterance's whole life (queued, spoken,
    interrupted), so that a cancel or barge-in can stop every part of it at once
    and report what was heard, whatever transport carries the session. By concern:
    this module holds messages in, events out, settings, the caller's audio (VAD,
    echo, barge-in) and closing; the utterance queue and the interrupt are
    `UtteranceQueue` (session_queue.py), the codec, FEC policy, feeder and playout
    reports `SessionOutput` (session_output.py).
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        options: SessionOptions | None = None,
        session_id: str | None = None,
        metrics: SessionMetrics | None = None,
        stt: SpeechToText | None = None,
    ) -> None:
        # 128 random bits: ids stay unique across a fleet of gateways, which
        # claim them in the session directory (gateway/directory.py) besides.
        self.id = session_id or secrets.token_hex(16)
        self.engine = engine
        self.options = options or SessionOptions()
        self.metrics = metrics or SessionMetrics()
        self.created_at = time.monotonic()
        # What every `at_ms`, capture time and transcript span is measured on (clock.py).
        self.clock = SessionClock()
        self.last_activity = self.created_at
        self.listeners: dict[str, Listener] = {}
        self.writer: str | None = None  # the one backend allowed to write, besides the peer
        self.utterances: list[Utterance] = []
        # Utterance ids are per source (the data channel, each backend): a source
        # may write only to utterances it opened, so one sender can never
        # append text to another's utterance.
        self._open_by_source: dict[str, str] = {}
        self._interrupted_ids: set[tuple[str, str]] = set()
        # Text waiting to reach the engine streams, in arrival order, a slice per turn of the loop.
        self._text = TextPump()
        self.encoder: FrameEncoder | None = None
        self.output_codec: str | None = None
        self.playout = Playout(
            b"", on_audio_started=self._on_audio_started, on_done=self._on_done, on_underrun=self._on_underrun
        )
        self._feeder: Feeder | None = None
        self._closed = False
        self.closed_event = asyncio.Event()
        self.vad = VoiceActivityDetector(self.options.vad)
        # The caller's audio in 20 ms frames, for the VAD and for backends that take it.
        self.caller = CallerAudio(self._on_caller_frame)
        self.vad.interrupt_ms = self.options.barge_in.min_interrupt_ms
        # The caller's turns as text (gateway/stt.py), where the server has a recognizer (--stt, --stt-url).
        self.transcriber = (TurnTranscriber(stt, self.emit, lookback_ms=lambda: 2 * self.options.vad.min_speech_ms)
                            if stt is not None else None)
        # When each of the caller's turns ends, and its partial transcripts (gateway/endpoint.py): with a
        # recognizer that punctuates (Whisper); others' turns are the VAD's, speech.started to speech.stopped.
        self.endpointer = (Endpointer(self.transcriber, self.options.turn, self.emit, lambda: self.vad.speaking)
                           if stt is not None and self.transcriber is not None and Endpointer.suits(stt) else None)
        self.vad.pause_ms = self.options.turn.pause_ms if self.endpointer is not None else 0
        # The echo canceller (gateway/echo.py), while barge_in.echo_cancel is on and an output is attached;
        # microphone audio then waits here for it, and it runs as an encode-pool job (off the frame path).
        self.echo: EchoCanceller | None = None
        self._mic_queue: deque = deque()
        self._listen_job: asyncio.Future | None = None
        self.mic_dropped = 0  # microphone chunks dropped because the canceller fell behind
        # Whether the caller's current turn began while the bot spoke (and which utterance): one that
        # ends before it is long enough to interrupt is a backchannel.
        self._turn_over: str | None = None
        # Whether the caller's speech may interrupt the utterance playing (a relay's `interruptible`, gateway/relay.py).
        self.speech_interrupts = True
        # In-band DTMF out, while a phone call is the output (gateway/call_link.py); False: too many queued.
        self.send_digits: Callable[[str], bool] | None = None
        self.on_close: list[Callable[["Session"], Awaitable[None] | None]] = []
        self.stats = {"utterances": 0, "interrupted": 0, "errors": 0}
        self._pending_cancel_at: float | None = None
        self._limiters: dict[str, RateLimiter] = {}
        # Which Opus signal the speech is coded as, from the listener's loss (gateway/fec.py).
        # Without FEC, voice would cost more for nothing: auto is then music throughout.
        opus = self.options.opus
        self.signal_policy = SignalPolicy() if opus.signal == "auto" and opus.fec else None

    # Listeners and output
    def add_listener(self, name: str, listener: Listener) -> None:
        self.listeners[name] = listener

    def remove_listener(self, name: str) -> None:
        self.listeners.pop(name, None)

    def emit(self, event: dict, only: str | None = None) -> None:
        if event.get("type") == "error":
            self.metrics.error(str(event.get("code")))  # codes are the gateway's own constants: bounded labels
        targets = [self.listeners[only]] if only and only in self.listeners else list(self.listeners.values())
        for listener in targets:
            try:
                listener(event)
            except Exception:
                log.exception("session %s: listener failed", self.id, extra={"session_id": self.id})

    def _configure_echo(self) -> None:
        """Start or stop the echo canceller as barge_in.echo_cancel and the VAD say, where there is audio to cancel."""
        want = (self.options.barge_in.echo_cancel and self.options.vad.enabled
                and self.output_codec in ("opus", "pcmu", "pcma") and not self._closed and speex.available())
        if want and self.echo is None:
            tap = ReferenceTap()
            self.echo = EchoCanceller(self.output_codec or "opus", tap, epoch=self.clock.origin)
            self.playout.tap = tap
        elif not want and self.echo is not None:
            # A job still running keeps its own reference; the canceller goes with it.
            self.echo = None
            self.playout.tap = None

    @property
    def speaking(self) -> bool:
        # Text queued with no output attached does not keep a session alive.
        return bool(self.utterances) and self.has_output

    # Inbound messages
    def handle_message(self, raw: str | bytes, source: str = "peer") -> None:
        try:
            limiter = self._limiters.get(source)
            if limiter is None:
                limiter = self._limiters[source] = RateLimiter(self.options.limits.max_messages_per_s)
            if not limiter.allow():
                raise GatewayError("rate_limited", f"more than {self.options.limits.max_messages_per_s:g} messages per second; this one was refused")
            msg = parse(raw, self.options.limits)
            # Only a message taken counts as activity: refused ones (over the rate, malformed)
            # must not keep a session alive past its idle timeout.
            self.last_activity = time.monotonic()
            self._dispatch(msg, source)
        except GatewayError as exc:
            self.stats["errors"] += 1
            self.emit(exc.event(), only=source)
        except Exception as exc:  # a bug must cost one message, not the session
            log.exception("session %s: message failed", self.id, extra={"session_id": self.id})
            self.emit({"type": "error", "code": "internal", "message": f"internal error: {type(exc).__name__}"}, only=source)

    def _dispatch(self, msg: dict, source: str) -> None:
        kind = msg["type"]
        if source != "peer" and self.writer is not None and source != self.writer and kind != "ping":
            raise GatewayError("read_only", "another backend holds this session's write access; this one may only watch")
        if kind == "ping":
            self.emit({"type": "pong", "t": msg.get("t")}, only=source)
        elif kind == "speak":
            utt = self._utterance_for(msg.get("id"), source, streaming=False, voice=msg.get("voice"))
            self._push(utt, msg["text"])
            self._end(utt)
        elif kind == "text.delta":
            utt = self._utterance_for(msg.get("id"), source, streaming=True, voice=msg.get("voice"))
            self._push(utt, msg["text"])
        elif kind == "text.end":
            uid = msg.get("id") or self._open_by_source.get(source)
            found = self._find(uid, source)
            if found is None:
                if (source, uid) in self._interrupted_ids:
                    return  # ending an interrupted utterance is fine and does nothing
                raise GatewayError("unknown_utterance", f"no open utterance {uid!r} to end", id=uid)
            self._end(found)
        elif kind == "cancel":
            self.interrupt("cancel")
        elif kind == "session.update":
            self._update(msg)

    def _update(self, msg: dict) -> None:
        if "voice" in msg and msg["voice"] is not None:
            self.options.voice = checked_voice(self.engine, msg["voice"])
        if "rate" in msg:
            self.options.rate = float(msg["rate"])
        if "words" in msg:
            self.options.words = msg["words"]
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
        self.emit({"type": "session.updated", **self.describe_options()})

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

    def describe_options(self) -> dict:
        vad = self.options.vad
        return {
            "voice": self.options.voice or self.engine.info.get("voices", [None])[0],
            "rate": self.options.rate,
            "words": self.options.words,
            "vad": {"enabled": vad.enabled, "aggressiveness": vad.aggressiveness, "min_speech_ms": vad.min_speech_ms},
            "barge_in": self.options.barge_in.describe(),
            "stt": {"enabled": self.transcriber is not None and self.transcriber.enabled,
                    "recognizer": self.transcriber.stt.name if self.transcriber is not None else None},
            "turn": self.options.turn.describe(),
        }

    def ready_event(self) -> dict:
        return {
            "type": "session.ready",
            "session_id": self.id,
            "voice": self.describe_options()["voice"],
            "voices": self.engine.info.get("voices", []),
            "sample_rate": self.encoder.clock_rate if self.encoder else 48000,
            "engine_sample_rate": self.engine.info.get("sample_rate"),
            "codec": self.output_codec,
            "engine": self.engine.info.get("engine"),
            "supported_tags": self.engine.info.get("supported_tags", []),
            "at_ms": self.clock.at_ms(),
        }

    # Inbound audio (microphone / caller)
    @property
    def listening(self) -> bool:
        """Whether inbound audio is wanted at all: with the VAD off and no backend taking
        the caller's audio, nothing is decoded."""
        return (self.options.vad.enabled or bool(self.caller.taps)) and not self._closed

    @property
    def wants_every_frame(self) -> bool:
        """Whether quiet frames must be decoded too: a backend takes the caller's audio."""
        return bool(self.caller.taps)

    def add_audio_tap(self, name: str, tap: Callable[[bytes], None]) -> None:
        """`tap` receives every frame of the caller's audio from now on (caller_audio.py's messages)."""
        self.caller.taps[name] = tap

    def remove_audio_tap(self, name: str) -> None:
        self.caller.taps.pop(name, None)

    def on_inbound_audio(self, pcm16k: np.ndarray, capture_ms: float) -> None:
        """Decoded caller audio, 16 kHz mono, its first sample captured at `capture_ms` (session ms)."""
        self.caller.audio(pcm16k, capture_ms)

    def on_inbound_gap(self, frames: int, level_db: float | None = None) -> None:
        """Frames the peer did not send (its DTX during silence), or sent quieter than the
        microphone's level gate (`level_db`: their level, for the VAD's noise floor)."""
        self.caller.gap(frames, level_db)

    def _on_caller_frame(self, pcm: np.ndarray | None, capture_ms: float, level_db: float | None) -> None:
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
            self._vad_events(events, int(capture_ms) + FRAME_MS)

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
            log.error("session %s: echo cancellation failed; listening without it", self.id, exc_info=error,
                      extra={"session_id": self.id})
            self.echo = None
            self.playout.tap = None
            self._mic_queue.clear()
            return
        if self.echo is not None and self.echo.started_trace:
            log.debug("session %s: speech started over the bot's echo guard: %s", self.id, self.echo.started_trace,
                      extra={"session_id": self.id})
            self.echo.started_trace = None
        for events, at_ms in job.result():
            self._vad_events(events, at_ms)
        if self._mic_queue and self.echo is not None:
            self._start_listen_job()

    def _vad_events(self, events: list[str], at_ms: int) -> None:
        for event in events:
            self.last_activity = time.monotonic()
            current = self.playout.current
            if event == "speech.long":  # the turn is long enough to interrupt (gateway/barge_in.py)
                if self._turn_over is not None and current is not None and self.speech_interrupts:
                    self._turn_over = None
                    self.interrupt("barge_in")
                continue
            if self.endpointer is not None:
                self.endpointer.event(event, at_ms)
            if event in ("speech.paused", "speech.resumed"):  # the endpointer's alone, never sent
                continue
            self.emit({"type": event, "at_ms": at_ms})
            if self.endpointer is None and self.transcriber is not None:
                (self.transcriber.started if event == "speech.started" else self.transcriber.stopped)(at_ms)
            if event == "speech.started":
                self._turn_over = current.id if current is not None else None
            elif event == "speech.stopped":
                if self._turn_over is not None:
                    # Too short to interrupt while the bot spoke: "okay", "mm-hmm". The backend still hears of it.
                    self.emit({"type": "speech.backchannel", "id": self._turn_over,
                               "speech_ms": self.vad.turn_voiced_ms, "at_ms": at_ms})
                self._turn_over = None

    # Lifecycle
    async def close(self, reason: str = "closed", handoff_data: str | None = None) -> None:
        """End the session; `handoff_data` (a relay application's `end`, gateway/relay.py) goes to its listeners in `session.closed`."""
        if self._closed:
            return
        self._closed = True
        if self._listen_job is not None:
            self._listen_job.cancel()
        self._mic_queue.clear()
        self.echo = None
        self.playout.tap = None
        if self.endpointer is not None:
            self.endpointer.close()
        if self.transcriber is not None:
            self.transcriber.close()
        self._text.clear()
        for utt in reversed(self.utterances):  # newest first, as in interrupt()
            utt.stream.cancel()
        self.utterances = []
        self.playout.clear()
        if self._feeder is not None:
            self._feeder.stop()
        closed: dict = {"type": "session.closed", "reason": reason}
        if handoff_data is not None:
            closed["handoff_data"] = handoff_data
        self.emit(closed)
        for callback in self.on_close:
            try:
                result = callback(self)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("session %s: close callback failed", self.id, extra={"session_id": self.id})
        self.closed_event.set()

    @property
    def closed(self) -> bool:
        return self._closed
