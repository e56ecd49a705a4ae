"""A stream as the worker's scheduler (engine/runtime/scheduler.py) sees it, and the
constants its policy runs on.

A `Stream` is one engine stream in the worker: its pending units, its running
job, its credit, and when its listener needs audio (its deadline), which, for a
stream queued behind another of the same listener (OpenStream.after), follows
that one's. `run_step` runs one step of a job (or of a batch), on a thread of the
scheduler's pool, and says what came of it (`StepsDone`).
"""

from __future__ import annotations

import logging
import math
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from ..base import AudioChunk, Engine, EngineError, StepStopped, StopSignal, SynthesisJob, SynthesisOptions
from ..text.tags import RenderJob, from_wire, render

log = logging.getLogger(__name__)

# A stream with less audio than this buffered ahead of its listener is urgent:
# when its step is the only one to run, it gets every core.
URGENT_SLACK_S = 0.5
# A new stream starts only if every started stream that has a step to run could
# still get STEPS_AHEAD of them, in deadline order after the new one's, this long
# before it runs dry. More than one: a sentence's next audio may need its encoder
# pass first.
STEPS_AHEAD = 1.5
START_MARGIN_S = 0.1
# A step's time in that plan: the STEP_QUANTILE of the last STEPS_TIMED steps
# (FIRST_STEP_S until a step was timed). Steps vary tenfold (an encoder pass, a
# window of three seconds of audio); a plan on the mean started streams that ran dry.
STEPS_TIMED = 32
STEP_QUANTILE = 0.9
FIRST_STEP_S = 0.1
# A running step of a stream with at least this much audio buffered is stopped
# (and redone later) when a listener starts waiting for first audio. Stopping
# costs the work done so far; this much slack leaves room to redo it.
PREEMPT_SLACK_S = 1.5
# A stream queued behind more than this many unsettled streams of its listener
# ranks last until they end: each deadline walks at most this far.
MAX_QUEUE_DEPTH = 8

# The most slack a step is told of (windows.py sizes windows by it): a minute
# of audio in hand asks for the largest window already.
MAX_SLACK_S = 60.0
# How often the worker tells the gateway its load (proto.Load).
LOAD_REPORT_S = 1.0


class GeneratorJob(SynthesisJob):
    """A unit on an engine that is not stepwise: one chunk of its generator per step."""

    def __init__(self, chunks: Iterator[AudioChunk]) -> None:
        self.chunks = chunks
        self.finished = False

    @property
    def done(self) -> bool:
        return self.finished

    def step(self, threads: int = 1, stop: StopSignal | None = None) -> AudioChunk | None:
        chunk = next(self.chunks, None)
        self.finished = chunk is None
        return chunk

    def close(self) -> None:
        close_job(self.chunks)


@dataclass(slots=True)
class StepsDone:
    """A dispatched step has finished (posted by a pool thread to the scheduler's inbox).
    members: (sid, job, result, seconds, started) per stream of the step."""

    members: list[tuple]
    threads: int
    # CPU seconds the step took (its thread's, or the process's when it ran alone on
    # every core); None where they cannot be told apart from another step's.
    cpu_s: float | None = None


