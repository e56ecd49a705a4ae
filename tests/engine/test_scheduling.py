"""When the worker starts a new stream (issue 59): the plan of scheduling.keeps_pace, alone and
as the scheduler fills it in from what its steps measure. No model runs: the streams' state and
the measured step times are set by hand, so each decision is exact."""

from __future__ import annotations

import time

import numpy as np
import pytest

from voxgate.engine import proto
from voxgate.engine.base import AudioChunk, SynthesisOptions
from voxgate.engine.capacity import SynthesisCost
from voxgate.engine.registry import create_engine
from voxgate.engine.scheduler import Scheduler
from voxgate.engine.scheduling import START_MARGIN_S, keeps_pace


def test_a_newcomer_starts_while_every_started_stream_still_gets_its_next_step_in_time():
    # Two free slots; the newcomer's first audio takes one for 0.1 s, the started stream's
    # next step (0.1 s) goes on the other: done at 0.1, due at 0.5.
    assert keeps_pace([0.0, 0.0], [], 0.1, [(0.5, 0.1)])
    # Due at 0.12: the step ends 0.1 + the margin after now, past it.
    assert not keeps_pace([0.0, 0.0], [], 0.1, [(0.12, 0.1)])
    assert keeps_pace([0.0, 0.0], [], 0.1, [(0.1 + START_MARGIN_S + 0.001, 0.1)])


def test_first_audio_goes_first_so_the_newcomers_before_it_count():
    # One slot: two started newcomers' first audio and the candidate's (0.1 s each) go before
    # the started stream's step.
    assert not keeps_pace([0.0], [0.1, 0.1], 0.1, [(0.35, 0.05)])
    assert keeps_pace([0.0], [0.1, 0.1], 0.1, [(0.45, 0.05)])
    # Two slots share them.
    assert keeps_pace([0.0, 0.0], [0.1, 0.1], 0.1, [(0.35, 0.05)])


def test_steps_in_flight_hold_their_slots_until_they_end():
    assert keeps_pace([0.0], [], 0.1, [(0.3, 0.1)])
    assert not keeps_pace([0.2], [], 0.1, [(0.3, 0.1)])


def test_a_started_newcomers_next_chunk_is_due_once_its_first_has_played():
    # Each first chunk holds 0.3 s of audio. With next chunks of 0.05 s, four newcomers on one
    # slot keep pace; with next chunks of 0.25 s the first listener's audio runs out.
    assert keeps_pace([0.0], [0.05] * 3, 0.05, [], follow=(0.3, 0.05))
    assert not keeps_pace([0.0], [0.05] * 3, 0.05, [], follow=(0.3, 0.25))
    # The candidate's own next chunk does not hold it back: with nobody started, it starts.
    assert keeps_pace([0.0], [], 0.05, [], follow=(0.01, 1.0))


@pytest.fixture
def scheduler():
    made: list[Scheduler] = []

    def make(parallel: int = 2) -> Scheduler:
        # 0.087 core-s per audio s, the largest step 3 s of audio: about Piper's on one core.
        s = Scheduler(create_engine("tone"), send=lambda *a: None, parallel=parallel,
                      cost=SynthesisCost(0.87, 10.0, 3.0))
        s.fixed_capacity = 20.0  # the long-run rule out of the way: this is the plan's
        made.append(s)
        return s

    yield make
    for s in made:
        s.pool.shutdown()


def started(s: Scheduler, sid: int, buffered_s: float, now: float) -> None:
    """A stream whose listener has `buffered_s` of audio left, with text still to speak."""
    s.handle(proto.OpenStream(sid, SynthesisOptions().to_dict(), 8, 0.0))
    s.handle(proto.PushUnit(sid, 0, "More words to say."))
    stream = s.streams[sid]
    stream.granted, stream.chunks_sent, stream.first_sent_at, stream.audio_s = True, 1, now, buffered_s


def measured(s: Scheduler, first_s: float, later_s: float, later_audio_s: float, first_audio_s: float) -> None:
    """What the scheduler's last steps measured (as _time records them)."""
    s._first_step_times.extend([first_s] * 8)
    s._later_step_times.extend([later_s] * 8)
    s._later_per_audio.extend([later_s / later_audio_s] * 8)
    s._first_audio.extend([first_audio_s] * 8)


