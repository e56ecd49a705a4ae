"""A session's speech output (gateway/session.py's `Session` is made of this and the
utterance queue, gateway/session_queue.py): the wire codec and its encoder, the Opus
signal policy the listener's loss reports drive (gateway/fec.py), the feeder that
turns the engine's chunks into frames (gateway/feeder.py) and its supervision, and
what the output and the playout report (frames paced, audio started, done,
cancel-to-silence) into the session's metrics and events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..engine.client import EngineClient
from .encoder import FrameEncoder, OpusEncoder, create_encoder
from .fec import SignalPolicy
from .feeder import Feeder, listener_lag_s
from .playout import Playout, UtterancePlay
from .session_metrics import SessionMetrics

if TYPE_CHECKING:
    from .clock import SessionClock
    from .session import SessionOptions
    from .session_queue import Utterance

log = logging.getLogger("voxgate.gateway.session")


class SessionOutput:
    """The output half of a `Session` (a mixin: it shares the session's state)."""

    id: str
    engine: EngineClient
    options: "SessionOptions"
    metrics: SessionMetrics
    playout: Playout
    encoder: FrameEncoder | None
    output_codec: str | None
    signal_policy: SignalPolicy | None
    utterances: "list[Utterance]"
    stats: dict
    _feeder: Feeder | None
    _closed: bool
    _pending_cancel_at: float | None

    clock: "SessionClock"

    if TYPE_CHECKING:  # the session's, named for the type checker only: a stub here would shadow them
        def emit(self, event: dict, only: str | None = None) -> None: ...
        def interrupt(self, reason: str) -> None: ...
        def _configure_echo(self) -> None: ...

    def attach_output(self, codec: str) -> None:
        """Choose the wire codec ('opus', 'pcmu', 'pcma') once the output is known."""
        self.output_codec = codec
        if codec != "opus":
            self.signal_policy = None  # G.711 or no audio: nothing to switch
        self.encoder = self._new_encoder(codec)
        self.playout.silence = self.encoder.silence()
        # Text queued before anyone could listen: waiting for a listener is not TTFA.
        now = time.perf_counter()
        for play in self.playout.queue:
            play.ready_at = now
        if self._feeder is None:
            self._start_feeder()
        self._configure_echo()

    def _listener_lag_s(self) -> float:
        """What this session's feeder keeps back from the listener (feeder.listener_lag_s),
        at the engine's rate and the wire's; before the output is attached, Opus's."""
        engine_rate = self.engine.info.get("sample_rate")
        if not isinstance(engine_rate, int) or engine_rate <= 0:
            return 0.0
        wire_rate = self.encoder.sample_rate if self.encoder is not None else self.options.opus.input_rate
        return listener_lag_s(engine_rate, wire_rate)

    def _new_encoder(self, codec: str) -> FrameEncoder:
        encoder = create_encoder(codec, self.options.opus)
        if isinstance(encoder, OpusEncoder) and self.signal_policy is not None:
            encoder.use_signal(self.signal_policy.signal)
        return encoder

    def on_loss_report(self, fraction_lost: float) -> None:
        """One RTCP receiver report from the listener (gateway/fec.py): with
        --opus-signal auto, in-band FEC goes on while it loses packets."""
        if self.signal_policy is None:
            return
        before = self.signal_policy.signal
        signal = self.signal_policy.report(fraction_lost, time.monotonic())
        if signal != before:
            log.info("session %s: listener lost %.1f %% of packets; Opus signal %s", self.id, 100 * fraction_lost,
                     signal, extra={"session_id": self.id})
            self.metrics.opus_signal_switch(signal)
        if isinstance(self.encoder, OpusEncoder):
            self.encoder.use_signal(signal)

    def keep_fec(self) -> None:
        """No loss reports can be watched: in-band FEC throughout (signal voice)."""
        if self.signal_policy is None:
            return  # a fixed --opus-signal stays as set
        self.signal_policy.pin_voice()
        if isinstance(self.encoder, OpusEncoder):
            self.encoder.use_signal("voice")

    @property
    def has_output(self) -> bool:
        """Whether an output (a WebRTC track, a phone call) is attached: only one may be."""
        return self.encoder is not None

    def on_frame_paced(self, interval: float, lateness: float) -> None:
        """The output's pacer reports each frame's spacing and lateness."""
        self.metrics.frame_sent(interval, lateness)

    def on_keepalive(self, frames: int) -> None:
        """The output sent a DTX keep-alive covering `frames` frames."""
        self.metrics.keepalive(frames)

    def on_departure(self, now: float) -> None:
        """Called by the output after each frame; measures cancel-to-silence."""
        if self._pending_cancel_at is not None:
            self.metrics.cancel_to_silence(now - self._pending_cancel_at)
            self._pending_cancel_at = None

    def _restart_feeder(self) -> None:
        if self._feeder is not None:
            self._feeder.stop()
        if self.has_output and not self._closed:
            # A fresh encoder: the cancelled audio must not colour what comes next.
            self.encoder = self._new_encoder(self.output_codec or "opus")
            self._start_feeder()

    def _start_feeder(self) -> None:
        assert self.encoder is not None
        self._feeder = Feeder(
            self.encoder, self.playout, next_utterance=self._next_to_feed, emit=self.emit, metrics=self.metrics,
            on_words=self._on_words,
        )
        self._feeder.task.add_done_callback(self._feeder_done)

    def _next_to_feed(self) -> Utterance | None:
        return next((u for u in self.utterances if not u.play.input_done), None)

    def _feeder_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the audio path: report it, drop what was queued, keep the session.
        log.error("session %s: feeder failed", self.id, exc_info=task.exception(), extra={"session_id": self.id})
        self.emit({"type": "error", "code": "internal", "message": "the audio path failed; queued speech was dropped"})
        if not self._closed and self._feeder is not None and task is self._feeder.task:
            self.interrupt("error")

    def _on_underrun(self) -> None:
        self.metrics.underrun("webrtc" if self.output_codec == "opus" else "telephony")

    def _on_audio_started(self, play: UtterancePlay, at: float) -> None:
        ttfa = max(0.0, at - (play.ready_at or at))
        if play.ready_at is not None and play.first_queued_at is not None:
            self.metrics.ttfa_parts(play.first_queued_at - play.ready_at, at - play.first_queued_at)
        self.metrics.ttfa(ttfa)
        play.started_at_ms = self.clock.at_ms(at)
        self.emit({"type": "audio.started", "id": play.id, "ttfa_ms": round(ttfa * 1000.0, 1), "at_ms": play.started_at_ms})
        if play.words_unsent:
            words, play.words_unsent = play.words_unsent, []
            self._emit_words(play, words)

    def _on_words(self, play: UtterancePlay, words: list) -> None:
        """A chunk's words, in utterance time: reported on the session clock once the
        utterance's first frame has gone out (audio.started says where), before that kept."""
        if not self.options.words:
            return
        if play.started_at_ms is None:
            play.words_unsent.extend(words)
        else:
            self._emit_words(play, words)

    def _emit_words(self, play: UtterancePlay, words: list) -> None:
        base = play.started_at_ms or 0
        self.emit({"type": "audio.words", "id": play.id, "words": [
            {"word": text, "start_ms": round(base + start, 1), "end_ms": round(base + end, 1)} for text, start, end in words]})

    def _on_done(self, play: UtterancePlay) -> None:
        self.utterances = [u for u in self.utterances if u.play is not play]
        self.metrics.utterance("done")
        self.emit({"type": "utterance.done", "id": play.id, "audio_ms": play.played_ms, "text": play.full_text()})
