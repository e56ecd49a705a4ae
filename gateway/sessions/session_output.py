"""A session's speech output: the wire codec and its encoder, the Opus signal policy the
listener's loss reports drive (gateway/media/fec.py), the feeder that turns the engine's chunks
into frames (gateway/media/feeder.py) and its supervision, the playout the track or call pulls
frames from (gateway/media/playout.py), and what they report (frames paced, audio started,
words, done, cancel-to-silence) into the session's metrics and events.

`SpeechOutput` knows utterances only as the feeder does (feeder.Speech); it asks the
utterance queue (gateway/sessions/session_queue.py) for the next one to feed, and tells it when one
is done, through the callbacks it is made with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from ..media.clock import SessionClock
from ..caller.echo import ReferenceTap
from ..media.encoder import FrameEncoder, OpusEncoder, OpusSettings, create_encoder
from ..media.fec import SignalPolicy
from ..media.feeder import Feeder, Speech
from ..media.playout import Playout, UtterancePlay
from ..media.session_metrics import SessionMetrics

log = logging.getLogger("voxgate.gateway.sessions.session")


class OutputOptions(Protocol):
    """The settings the output reads (the session's `SessionOptions` has them), live."""

    opus: OpusSettings
    words: bool  # audio.words events


class SpeechOutput:
    """One session's speech out: encoder, feeder and playout, until closed.

    Made with `emit` (events out), `next_utterance` (the queue's next utterance to feed, or
    None), `on_done` (an utterance played to its end: the queue lets it go) and `interrupt`
    (stop everything, with a reason: the audio path failed).
    """

    def __init__(
        self,
        session_id: str,
        *,
        options: OutputOptions,
        clock: SessionClock,
        metrics: SessionMetrics,
        emit: Callable[[dict], None],
        next_utterance: Callable[[], Speech | None],
        on_done: Callable[[UtterancePlay], None],
        interrupt: Callable[[str], None],
    ) -> None:
        self.session_id = session_id
        self.options = options
        self.clock = clock
        self.metrics = metrics
        self.emit = emit
        self._next_utterance = next_utterance
        self._on_finished = on_done
        self._interrupt = interrupt
        self.codec: str | None = None
        self.encoder: FrameEncoder | None = None
        self.playout = Playout(
            b"", on_audio_started=self._on_audio_started, on_done=self._on_done, on_underrun=self._on_underrun
        )
        self.feeder: Feeder | None = None
        self._closed = False
        self._cancelled_at: float | None = None  # when a cancel emptied the playout, until the next frame out
        # Which Opus signal the speech is coded as, from the listener's loss (gateway/media/fec.py).
        # Without FEC, voice would cost more for nothing: auto is then music throughout.
        opus = options.opus
        self.signal_policy = SignalPolicy() if opus.signal == "auto" and opus.fec else None

    def attach(self, codec: str) -> None:
        """Choose the wire codec ('opus', 'pcmu', 'pcma') once the output is known."""
        self.codec = codec
        if codec != "opus":
            self.signal_policy = None  # G.711 or no audio: nothing to switch
        self.encoder = self._new_encoder(codec)
        self.playout.silence = self.encoder.silence()
        # Text queued before anyone could listen: waiting for a listener is not TTFA.
        now = time.perf_counter()
        for play in self.playout.queue:
            play.ready_at = now
        if self.feeder is None:
            self._start_feeder()

    @property
    def has_output(self) -> bool:
        """Whether an output (a WebRTC track, a phone call) is attached: only one may be."""
        return self.encoder is not None

    def wire_rate(self) -> int:
        """The rate the feeder resamples the engine's audio to; before the output is attached, Opus's."""
        return self.encoder.sample_rate if self.encoder is not None else self.options.opus.input_rate

    def playing_id(self) -> str | None:
        """The utterance the listener hears now."""
        current = self.playout.current
        return current.id if current is not None else None

    def use_reference(self, tap: ReferenceTap | None) -> None:
        """Copy every frame played to `tap` (the echo canceller's reference), or to nothing."""
        self.playout.tap = tap

    def _new_encoder(self, codec: str) -> FrameEncoder:
        encoder = create_encoder(codec, self.options.opus)
        if isinstance(encoder, OpusEncoder) and self.signal_policy is not None:
            encoder.use_signal(self.signal_policy.signal)
        return encoder

    def on_loss_report(self, fraction_lost: float) -> None:
        """One RTCP receiver report from the listener (gateway/media/fec.py): with
        --opus-signal auto, in-band FEC goes on while it loses packets."""
        if self.signal_policy is None:
            return
        before = self.signal_policy.signal
        signal = self.signal_policy.report(fraction_lost, time.monotonic())
        if signal != before:
            log.info("session %s: listener lost %.1f %% of packets; Opus signal %s", self.session_id,
                     100 * fraction_lost, signal, extra={"session_id": self.session_id})
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

    def on_frame_paced(self, interval: float, lateness: float) -> None:
        """The output's pacer reports each frame's spacing and lateness."""
        self.metrics.frame_sent(interval, lateness)

    def on_keepalive(self, frames: int) -> None:
        """The output sent a DTX keep-alive covering `frames` frames."""
        self.metrics.keepalive(frames)

    def on_departure(self, now: float) -> None:
        """Called by the output after each frame; measures cancel-to-silence."""
        if self._cancelled_at is not None:
            self.metrics.cancel_to_silence(now - self._cancelled_at)
            self._cancelled_at = None

    # The feeder
    def wake(self) -> None:
        """An utterance was queued, or one left the queue: the feeder looks again."""
        if self.feeder is not None:
            self.feeder.wake()

    def restart(self, cancelled_at: float | None = None) -> None:
        """After a cancel: a fresh encoder and feeder, and cancel-to-silence timed from `cancelled_at`
        (the moment the playout was emptied of audio; None: nothing was playing)."""
        if self.feeder is not None:
            self.feeder.stop()
        if self.has_output and not self._closed:
            # A fresh encoder: the cancelled audio must not colour what comes next.
            self.encoder = self._new_encoder(self.codec or "opus")
            self._start_feeder()
        if cancelled_at is not None:
            self._cancelled_at = cancelled_at

    def _start_feeder(self) -> None:
        assert self.encoder is not None
        self.feeder = Feeder(
            self.encoder, self.playout, next_utterance=self._next_utterance, emit=self.emit, metrics=self.metrics,
            on_words=self._on_words,
        )
        self.feeder.task.add_done_callback(self._feeder_done)

    def _feeder_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the audio path: report it, drop what was queued, keep the session.
        log.error("session %s: feeder failed", self.session_id, exc_info=task.exception(),
                  extra={"session_id": self.session_id})
        self.emit({"type": "error", "code": "internal", "message": "the audio path failed; queued speech was dropped"})
        if not self._closed and self.feeder is not None and task is self.feeder.task:
            self._interrupt("error")

    def close(self) -> None:
        """Nothing more plays: the playout emptied, the feeder stopped."""
        self._closed = True
        self.playout.clear()
        if self.feeder is not None:
            self.feeder.stop()

    # The playout's reports
    def _on_underrun(self) -> None:
        self.metrics.underrun("webrtc" if self.codec == "opus" else "telephony")

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
        self._on_finished(play)
        self.metrics.utterance("done")
        self.emit({"type": "utterance.done", "id": play.id, "audio_ms": play.played_ms, "text": play.full_text()})