def test_below_capacity_a_newcomer_starts_beside_six_speaking_streams(scheduler):
    # Issue 41's rule planned 1.5 steps per started stream at the largest step's cost (0.26 s):
    # the sixth of six streams with 0.8 s in hand needed 1.4 s, and the newcomer waited. Steps
    # measure 0.06 s for 0.7 s of audio: all six next steps fit after its first audio.
    s = scheduler()
    now = time.monotonic()
    for sid in range(1, 7):
        started(s, sid, 0.8, now)
    measured(s, first_s=0.08, later_s=0.06, later_audio_s=0.7, first_audio_s=0.4)
    assert s._in_time(now)


def test_a_newcomer_waits_while_its_first_audio_would_make_started_streams_run_dry(scheduler):
    s = scheduler()
    now = time.monotonic()
    for sid in range(1, 7):
        started(s, sid, 0.15, now)
    measured(s, first_s=0.08, later_s=0.12, later_audio_s=0.7, first_audio_s=0.4)
    # A listener's next chunk is sized to its buffered audio (engine/windows.py: 6 x 0.05 s), and
    # no smaller than a first chunk: 0.4 s of audio at 0.12 / 0.7 s per audio second, 0.069 s;
    # with 0.15 s buffered, a 0.9 s window, which takes longer than later chunks measure: 0.12 s.
    assert s.later_step_s(0.05) == pytest.approx(0.12 / 0.7 * 0.4)
    assert s.later_step_s(0.15) == pytest.approx(0.12)
    # Six of them on two slots beside a first audio of 0.08 s: the first ends 0.12 s from now,
    # and with the margin past the 0.15 s its listener has.
    assert not s._in_time(now)


def test_the_newcomers_already_started_without_audio_count_with_their_next_steps(scheduler):
    # No stream has audio yet: a burst. Each first chunk holds 0.4 s, each next step 0.1 s.
    s = scheduler(parallel=1)
    measured(s, first_s=0.05, later_s=0.1, later_audio_s=0.4, first_audio_s=0.4)
    for sid in range(1, 8):
        s.handle(proto.OpenStream(sid, SynthesisOptions().to_dict(), 8, 0.0))
        s.handle(proto.PushUnit(sid, 0, "Hello there."))
    now = time.monotonic()  # every listener is waiting
    opened = list(s.streams.values())
    # On one slot: two started newcomers and the candidate (0.05 s each), then the two next
    # chunks (0.1 s), fit in the 0.4 s each first chunk plays; four and the candidate do not:
    # the third listener's next chunk would end 0.55 s from now, its first having come at 0.15 s.
    for stream in opened[:2]:
        stream.granted = True
    assert s._in_time(now)
    for stream in opened[:4]:
        stream.granted = True
    assert not s._in_time(now)


def test_what_the_steps_measure_is_the_work_from_one_chunk_to_the_next(scheduler):
    s = scheduler()
    s.handle(proto.OpenStream(1, SynthesisOptions().to_dict(), 8, 0.0))
    s.handle(proto.PushUnit(1, 0, "Hello there."))
    stream = s.streams[1]
    chunk = AudioChunk(pcm=np.zeros(8820, np.int16), sample_rate=22050, text="Hello", words=[], unit_end=False)
    s._time([(1, None, None, 0.02, 0.0)])  # an encoder pass: work towards first audio
    s._time([(1, None, chunk, 0.05, 0.0)])  # the first window
    assert list(s._first_step_times) == [pytest.approx(0.07)] and list(s._first_audio) == [pytest.approx(0.4)]
    stream.chunks_sent = 1
    s._time([(1, None, chunk, 0.04, 0.0)])  # a later window
    # The next sentence's encoder pass and first window: one later chunk's work, not two steps
    # (an encoder pass alone, 20 ms, had planned later steps ten times too short).
    s._time([(1, None, None, 0.02, 0.0)])
    s._time([(1, None, chunk, 0.03, 0.0)])
    assert list(s._later_step_times) == [pytest.approx(0.04), pytest.approx(0.05)]
    assert list(s._later_per_audio) == [pytest.approx(0.1), pytest.approx(0.125)]


def test_until_a_few_later_chunks_were_timed_the_largest_step_is_planned(scheduler):
    s = scheduler()
    largest = s.cost.largest_step_s()  # 0.087 s per audio s times 3 s
    assert s.step_s(first=False) == pytest.approx(largest)
    s._later_step_times.extend([0.02, 0.03])
    assert s.step_s(first=False) == pytest.approx(largest)
    s._later_step_times.extend([0.02, 0.03])
    assert s.step_s(first=False) == pytest.approx(0.03)
