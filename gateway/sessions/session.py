"""One session per listener: messages in, events out, and the parts that speak and listen.

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
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ...config import Settings
from ...engine.runtime.client import EngineClient
from ..caller.caller_side import BargeInSettings, CallerSide
from ..media.clock import SessionClock
from ..media.encoder import OpusSettings
from ..caller.endpoint import TurnSettings
from ..errors import GatewayError, checked_voice
from .protocol import Limits, RateLimiter, parse
from ..media.session_metrics import SessionMetrics
from .session_output import SpeechOutput
from .session_queue import UtteranceQueue
from ..caller.stt import SpeechToText
from ..caller.vad import VadSettings

log = logging.getLogger(__name__)

Listener = Callable[[dict], None]


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


class Session:
    """One listener's conversation: messages in, events out, speech through one output.

    It is the one place that knows an utterance's whole life (queued, spoken,
    interrupted), so that a cancel or barge-in can stop every part of it at once
    and report what was heard, whatever transport carries the session. It holds
    messages in, events out, settings and closing, and coordinates three parts,
    each with its own public interface: `queue` (the utterances and the interrupt,
    session_queue.py), `output` (codec, feeder, playout: session_output.py) and
    `caller` (the caller's audio, echo, VAD, turns, transcripts and every barge-in
    decision: caller_side.py). Media code talks to the part it feeds: a track to
    `output`, a microphone to `caller`.
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
        # claim them in the session directory (gateway/fleet/directory.py) besides.
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
        self._closed = False
        self.closed_event = asyncio.Event()
        # The output asks the queue (made next, on the output's playout) for what to feed.
        self.output = SpeechOutput(
            self.id, options=self.options, clock=self.clock, metrics=self.metrics, emit=self.emit,
            next_utterance=lambda: self.queue.next_to_feed(), on_done=lambda play: self.queue.done(play),
            interrupt=self.interrupt,
        )
        self.playout = self.output.playout  # one for the session's life: what a track or call pulls frames from
        self.queue = UtteranceQueue(
            engine, options=self.options, playout=self.playout, clock=self.clock, metrics=self.metrics,
            emit=self.emit, wire_rate=self.output.wire_rate, on_queued=self.output.wake,
            on_cancelled=self.output.restart,
        )
        self.caller = CallerSide(
            self.id, options=self.options, clock=self.clock, stt=stt, emit=self.emit, interrupt=self.interrupt,
            playing=self.output.playing_id, use_reference=self.output.use_reference, on_activity=self.touch,
        )
        # In-band DTMF out, while a phone call is the output (gateway/phone/call_link.py); False: too many queued.
        self.send_digits: Callable[[str], bool] | None = None
        self.on_close: list[Callable[["Session"], Awaitable[None] | None]] = []
        self.errors = 0  # messages refused
        self._limiters: dict[str, RateLimiter] = {}

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

    def touch(self) -> None:
        """Something happened (a message taken, the caller's voice): the session is not idle."""
        self.last_activity = time.monotonic()

    def attach_output(self, codec: str) -> None:
        """Choose the wire codec ('opus', 'pcmu', 'pcma', 'none') once the output is known."""
        self.output.attach(codec)
        self.caller.attach_output(codec)

    @property
    def has_output(self) -> bool:
        """Whether an output (a WebRTC track, a phone call) is attached: only one may be."""
        return self.output.has_output

    @property
    def speaking(self) -> bool:
        # Text queued with no output attached does not keep a session alive.
        return bool(self.queue.utterances) and self.output.has_output

    @property
    def stats(self) -> dict:
        return {**self.queue.stats, "errors": self.errors}

    def interrupt(self, reason: str) -> None:
        """Stop every utterance, queued and playing (a cancel, a barge-in, a failure)."""
        self.queue.interrupt(reason)

    def writer_gone(self, source: str) -> None:
        """`source` went away: its open utterances end with it (UtteranceQueue.writer_gone)."""
        self.queue.writer_gone(source)

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
            self.touch()
            self._dispatch(msg, source)
        except GatewayError as exc:
            self.errors += 1
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
            self.queue.speak(source, msg.get("id"), msg["text"], voice=msg.get("voice"))
        elif kind == "text.delta":
            self.queue.append(source, msg.get("id"), msg["text"], voice=msg.get("voice"))
        elif kind == "text.end":
            self.queue.end(source, msg.get("id"))
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
        self.caller.update(msg)  # vad, barge_in, stt, turn
        self.emit({"type": "session.updated", **self.describe_options()})

    def describe_options(self) -> dict:
        return {
            "voice": self.options.voice or self.engine.info.get("voices", [None])[0],
            "rate": self.options.rate,
            "words": self.options.words,
            **self.caller.describe(),
        }

    def ready_event(self) -> dict:
        encoder = self.output.encoder
        return {
            "type": "session.ready",
            "session_id": self.id,
            "voice": self.describe_options()["voice"],
            "voices": self.engine.info.get("voices", []),
            "sample_rate": encoder.clock_rate if encoder else 48000,
            "engine_sample_rate": self.engine.info.get("sample_rate"),
            "codec": self.output.codec,
            "engine": self.engine.info.get("engine"),
            "supported_tags": self.engine.info.get("supported_tags", []),
            "at_ms": self.clock.at_ms(),
        }

    # Lifecycle
    async def close(self, reason: str = "closed", handoff_data: str | None = None) -> None:
        """End the session; `handoff_data` (a relay application's `end`, gateway/backends/relay.py) goes to its listeners in `session.closed`."""
        if self._closed:
            return
        self._closed = True
        self.caller.close()
        self.queue.close()
        self.output.close()
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
