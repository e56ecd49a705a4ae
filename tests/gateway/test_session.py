"""Session (gateway/sessions/session.py): who may write what, text to the engine, audio out, cancel and close.

The engine is faked here, on purpose: these tests check the Session's own
rules (ownership of utterance ids, the writer, the queue limit, text reaching
the engine in slices and in order, what a cancel reports), which needs to hold
an engine stream open, see exactly what text reached it, and decide when its
audio arrives. The real worker process would add a process start per test and
its own timing, and would hide which of the two broke. The real engine path is
covered end to end with the tone and Piper workers in tests/gateway/test_speech.py,
tests/gateway/test_barge_in.py and tests/fuzz/test_fuzz_protocol.py. The rest is
real: the feeder, the encode pool, libopus and the playout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import pytest

from voxgate.gateway.sessions.protocol import Limits
from voxgate.gateway.caller.caller_side import BargeInSettings
from voxgate.gateway.sessions.session import Session, SessionOptions
from voxgate.gateway.media.session_metrics import SessionMetrics
from voxgate.gateway.sessions.text_pump import TEXT_SLICE_CHARS

RATE = 22050


@dataclass
class Word:
    text: str
    start: float
    end: float


@dataclass
class Chunk:
    """What the feeder reads from an engine chunk."""

    pcm: np.ndarray
    words: list[Word]
    sample_rate: int = RATE
    unit_sent_at: float = 0.0
    synth_s: float = 0.0

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate


class FakeStream:
    """An engine stream whose audio the test hands over with `say`, and which records its text."""

    def __init__(self, start_in_s: float = 0.0, held_s: float = 0.0, after: "FakeStream | None" = None) -> None:
        self.start_in_s = start_in_s  # the deadline hints the session gave the engine
        self.held_s = held_s
        self.after = after
        self.texts: list[str] = []
        self.ended = False
        self.cancelled = False
        self.first_text_at: float | None = None
        self._chunks: asyncio.Queue = asyncio.Queue()

    def push_text(self, text: str) -> None:
        if self.cancelled:
            raise RuntimeError("stream cancelled")
        self.first_text_at = self.first_text_at or time.perf_counter()
        self.texts.append(text)

    def end_input(self) -> None:
        self.ended = True

    def cancel(self) -> None:
        self.cancelled = True
        self._chunks.put_nowait(None)

    def say(self, words: list[str], seconds_per_word: float = 0.2) -> None:
        """One chunk: a tone per word, each word timed over its own stretch."""
        n = int(RATE * seconds_per_word)
        t = np.arange(n * len(words)) / RATE
        pcm = (np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16)
        timed = [Word(w, i * seconds_per_word, (i + 1) * seconds_per_word) for i, w in enumerate(words)]
        self._chunks.put_nowait(Chunk(pcm, timed))

    def finish(self) -> None:
        self._chunks.put_nowait(None)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Chunk:
        chunk = await self._chunks.get()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class FakeEngine:
    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.info = {"engine": "fake", "voices": ["joe"], "sample_rate": RATE}

    def stream(self, options, start_in_s: float = 0.0, held_s: float = 0.0, after=None) -> FakeStream:
        stream = FakeStream(start_in_s, held_s, after)
        self.streams.append(stream)
        return stream

    def check_voice(self, name: str) -> str:
        return name


class Samples(SessionMetrics):
    def __init__(self) -> None:
        self.ttfa_s: list[float] = []
        self.parts: list[tuple[float, float]] = []
        self.interrupts: list[tuple[str, float]] = []

    def ttfa(self, seconds: float) -> None:
        self.ttfa_s.append(seconds)

    def ttfa_parts(self, to_first_frames: float, to_departure: float) -> None:
        self.parts.append((to_first_frames, to_departure))

    def interrupted(self, reason: str, at: float) -> None:
        self.interrupts.append((reason, at))


class Events(list):
    def __call__(self, event: dict) -> None:
        self.append(event)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self if e["type"] == kind]

    def codes(self) -> list[str]:
        return [e["code"] for e in self.of("error")]


def make(**options) -> tuple[Session, FakeEngine, Events, Samples]:
    engine, events, samples = FakeEngine(), Events(), Samples()
    session = Session(engine=engine, options=SessionOptions(**options), metrics=samples)
    session.add_listener("peer", events)
    return session, engine, events, samples


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def play_until(session: Session, events: Events, kind: str, limit: int = 2000) -> list[bytes]:
    """Take frames as the track would (without its 20 ms clock) until an event of `kind` is out."""
    frames = []
    for _ in range(limit):
        if events.of(kind):
            return frames
        frames.append(session.playout.next_frame())
        await asyncio.sleep(0.001)  # lets the encode pool's results come back
    raise AssertionError(f"no {kind} after {limit} frames: {events}")


async def test_text_waits_for_an_output_then_plays_with_ttfa_and_its_parts():
    session, engine, events, samples = make()
    session.handle_message('{"type": "speak", "text": "one two", "id": "a"}')
    await turns()
    assert engine.streams[0].texts == ["one two"] and engine.streams[0].ended
    assert not session.speaking  # queued, but nobody can listen yet
    session.attach_output("opus")
    assert session.speaking
    engine.streams[0].say(["one", "two"])
    engine.streams[0].finish()
    await play_until(session, events, "utterance.done")
    kinds = [e["type"] for e in events]
    assert kinds.index("utterance.queued") < kinds.index("audio.started") < kinds.index("utterance.done")
    done = events.of("utterance.done")[0]
    assert done["text"] == "one two" and done["audio_ms"] >= 400
    # The benchmark's seam: TTFA split at the first encoded frames, the parts adding up to it.
    assert len(samples.ttfa_s) == 1 and len(samples.parts) == 1
    first, rest = samples.parts[0]
    assert first >= 0 and rest >= 0 and first + rest == pytest.approx(samples.ttfa_s[0], abs=1e-6)
    assert not session.queue.utterances


async def test_the_engine_hears_when_each_utterance_is_needed_and_what_the_feeder_holds_back():
    """The worker orders steps by playout deadline (engine/runtime/worker.py): an
    utterance queued behind another is needed once that one's audio has played
    (and no sooner than the audio already encoded ahead of it), and every
    deadline comes earlier by what the resampler and the framer keep from the
    listener."""
    from voxgate.gateway.media.feeder import listener_lag_s

    session, engine, events, _ = make()
    session.attach_output("opus")
    session.handle_message('{"type": "speak", "text": "one two three", "id": "a"}')
    await turns()
    first = engine.streams[0]
    assert first.start_in_s == 0.0 and first.after is None  # nothing ahead of it: its listener waits now
    lag = listener_lag_s(RATE, session.output.encoder.sample_rate)
    assert first.held_s == pytest.approx(lag) and 0.01 < lag < 0.1
    first.say(["one", "two", "three"])  # 0.6 s
    for _ in range(200):
        if session.playout.buffered_ms >= 500:
            break
        await asyncio.sleep(0.005)  # the encode pool's results come back on the loop
    ahead_ms = session.playout.buffered_ms
    assert ahead_ms >= 500
    session.handle_message('{"type": "speak", "text": "four", "id": "b"}')
    await turns()
    second = engine.streams[1]
    assert second.after is first and second.start_in_s == pytest.approx(ahead_ms / 1000.0)
    assert second.held_s == pytest.approx(lag)
    before_play = session.playout.buffered_ms  # a slice may have landed meanwhile
    session.playout.next_frame()  # one frame played: the next utterance is needed 20 ms sooner
    session.handle_message('{"type": "speak", "text": "five", "id": "c"}')
    await turns()
    assert engine.streams[2].start_in_s == pytest.approx((before_play - 20) / 1000.0)
    assert engine.streams[2].after is second


async def test_long_text_reaches_the_engine_in_slices_one_per_turn_and_in_order():
    session, engine, events, _ = make(limits=Limits(max_text_chars=4000))
    text = "".join(f"word{i:04d} " for i in range(300))  # 2,700 characters
    session.handle_message(f'{{"type": "text.delta", "text": "{text}", "id": "a"}}')
    session.handle_message('{"type": "text.delta", "text": "tail", "id": "a"}')
    stream = engine.streams[0]
    await asyncio.sleep(0)
    assert len(stream.texts) == 1  # one slice per turn of the loop, not all at once
    await turns(20)
    assert all(len(t) <= TEXT_SLICE_CHARS for t in stream.texts)
    assert "".join(stream.texts) == text + "tail"
    assert not stream.ended


async def test_another_sender_cannot_write_to_an_utterance_it_did_not_open():
    session, engine, events, _ = make()
    backend = Events()
    session.add_listener("backend", backend)
    session.handle_message('{"type": "text.delta", "text": "mine ", "id": "a"}', "peer")
    session.handle_message('{"type": "text.delta", "text": "theirs", "id": "a"}', "backend")
    session.handle_message('{"type": "text.end", "id": "a"}', "backend")
    await turns()
    assert backend.codes() == ["id_in_use", "id_in_use"]
    assert events.codes() == []  # the error goes to its sender only
    assert engine.streams[0].texts == ["mine "] and not engine.streams[0].ended


async def test_only_the_writer_backend_may_write_but_anyone_may_ping():
    session, engine, events, _ = make()
    other = Events()
    session.add_listener("b", other)
    session.writer = "a"
    session.handle_message('{"type": "speak", "text": "hi"}', "b")
    session.handle_message('{"type": "ping", "t": 7}', "b")
    assert other.codes() == ["read_only"] and other.of("pong") == [{"type": "pong", "t": 7}]
    assert engine.streams == []
    session.handle_message('{"type": "speak", "text": "hi"}', "a")
    assert len(engine.streams) == 1


async def test_queue_limit_and_ended_utterances_are_refused_with_codes():
    session, engine, events, _ = make(max_queued_utterances=2)
    session.handle_message('{"type": "speak", "text": "a", "id": "1"}')
    session.handle_message('{"type": "speak", "text": "b", "id": "2"}')
    session.handle_message('{"type": "speak", "text": "c", "id": "3"}')
    session.handle_message('{"type": "text.delta", "text": "more", "id": "1"}')
    assert events.codes() == ["queue_full", "utterance_ended"]
    assert len(engine.streams) == 2


async def test_utterance_too_long_is_refused_and_its_text_not_sent():
    session, engine, events, _ = make(max_utterance_chars=10)
    session.handle_message('{"type": "text.delta", "text": "12345678", "id": "a"}')
    session.handle_message('{"type": "text.delta", "text": "9abc", "id": "a"}')
    await turns()
    assert events.codes() == ["utterance_too_long"]
    assert engine.streams[0].texts == ["12345678"]


async def test_messages_over_the_rate_are_refused_per_sender():
    session, _, events, _ = make(limits=Limits(max_messages_per_s=5))
    other = Events()
    session.add_listener("b", other)
    for _ in range(8):
        session.handle_message('{"type": "ping"}', "peer")
    session.handle_message('{"type": "ping"}', "b")
    assert len(events.of("pong")) == 5 and events.codes() == ["rate_limited"] * 3
    assert other.of("pong") and other.codes() == []


async def test_cancel_stops_everything_and_reports_what_was_heard():
    session, engine, events, samples = make()
    session.attach_output("opus")
    session.handle_message('{"type": "speak", "text": "one two three four", "id": "a"}')
    session.handle_message('{"type": "speak", "text": "later", "id": "b"}')
    await turns()
    engine.streams[0].say(["one", "two", "three", "four"])
    await play_until(session, events, "audio.started")
    while session.playout.current.played_ms < 300:  # "one" (0-200 ms) heard, "two" (200-400) past its middle
        session.playout.next_frame()
        await asyncio.sleep(0.001)
    session.handle_message('{"type": "cancel"}')
    assert all(s.cancelled for s in engine.streams)
    interrupted = events.of("utterance.interrupted")
    assert [e["id"] for e in interrupted] == ["a", "b"]
    assert interrupted[0]["played_text"] == "one two" and interrupted[0]["reason"] == "cancel"
    assert interrupted[1]["played_ms"] == 0 and interrupted[1]["played_text"] == ""
    assert session.playout.next_frame() == session.playout.silence
    assert [r for r, _ in samples.interrupts] == ["cancel"]
    # Text for an interrupted utterance is refused; ending it is fine.
    session.handle_message('{"type": "text.delta", "text": "x", "id": "a"}')
    session.handle_message('{"type": "text.end", "id": "b"}')
    assert events.codes() == ["utterance_interrupted"]
    # The session goes on: a new utterance plays.
    session.handle_message('{"type": "speak", "text": "again", "id": "c"}')
    await turns()
    engine.streams[-1].say(["again"])
    engine.streams[-1].finish()
    await play_until(session, events, "utterance.done")
    assert events.of("utterance.done")[0]["id"] == "c"


async def test_speech_on_the_microphone_interrupts_only_while_speaking():
    session, engine, events, samples = make()
    session.attach_output("opus")
    session.caller.vad_events(["speech.started"], 0)  # nothing playing: an event, no interrupt
    assert events.of("speech.started") and samples.interrupts == []
    session.handle_message('{"type": "speak", "text": "hello", "id": "a"}')
    await turns()
    engine.streams[0].say(["hello"])
    await play_until(session, events, "audio.started")
    # The VAD says speech.long with speech.started when a turn needs no more speech to interrupt.
    session.caller.vad_events(["speech.started", "speech.long"], 0)
    assert events.of("utterance.interrupted")[0]["reason"] == "barge_in"
    assert not events.of("speech.long")  # the session's own event, never sent


async def test_a_turn_too_short_to_interrupt_is_a_backchannel():
    session, engine, events, samples = make()
    session.attach_output("opus")
    session.handle_message('{"type": "speak", "text": "hello", "id": "a"}')
    await turns()
    engine.streams[0].say(["hello"])
    await play_until(session, events, "audio.started")
    session.caller.vad.turn_voiced_ms = 340
    session.caller.vad_events(["speech.started"], 100)
    session.caller.vad_events(["speech.stopped"], 900)
    assert samples.interrupts == [] and not events.of("utterance.interrupted")
    assert events.of("speech.backchannel") == [{"type": "speech.backchannel", "id": "a", "speech_ms": 340, "at_ms": 900}]
    # A turn that began with the bot silent is no backchannel, however short.
    session.interrupt("cancel")
    session.caller.vad_events(["speech.started"], 1000)
    session.caller.vad_events(["speech.stopped"], 1500)
    assert len(events.of("speech.backchannel")) == 1


async def test_events_carry_at_ms_on_the_session_clock_and_speech_is_timed_by_its_frame():
    # The VAD on the loop, as it runs without the echo canceller (which runs it as a pool job: test_echo.py).
    session, engine, events, _ = make(barge_in=BargeInSettings(echo_cancel=False))
    session.attach_output("opus")
    session.handle_message('{"type": "speak", "text": "hello", "id": "a"}')
    await turns()
    engine.streams[0].say(["hello"])
    await play_until(session, events, "audio.started")
    started = events.of("audio.started")[0]
    assert 0 <= started["at_ms"] <= session.clock.ms()

    class VadAtThirdFrame:
        frames = 0

        def process(self, pcm):
            self.frames += 1
            return ["speech.started", "speech.long"] if self.frames == 3 else []

    session.caller.vad = VadAtThirdFrame()  # type: ignore[assignment]
    before = session.clock.ms()
    session.caller.on_inbound_audio(np.zeros(4 * 320, np.int16), 5000.0)  # captured from 5000 ms: frames at 5000, 5020, ...
    assert events.of("speech.started")[0]["at_ms"] == 5060  # the end of the third frame
    interrupted = events.of("utterance.interrupted")[0]
    assert int(before) <= interrupted["at_ms"] <= session.clock.ms() and interrupted["at_ms"] >= started["at_ms"]
    assert session.ready_event()["at_ms"] >= interrupted["at_ms"]


async def test_close_cancels_streams_runs_every_callback_and_happens_once():
    session, engine, events, _ = make()
    session.handle_message('{"type": "text.delta", "text": "open", "id": "a"}')
    closed = []

    def broken(s: Session) -> None:
        raise ValueError("a callback bug")

    async def later(s: Session) -> None:
        closed.append(s.id)

    session.on_close += [broken, later]
    await session.close("bye")
    await session.close("again")
    assert engine.streams[0].cancelled and session.closed and session.closed_event.is_set()
    assert closed == [session.id]  # the broken callback did not stop the next one
    assert [e["reason"] for e in events.of("session.closed")] == ["bye"]


def test_the_sessions_parts_import_neither_the_session_nor_each_other_type_checking_included():
    """The import contract (pyproject.toml) skips TYPE_CHECKING imports; this reads every import in
    the files, those under `if TYPE_CHECKING:` too, so no cycle can hide behind one."""
    import ast
    import importlib

    def imports(name: str) -> set[str]:
        """Every module and name `name` imports from, by its absolute name (`voxgate.gateway.sessions.session`)."""
        package = name.rsplit(".", 1)[0].split(".")
        tree = ast.parse(open(importlib.import_module(name).__file__, encoding="utf-8").read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        return found

    session = "voxgate.gateway.sessions.session"
    parts = {"voxgate.gateway.sessions.session_queue", "voxgate.gateway.sessions.session_output",
             "voxgate.gateway.caller.caller_side"}
    assert session in imports("voxgate.gateway.webrtc.peer")  # the reading sees a relative import across packages
    for part in parts:
        assert not imports(part) & ({session} | parts - {part}), part
    assert not imports("voxgate.gateway.media.feeder") & ({session} | parts)
    assert parts <= imports(session)