@dataclass
class Stream:
    sid: int
    options: SynthesisOptions
    # When the listener needs this stream's first audio, on this process's clock.
    start_at: float
    # Audio the gateway holds back (proto.OpenStream.held_s, capped at proto.MAX_HELD_S).
    held_s: float = 0.0
    units: deque = field(default_factory=deque)  # (unit_index, text)
    job: SynthesisJob | None = None
    current_index: int = 0
    credit: int = 0
    ended: bool = False
    busy: bool = False
    chunks_sent: int = 0
    audio_s: float = 0.0
    # When its first chunk went out: playout starts then (or at start_at, if later).
    first_sent_at: float | None = None
    # The stream its listener hears before this one (OpenStream.after), until that one has
    # ended and its deadline no longer moves (Stream.settle folds it into start_at).
    after: "Stream | None" = None
    followers: list = field(default_factory=list)  # the streams whose `after` this is
    closed: bool = False  # out of the scheduler: ended (finished or failed), or cancelled
    cancelled: bool = False
    # A step of it was dispatched: from then on its listener counts among those kept speaking.
    granted: bool = False
    # It follows speech its listener already hears (the stream before it had started):
    # it is part of that speech, not a newcomer.
    continues: bool = False

    def speaks(self) -> bool:
        """Whether its listener is being kept speaking by it or by the streams it is queued behind."""
        s: Stream | None = self
        for _ in range(MAX_QUEUE_DEPTH):
            if s is None:
                return False
            if s.granted or s.chunks_sent or s.continues:
                return True
            s = s.after
        return False

    def listener(self) -> "Stream":
        """The first stream of its listener's queue (bounded walk): one per listener."""
        s = self
        for _ in range(MAX_QUEUE_DEPTH):
            if s.after is None:
                break
            s = s.after
        return s

    def runnable(self) -> bool:
        return not self.busy and self.credit > 0 and (self.job is not None or bool(self.units))

    def start(self, depth: int = 0) -> float:
        """When its listener needs its first audio: start_at, or, queued behind
        another stream of the same listener, once that one's audio runs out."""
        if self.after is None:
            return self.start_at
        if depth >= MAX_QUEUE_DEPTH:
            return math.inf  # that far behind, not needed soon; and a deadline costs a bounded walk
        return max(self.start_at, self.after.deadline(depth + 1))

    def waiting_for_first(self, now: float) -> bool:
        """Its listener is waiting now and has heard nothing yet. Never while a
        stream before it is unsettled: the listener is waiting for that one."""
        return self.chunks_sent == 0 and self.after is None and self.start_at <= now

    def deadline(self, depth: int = 0) -> float:
        """When its listener runs out of audio unless another chunk arrives."""
        if self.first_sent_at is None:
            return self.start(depth)
        return max(self.start(depth), self.first_sent_at) + self.audio_s - self.held_s

    def priority(self, now: float) -> tuple:
        # A first window beats any later window; then earliest deadline first.
        return (not self.waiting_for_first(now), self.deadline(), self.sid)


    def urgent(self, now: float) -> bool:
        """Less than URGENT_SLACK_S of audio ahead of its listener."""
        return self.deadline() - now < URGENT_SLACK_S

    def settle(self) -> None:
        """Hand a closed stream's end to the streams queued behind it, once it no
        longer moves: an ended stream whose own predecessor has settled (its
        deadline is then fixed), or a cancelled one (its audio stops now). Those
        followers let go of it, so chains are no longer than the open streams
        they wait on, and the walk goes on to their followers in turn."""
        pending: list[Stream] = [self]
        while pending:
            s = pending.pop()
            if not s.closed or (s.after is not None and not s.cancelled):
                continue  # open, or ended behind a stream still open: its deadline still moves
            for follower in s.followers:
                if follower.after is s:
                    if not s.cancelled:
                        follower.start_at = max(follower.start_at, s.deadline())
                        follower.continues = follower.continues or s.speaks()
                    follower.after = None
                    pending.append(follower)
            s.followers.clear()

    def begin_unit(self, engine: Engine) -> None:
        """Make the job of its next unit (the engine's own, or a render of speech-tag pieces)."""
        index, text = self.units[0]
        stepwise = engine.stepwise
        if isinstance(text, list):  # speech-tag pieces: pauses, rate spans
            pieces = from_wire(text)
            if stepwise:
                job: SynthesisJob = RenderJob(engine, pieces, self.options)
            else:
                job = GeneratorJob(iter(render(engine, pieces, self.options)))
        elif stepwise:
            job = engine.start(text, self.options)
        else:
            job = GeneratorJob(iter(engine.synthesize(text, self.options)))
        self.units.popleft()
        self.job, self.current_index = job, index


# Marks a stopped step's result.
STOPPED = object()


def run_step(engine: Engine, members: list[tuple[int, SynthesisJob]], threads: int, stop: StopSignal, *,
             alone: bool) -> StepsDone:
    """One step of each job in `members` ((sid, job) pairs: one job, or a batch the engine
    steps at once) on `threads` threads, on a thread of the scheduler's pool: each result (a
    chunk, None, STOPPED, or the error), its wall time and start, and its CPU cost (`alone`:
    steps run one at a time, so the process's CPU time is this step's)."""
    started = time.monotonic()  # CLOCK_MONOTONIC: comparable with the gateway's clock
    # Its cost: the thread's CPU time for a one-thread step; the process's for a step
    # on every thread when steps run one at a time; else not measured.
    cpu0 = time.thread_time() if threads == 1 else (sum(os.times()[:2]) if alone else None)
    t0 = time.perf_counter()
    jobs = [job for _, job in members]
    try:
        first = jobs[0]
        if isinstance(first, (RenderJob, GeneratorJob)):  # one job, stepping itself
            results: list[object] = [first.step(threads, stop)]
        else:
            results = list(engine.step(jobs, threads, stop))
    except StepStopped:
        results = [STOPPED] * len(jobs)
    except EngineError as exc:
        results = [exc] * len(jobs)
    except Exception as exc:  # an engine bug must not take down other streams
        log.error("synthesis failed: %s", traceback.format_exc())
        results = [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(jobs)
    seconds = time.perf_counter() - t0
    if cpu0 is None:
        cpu_s = None
    else:
        cpu_s = (time.thread_time() if threads == 1 else sum(os.times()[:2])) - cpu0
    return StepsDone(
        [(sid, job, result, seconds, started) for (sid, job), result in zip(members, results)], threads, cpu_s,
    )


def close_job(job: object) -> None:
    close = getattr(job, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass
