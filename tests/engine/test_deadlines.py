"""The worker's step order: first windows first, then earliest playout deadline.

The scheduler runs in this process on the real voice, one step at a time
(parallel=1), so the order it dispatches steps in is deterministic and read
from its trace: no timing is asserted.
"""

from __future__ import annotations

import itertools
import time

import pytest

from voxgate.engine import proto
from voxgate.engine.base import SynthesisOptions
from voxgate.engine.runtime.client import EngineClient, EngineConfig
from voxgate.engine.piper.piper_engine import PiperEngine
from voxgate.engine.runtime.scheduler import Scheduler
from tests.speech import the_voice

BIG_CREDIT = 1000  # no backpressure: the order is the scheduler's alone


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    return the_voice()


class Run:
    """A scheduler and what it sent, driven the way run_worker drives it."""

    def __init__(self, engine: PiperEngine) -> None:
        self.sent: list = []
        self.scheduler = Scheduler(engine, send=lambda message, pcm=None: self.sent.append(message), parallel=1)

    def open(self, sid: int, text: str, start_in: float = 0.0, held: float = 0.0, after: int | None = None) -> None:
        handle = self.scheduler.handle
        handle(proto.OpenStream(sid, SynthesisOptions().to_dict(), BIG_CREDIT, start_in, held, after))
        handle(proto.PushUnit(sid, 0, text))
        handle(proto.EndInput(sid))

    def bare(self, sid: int, start_in: float = 0.0, after: int | None = None, **options) -> None:
        """A stream with no text yet and a credit of one chunk."""
        self.scheduler.handle(proto.OpenStream(sid, SynthesisOptions(**options).to_dict(), 1, start_in, 0.0, after))

    def until(self, done) -> None:
        for _ in range(10000):
            if done():
                return
            self.scheduler.dispatch()
            self.scheduler.handle(self.scheduler.inbox.get(timeout=60))
        raise AssertionError("the scheduler did not get there")

    def chunks(self, sid: int) -> int:
        return sum(1 for m in self.sent if isinstance(m, proto.Chunk) and m.sid == sid)

    def finished(self, *sids: int) -> bool:
        return all(proto.StreamDone(sid) in self.sent for sid in sids)

    def order(self) -> list[int]:
        """Stream ids in step order, runs of one stream collapsed."""
        return [sid for sid, _ in itertools.groupby(sid for sid, _ in self.scheduler.trace)]

    def close(self) -> None:
        self.scheduler.pool.shutdown(wait=True)


def test_a_new_streams_first_audio_goes_before_a_speaking_streams_next_window(engine):
    run = Run(engine)
    try:
        run.open(1, "This first stream is reading a long answer. It has three sentences. Here is the last one.")
        run.until(lambda: run.chunks(1) >= 2)
        before = len(run.scheduler.trace)
        run.open(2, "Hi there.")
        run.until(lambda: run.finished(1, 2))
        after = list(run.scheduler.trace)[before:]
        # At most the step of stream 1 already running when stream 2 opened was
        # dispatched in between (parallel=1 dispatches only when nothing runs).
        steps_of_2 = [i for i, (sid, kind) in enumerate(after) if sid == 2 and kind == "first"]
        assert steps_of_2 and steps_of_2 == list(range(len(steps_of_2)))
        # Its encoder pass and first window: two steps before its first chunk.
        assert len(steps_of_2) == 2
        assert run.chunks(2) >= 1 and run.chunks(1) >= 3
    finally:
        run.close()


def test_a_started_stream_that_has_run_dry_goes_before_first_audio(engine):
    """Speech that has started must not stop (issue 41): a started stream whose
    listener has run dry (or is about to) goes before a new listener's first
    window; the new listener waits one step longer."""
    run = Run(engine)
    try:
        handle = run.scheduler.handle
        handle(proto.OpenStream(1, SynthesisOptions().to_dict(), 2, 0.0))  # two chunks, then it waits for credit
        handle(proto.PushUnit(1, 0, "This stream gets two windows and then waits for its reader."))
        handle(proto.EndInput(1))
        run.until(lambda: run.chunks(1) == 2 and not run.scheduler.streams[1].busy)
        # Real work, no sleeping, until stream 1's listener has run out of audio.
        filler = 100
        while run.scheduler.streams[1].deadline() >= time.monotonic():
            run.open(filler, "Some other stream speaks a sentence meanwhile.")
            run.until(lambda: run.finished(filler))
            filler += 1
        before = len(run.scheduler.trace)
        run.open(2, "Hi there.")
        handle(proto.Credit(1, BIG_CREDIT))
        run.until(lambda: run.finished(1, 2))
        after = [sid for sid, _ in list(run.scheduler.trace)[before:]]
        assert after[0] == 1, after
        assert 2 in after, after
    finally:
        run.close()


def test_steps_go_by_earliest_playout_deadline(engine):
    """Three streams open at once; their listeners need audio now, in 3 s and in 6 s.

    Each says a short sentence (well under 3 s of audio), so the order must be
    whole streams: the waiting listener, then the 3 s one, then the 6 s one.
    """
    run = Run(engine)
    try:
        run.open(10, "Hello there.", start_in=6.0)
        run.open(11, "Hello there.", start_in=3.0)
        run.open(12, "Hello there.", start_in=0.0)
        run.until(lambda: run.finished(10, 11, 12))
        assert run.order() == [12, 11, 10]
        # The waiting listener got a small first window; the others, with
        # seconds to spare, got their sentence in one window (less context work).
        assert run.chunks(12) >= 2
        assert run.chunks(11) == run.chunks(10) == 1
    finally:
        run.close()


def test_a_stream_with_seconds_buffered_waits_for_one_about_to_run_dry(engine):
    """Stream 20 opens 4 s ahead of its listener; 21 is needed now. Even though
    20 is older, every step of 21 goes first."""
    run = Run(engine)
    try:
        run.open(20, "The older stream has time to spare before anyone listens.", start_in=4.0)
        run.open(21, "The newer stream is needed right now.")
        run.until(lambda: run.finished(20, 21))
        assert run.order() == [21, 20]
    finally:
        run.close()


def test_audio_the_gateway_holds_back_brings_a_streams_deadline_forward(engine):
    """Streams 30 and 31 have sent the same audio at the same moment; 31's
    consumer holds back 0.2 s (OpenStream.held_s), so its listener runs dry
    first and its next step ranks first."""
    run = Run(engine)
    try:
        run.open(30, "Both streams read this same sentence.")
        run.open(31, "Both streams read this same sentence.", held=0.2)
        a, b = run.scheduler.streams[30], run.scheduler.streams[31]
        now = time.monotonic()
        for s in (a, b):
            s.start_at, s.first_sent_at, s.audio_s, s.chunks_sent = now, now, 1.0, 1
        assert b.deadline() == pytest.approx(a.deadline() - 0.2)
        assert b.priority(now) < a.priority(now)
    finally:
        run.close()


def test_an_utterance_queued_behind_another_waits_for_it_and_not_a_new_listener(engine):
    """Stream 51 is queued behind 50 for the same listener (OpenStream.after), 52
    is a new listener's first audio, opened just after 51. 52's first audio goes
    first: nobody is waiting for 51 yet. And 51 runs only once 50 is done: its
    listener needs it when 50's audio runs out, and 50's steps are what that
    listener needs before then."""
    run = Run(engine)
    try:
        run.open(50, "The first utterance is long enough to need several windows of audio.")
        run.until(lambda: run.chunks(50) >= 1)
        before = len(run.scheduler.trace)
        run.open(51, "The second utterance waits its turn.", after=50)
        run.open(52, "Hi there.")
        run.until(lambda: run.finished(50, 51, 52))
        after = list(run.scheduler.trace)[before:]
        sids = [sid for sid, _ in after]
        firsts_of_52 = [i for i, (sid, kind) in enumerate(after) if sid == 52 and kind == "first"]
        assert firsts_of_52 and max(firsts_of_52) < sids.index(51), after
        assert max(i for i, sid in enumerate(sids) if sid == 50) < sids.index(51), after
    finally:
        run.close()


def test_a_queued_stream_is_needed_from_its_own_start_once_the_one_before_is_cancelled(engine):
    run = Run(engine)
    try:
        run.bare(60, start_in=5.0)
        run.bare(61, after=60)
        queued = run.scheduler.streams[61]
        now = time.monotonic()
        assert not queued.waiting_for_first(now) and queued.deadline() >= now + 4.0  # behind 60's 5 s
        run.scheduler.handle(proto.CancelStream(60))
        assert queued.waiting_for_first(time.monotonic()) and queued.after is None
    finally:
        run.close()


def test_a_cancel_stops_the_streams_running_step(engine):
    """A cancelled stream's step in flight is stopped (and its audio dropped),
    so the next listener's first audio does not wait for it."""
    run = Run(engine)
    try:
        run.open(90, "A long utterance whose listener interrupts it during its first step.")
        run.scheduler.dispatch()
        stop = run.scheduler.running[90]
        run.scheduler.handle(proto.CancelStream(90))
        assert stop.requested
        run.scheduler.handle(run.scheduler.inbox.get(timeout=60))  # the step ends, stopped or not
        assert 90 not in run.scheduler.running and not any(
            isinstance(m, proto.Chunk) and m.sid == 90 for m in run.sent
        )
    finally:
        run.close()


