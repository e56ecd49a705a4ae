"""A session's utterance queue (gateway/session.py's `Session` is made of this and its
output, gateway/session_output.py): utterances opened, written and ended per source
(the data channel, each backend), each with its engine stream and its place in the
playout; and the interrupt (a cancel, a barge-in) that stops every part of them at once.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.base import SynthesisOptions
from ..engine.client import EngineClient
from ..engine.errors import EngineUnavailable
from ..engine.stream import TTSStream
from .errors import GatewayError, checked_voice
from .feeder import Feeder
from .playout import Playout, UtterancePlay
from .session_metrics import SessionMetrics
from .text_pump import TextPump

if TYPE_CHECKING:
    from .clock import SessionClock
    from .session import SessionOptions


@dataclass
class Utterance:
    id: str
    stream: TTSStream
    play: UtterancePlay
    source: str
    chars: int = 0
    ended: bool = False
    started_sent: bool = False


class UtteranceQueue:
    """The utterance half of a `Session` (a mixin: it shares the session's state)."""

    engine: EngineClient
    options: "SessionOptions"
    metrics: SessionMetrics
    playout: Playout
    clock: "SessionClock"
    utterances: list[Utterance]
    stats: dict
    _open_by_source: dict[str, str]
    _interrupted_ids: set[tuple[str, str]]
    _text: TextPump
    _feeder: Feeder | None
    _pending_cancel_at: float | None

    if TYPE_CHECKING:  # the session's and its output's, named for the type checker only
        def emit(self, event: dict, only: str | None = None) -> None: ...
        def _listener_lag_s(self) -> float: ...
        def _restart_feeder(self) -> None: ...

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
            # utterance before it (still synthesizing, its length unknown); engine/worker.py.
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
        if self._feeder is not None:
            self._feeder.wake()
        return utt

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
        if self._feeder is not None:
            self._feeder.wake()

    # Barge-in and cancel
    def interrupt(self, reason: str) -> None:
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
        self._restart_feeder()
        if dropped:
            self._pending_cancel_at = t0
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
