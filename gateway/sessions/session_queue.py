"""A session's utterance queue: text in, per source (the data channel, each backend),
each utterance with its engine stream and its place in the playout; the interrupt
(a cancel, a barge-in) that stops every part of them at once and reports what the
listener heard of each (`played_text`).

`UtteranceQueue` shares the playout with the speech output (gateway/sessions/session_output.py),
which plays what it queues; it reaches the output only through the callbacks it is made
with (the wire's rate, wake the feeder, restart it after a cancel).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ...engine.base import SynthesisOptions
from ...engine.runtime.client import EngineClient
from ...engine.errors import EngineUnavailable
from ...engine.stream import TTSStream
from ..media.clock import SessionClock
from ..errors import GatewayError, checked_voice
from ..media.feeder import listener_lag_s
from ..media.playout import Playout, UtterancePlay
from ..media.session_metrics import SessionMetrics
from .text_pump import TextPump


@dataclass
class Utterance:
    id: str
    stream: TTSStream
    play: UtterancePlay
    source: str
    chars: int = 0
    ended: bool = False
    started_sent: bool = False


class QueueOptions(Protocol):
    """The settings the queue reads (the session's `SessionOptions` has them), live."""

    voice: str | None
    rate: float
    max_utterance_chars: int
    max_queued_utterances: int


class UtteranceQueue:
    """One session's utterances, oldest first: opened, written and ended by their source, fed to the
    engine, played, interrupted.

    Made with `emit` (events out), `wire_rate` (the rate the output plays at, for the engine's
    deadlines), `on_queued` (an utterance was added or dropped: the feeder looks again) and
    `on_cancelled` (everything was cancelled: the output starts afresh, told when the playout
    was emptied of audio, or None).
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        options: QueueOptions,
        playout: Playout,
        clock: SessionClock,
        metrics: SessionMetrics,
        emit: Callable[[dict], None],
        wire_rate: Callable[[], int],
        on_queued: Callable[[], None],
        on_cancelled: Callable[[float | None], None],
    ) -> None:
        self.engine = engine
        self.options = options
        self.playout = playout
        self.clock = clock
        self.metrics = metrics
        self.emit = emit
        self._wire_rate = wire_rate
        self._on_queued = on_queued
        self._on_cancelled = on_cancelled
        self.utterances: list[Utterance] = []
        self.stats = {"utterances": 0, "interrupted": 0}
        # Utterance ids are per source (the data channel, each backend): a source
        # may write only to utterances it opened, so one sender can never
        # append text to another's utterance.
        self._open_by_source: dict[str, str] = {}
        self._interrupted_ids: set[tuple[str, str]] = set()
        # Text waiting to reach the engine streams, in arrival order, a slice per turn of the loop.
        self._text = TextPump()

    # Text in
    def speak(self, source: str, uid: str | None, text: str, voice: str | None = None) -> None:
        """A whole utterance (`speak`)."""
        utt = self._utterance_for(uid, source, streaming=False, voice=voice)
        self._push(utt, text)
        self._end(utt)

    def append(self, source: str, uid: str | None, text: str, voice: str | None = None) -> None:
        """Text for `source`'s open utterance `uid` (`text.delta`; None: its open one, or a new one)."""
        self._push(self._utterance_for(uid, source, streaming=True, voice=voice), text)

    def end(self, source: str, uid: str | None) -> None:
        """`source`'s utterance `uid` has all its text (`text.end`; None: its open one)."""
        uid = uid or self._open_by_source.get(source)
        found = self._find(uid, source)
        if found is None:
            if (source, uid) in self._interrupted_ids:
                return  # ending an interrupted utterance is fine and does nothing
            raise GatewayError("unknown_utterance", f"no open utterance {uid!r} to end", id=uid)
        self._end(found)

    def add_audio(self, source: str, uid: str, stream: TTSStream) -> UtterancePlay:
        """Audio that is not synthesized (a relay's `play`: gateway/backends/relay_play.py) as `source`'s
        utterance `uid`, last in the queue and already ended; `stream` yields its chunks as an engine
        stream would. GatewayError `queue_full` past --max-queued-utterances."""
        if len(self.utterances) >= self.options.max_queued_utterances:
            raise GatewayError("queue_full", f"{len(self.utterances)} utterances are queued; the limit is "
                               f"{self.options.max_queued_utterances}", id=uid)
        play = UtterancePlay(id=uid)  # no ready_at: a fetch is not synthesis, and TTFA leaves it out
        self.utterances.append(Utterance(id=uid, stream=stream, play=play, source=source, ended=True))
        self.playout.add(play)
        self.stats["utterances"] += 1
        self.emit({"type": "utterance.queued", "id": uid, "position": len(self.utterances) - 1})
        self._on_queued()
        return play

    def _find(self, uid: str | None, source: str) -> Utterance | None:
        """This source's utterance `uid`; another source's is refused, never written to."""
        for utt in self.utterances:
            if utt.id == uid:
                if utt.source != source:
                    raise GatewayError("id_in_use", f"utterance {uid!r} belongs to another sender; use an id of your own", id=uid)
                return utt
        return None

    def _utterance_for(self, uid: str | None, source: str, streaming: bool, voice: str | None = None) -> Utterance:
        if uid is None and streaming:
            uid = self._open_by_source.get(source)
        if uid is not None:
            utt = self._find(uid, source)
            if utt is not None:
                if utt.ended:
                    raise GatewayError("utterance_ended", f"utterance {uid!r} has already ended; use a new id", id=uid)
                if voice is not None:
                    # Refused, not ignored: one utterance speaks in one voice.
                    raise GatewayError("invalid_field", f"utterance {uid!r} has started; 'voice' is chosen by the "
                                       "message that starts an utterance", id=uid)
                return utt
            if (source, uid) in self._interrupted_ids:
                raise GatewayError("utterance_interrupted", f"utterance {uid!r} was interrupted; its text is not spoken", id=uid)
        if len(self.utterances) >= self.options.max_queued_utterances:
            raise GatewayError("queue_full", f"{len(self.utterances)} utterances are queued; the limit is "
                f"{self.options.max_queued_utterances}. Wait for utterance.done or send cancel.", id=uid)
        # With no output attached yet (a session made ahead through the session
        # API), text is accepted and queued; the feeder starts on attach_output.
        if uid is None:
            uid = "u-" + secrets.token_hex(8)  # unguessable: nobody can aim at an id before it exists
        try:
            chosen = self.options.voice if voice is None else checked_voice(self.engine, voice)
        except GatewayError as exc:
            exc.id = uid
            raise
        try:
            # When the listener needs it: after the audio encoded ahead of it, and after the
            # utterance before it (still synthesizing, its length unknown); engine/runtime/worker.py.
            stream = self.engine.stream(
                SynthesisOptions(voice=chosen, rate=self.options.rate),
                start_in_s=self.playout.buffered_ms / 1000.0, held_s=self._listener_lag_s(),
                after=self.utterances[-1].stream if self.utterances else None,
            )
        except EngineUnavailable as exc:
            raise GatewayError("engine_unavailable", str(exc), id=uid) from None
        play = UtterancePlay(id=uid, ready_at=time.perf_counter())
        utt = Utterance(id=uid, stream=stream, play=play, source=source)
        self.utterances.append(utt)
        self.playout.add(play)
        if streaming:
            self._open_by_source[source] = uid
        self.stats["utterances"] += 1
        self.emit({"type": "utterance.queued", "id": uid, "position": len(self.utterances) - 1})
        self._on_queued()
        return utt

    def _listener_lag_s(self) -> float:
        """What the output's feeder keeps back from the listener (feeder.listener_lag_s), at the
        engine's rate and the wire's."""
        engine_rate = self.engine.info.get("sample_rate")
        if not isinstance(engine_rate, int) or engine_rate <= 0:
            return 0.0
        return listener_lag_s(engine_rate, self._wire_rate())

    def _push(self, utt: Utterance, text: str) -> None:
        if utt.chars + len(text) > self.options.max_utterance_chars:
            raise GatewayError("utterance_too_long", f"utterance {utt.id!r} would exceed {self.options.max_utterance_chars} characters; end it and start another", id=utt.id)
        utt.chars += len(text)
        self._text.push(utt.stream, text)

    def _end(self, utt: Utterance) -> None:
        if utt.ended:
            return
        utt.ended = True
        if self._open_by_source.get(utt.source) == utt.id:
            del self._open_by_source[utt.source]
        self._text.push(utt.stream, None)

    def writer_gone(self, source: str) -> None:
        """`source` (a backend WebSocket, the data channel) went away: its open utterances end
        with it. One the listener has begun to hear is finished with the text it has; one
        nothing of was heard is dropped. Either way what is queued behind it plays, and the
        session says which (docs/protocol.md, "When a writer goes away")."""
        for utt in [u for u in self.utterances if u.source == source and not u.ended]:
            if utt.play.started:
                self._end(utt)
                self.emit({"type": "utterance.ended", "id": utt.id, "reason": "writer_gone"})
            else:
                self._drop(utt, "writer_gone")
        self._open_by_source.pop(source, None)

    def _drop(self, utt: Utterance, reason: str) -> None:
        """One utterance that nothing of was heard, out of the queue; the others stay."""
        self.utterances.remove(utt)
        self.playout.drop(utt.play)
        utt.ended = True
        utt.stream.cancel()  # the feeder, if it was on this one, moves to the next
        self._interrupted_ids.add((utt.source, utt.id))
        self.stats["interrupted"] += 1
        self.metrics.utterance("interrupted")
        self.emit({"type": "utterance.interrupted", "id": utt.id, "reason": reason, "played_ms": 0,
                   "played_text": "", "at_ms": self.clock.at_ms()})
        self._on_queued()

    # The output's side
    def next_to_feed(self) -> Utterance | None:
        """The oldest utterance whose audio the feeder has not finished."""
        return next((u for u in self.utterances if not u.play.input_done), None)

    def done(self, play: UtterancePlay) -> None:
        """An utterance played to its end: it leaves the queue."""
        self.utterances = [u for u in self.utterances if u.play is not play]

    # Barge-in and cancel
    def interrupt(self, reason: str) -> None:
        """Stop everything queued and playing (`reason`: cancel, barge_in, error), and say what was heard of each."""
        t0 = time.perf_counter()
        self.metrics.interrupted(reason, t0)
        dropped = self.playout.clear()
        utterances, self.utterances = self.utterances, []
        self._open_by_source.clear()
        self._text.clear()
        # Newest first: the engine never sees a queued stream whose predecessor is
        # cancelled while it is still open (it would rank as a listener waiting now).
        for utt in reversed(utterances):
            utt.stream.cancel()
            self._interrupted_ids.add((utt.source, utt.id))
        if len(self._interrupted_ids) > 1000:
            self._interrupted_ids = set(list(self._interrupted_ids)[-500:])
        self._on_cancelled(t0 if dropped else None)
        for play in dropped:
            self.stats["interrupted"] += 1
            self.metrics.utterance("interrupted")
            self.emit(
                {
                    "type": "utterance.interrupted",
                    "id": play.id,
                    "reason": reason,
                    "played_ms": play.played_ms,
                    "played_text": play.played_text(),
                    "at_ms": self.clock.at_ms(t0),
                }
            )

    def close(self) -> None:
        """The session closes: every engine stream cancelled, nothing reported."""
        self._text.clear()
        for utt in reversed(self.utterances):  # newest first, as in interrupt()
            utt.stream.cancel()
        self.utterances = []