def test_a_deadline_walks_a_bounded_queue(engine):
    from voxgate.engine.runtime.scheduling import MAX_QUEUE_DEPTH

    run = Run(engine)
    try:
        run.bare(70)
        for sid in range(71, 71 + MAX_QUEUE_DEPTH + 2):
            run.bare(sid, after=sid - 1)
        streams = run.scheduler.streams
        assert streams[70].deadline() <= streams[70 + MAX_QUEUE_DEPTH].deadline() < float("inf")
        assert streams[71 + MAX_QUEUE_DEPTH].deadline() == float("inf")  # far back: ranks last
        run.scheduler.handle(proto.CancelStream(70))
        assert streams[71 + MAX_QUEUE_DEPTH].deadline() < float("inf")
    finally:
        run.close()


def test_streams_that_ended_behind_an_open_one_settle_when_it_ends(engine):
    """A reply sent as short `speak`s: stream 100 is still open, 101-110 queued
    behind it have ended already (short, or out of text), 111 is open behind
    them. Past MAX_QUEUE_DEPTH it ranks last; once 100 ends, the queue settles:
    every link is let go of and 111's start is fixed, and finite."""
    run = Run(engine)
    try:
        handle = run.scheduler.handle
        run.bare(100, start_in=3.0)
        for sid in range(101, 111):
            run.bare(sid, after=sid - 1)
            handle(proto.EndInput(sid))  # no text: it ends at once, behind 100
        run.bare(111, after=110)
        last = run.scheduler.streams[111]
        assert last.deadline() == float("inf") and not last.waiting_for_first(time.monotonic())
        first_deadline = run.scheduler.streams[100].deadline()
        handle(proto.EndInput(100))
        assert last.after is None and first_deadline <= last.start_at < float("inf")
        assert not last.waiting_for_first(time.monotonic())  # 100's listener needs it in about 3 s
    finally:
        run.close()


def test_a_stream_opened_after_one_that_ended_follows_its_audio(engine):
    """An LLM's next sentence arrives once the last one is synthesized, long
    before it has played: `after` names a stream that has ended, and the new
    one is needed when that one's audio runs out, not now."""
    run = Run(engine)
    try:
        run.bare(120, start_in=5.0)
        run.scheduler.handle(proto.EndInput(120))
        assert 120 not in run.scheduler.streams
        run.bare(121, after=120)
        queued = run.scheduler.streams[121]
        assert queued.after is None and queued.start_at >= time.monotonic() + 4.0
        assert not queued.waiting_for_first(time.monotonic())
    finally:
        run.close()


def test_a_stream_behind_one_that_failed_follows_what_it_sent(engine):
    run = Run(engine)
    try:
        run.bare(130, start_in=5.0, voice="no-such-voice")
        run.bare(131, after=130)
        run.scheduler.handle(proto.PushUnit(130, 0, "This voice does not exist."))
        run.until(lambda: any(isinstance(m, proto.StreamError) and m.sid == 130 for m in run.sent))
        queued = run.scheduler.streams[131]
        assert queued.after is None and queued.start_at >= time.monotonic() + 4.0
    finally:
        run.close()


def test_the_held_back_audio_is_capped_and_only_counts_once_audio_was_sent(engine):
    from voxgate.engine.proto import MAX_HELD_S

    run = Run(engine)
    try:
        handle = run.scheduler.handle
        handle(proto.OpenStream(40, SynthesisOptions().to_dict(), 1, 0.0, 30.0))
        handle(proto.OpenStream(41, SynthesisOptions().to_dict(), 1, 0.0, float("nan")))
        a, b = run.scheduler.streams[40], run.scheduler.streams[41]
        assert a.held_s == MAX_HELD_S and b.held_s == 0.0
        assert a.deadline() == a.start_at  # nothing sent yet: the listener waits from its start
        a.first_sent_at, a.audio_s = a.start_at + 0.1, 1.0
        assert a.deadline() == pytest.approx(a.start_at + 0.1 + 1.0 - MAX_HELD_S)
    finally:
        run.close()


async def test_the_client_sends_the_deadline_as_an_explicit_field_of_the_open_request():
    client = EngineClient(EngineConfig(engine="tone", parallel=1))
    await client.start()
    sent: list = []
    real = client._send
    client._send = lambda message: (sent.append(message), real(message))  # type: ignore[method-assign]
    try:
        client.stream(start_in_s=2.5, held_s=0.03).cancel()
        client.stream().cancel()
    finally:
        await client.close()
    opens = [m for m in sent if isinstance(m, proto.OpenStream)]
    assert [m.start_in_s for m in opens] == [2.5, 0.0]
    assert [m.held_s for m in opens] == [0.03, 0.0]
