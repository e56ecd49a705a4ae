"""The engine worker process: owns the model and the device, serves many streams.

The gateway sends, per stream (engine/proto.py): OpenStream (with when its
listener needs the first audio), PushUnit, EndInput, Credit and CancelStream. The scheduler runs one bounded
step at a time per stream: for stepwise engines one encoder pass over a capped
sentence or one window of frames, for the others one chunk. So a cancel takes
effect within one step, and no stream's text can hold a core for long.

Steps go by playout deadline, the moment a stream's listener would run out of
audio: first a stream still waiting for its first audio (its listener is
waiting now), then the one that would run dry soonest. A stream with seconds
already buffered waits.

Started speech must not stop, so a new stream starts (gets its first step)
only when that leaves the started ones whole, by two rules. In the long run:
the worker measures what its steps cost (engine/capacity.py) and so how many
listeners its cores keep speaking at 1x real time, and a stream starts only
while fewer listeners than that are being kept speaking. Right now: only if
every started stream with a step to run could still have it, after the new
one's and in deadline order, before its listener runs dry. Otherwise the new
stream waits, newcomers in the order their listeners began waiting, and the
started ones go by deadline. So when a burst passes capacity, new utterances
wait longer for their first audio, and no started one is stretched by them.

Steps run on a small thread pool; onnxruntime and torch release the GIL, so
steps of different streams overlap on the cores. A step that runs alone and is
urgent gets every core; under load each step gets one thread and steps run
side by side, which gets more audio per second out of the cores (see
docs/engines.md for the measurements behind the switch).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

from ..logs import setup_logging
from . import proto, wire
from .capacity import RESERVE, CoreShare, SynthesisCost, calibrate, capacity
from .base import (
    AudioChunk, Engine, EngineError, StepStopped, StopSignal, SynthesisJob, SynthesisOptions, WordTiming,
)
from .registry import create_engine
from .tags import RenderJob, from_wire, render

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
# Marks a stopped step's result.
_STOPPED = object()
# How often the worker tells the gateway its load (proto.Load).
LOAD_REPORT_S = 1.0


class _GeneratorJob(SynthesisJob):
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
        _close(self.chunks)


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
class _Stream:
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
    # ended and its deadline no longer moves (Scheduler._settle folds it into start_at).
    after: "_Stream | None" = None
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
        s: _Stream | None = self
        for _ in range(MAX_QUEUE_DEPTH):
            if s is None:
                return False
            if s.granted or s.chunks_sent or s.continues:
                return True
            s = s.after
        return False

    def listener(self) -> "_Stream":
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


class Scheduler:
    """Chooses which stream's step runs next, on how many threads, in the worker.

    Many streams share one model and a few cores; running bounded steps in
    playout-deadline order is what keeps a new listener's first audio from
    waiting behind another stream's long text (see the module docstring).
    """

    def __init__(
        self, engine: Engine, *, send, parallel: int, cost: SynthesisCost | None = None,
        capacity: float | None = None, share: CoreShare | None = None, hold_new: bool = True,
    ) -> None:
        """`cost`: what synthesis costs here, measured (engine/capacity.py); without it,
        and without a fixed `capacity` (listeners kept speaking at once), the cores
        count as endless. `share`: the sampler of other processes' load (default: one
        for this process). `hold_new=False` lets every stream start at once, as the
        scheduler did before it protected started speech (benchmarks compare the two)."""
        self.engine = engine
        self.send = send
        self.parallel = max(1, parallel)
        self.streams: dict[int, _Stream] = {}
        self.inbox: "queue.Queue[proto.ToWorker | StepsDone]" = queue.Queue()
        self.pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="synth")
        self.in_flight = 0
        self.all_cores_in_flight = 0
        self.stepwise = engine.stepwise
        # The most threads one step may use (every core the worker has).
        self.max_threads = max(1, int(getattr(engine, "threads", 1) or 1))
        # Engines whose step() takes many jobs at once (torch) advance several streams per pass.
        self.max_batch = int(engine.info().get("max_batch", 1)) if self.stepwise else 1
        self.counters = {
            "steps": 0, "batches": 0, "batched_streams": 0, "largest_batch": 0, "all_core_steps": 0,
            "stopped_steps": 0, "cancelled_steps": 0,
            # Chunks of started streams sent after their listener had run out of audio.
            "underruns": 0,
            # Streams that waited for their first step because the cores were full.
            "held_streams": 0,
        }
        self.cost = cost
        self.fixed_capacity = capacity
        self.hold_new = hold_new
        self.share = share or CoreShare((0,))
        # The cores steps can use: one per slot under load, every thread when steps run one at a time.
        self.slot_cores = float(self.parallel if self.parallel > 1 else self.max_threads)
        self._held: set[int] = set()  # sids counted in held_streams
        self._step_times: deque = deque(maxlen=STEPS_TIMED)  # recent steps' wall times
        # The stop signal of each stream's running step.
        self.running: dict[int, StopSignal] = {}
        # Streams that ended lately, oldest first, for OpenStream.after (at most proto.MAX_ENDED).
        self._ended: "OrderedDict[int, _Stream]" = OrderedDict()
        # (sid, kind) per dispatched step, kind "first" or "later"; tests read the order.
        self.trace: deque = deque(maxlen=4096)

    # Messages from the gateway (engine/proto.py), and this process's own StepsDone
    def handle(self, msg: proto.ToWorker | StepsDone) -> bool:
        """Apply one message; False once the worker should stop."""
        if isinstance(msg, proto.OpenStream):
            start_at = time.monotonic() + max(0.0, float(msg.start_in_s))
            held_s = min(max(0.0, float(msg.held_s)), proto.MAX_HELD_S)
            stream = _Stream(msg.sid, SynthesisOptions.from_dict(msg.options), start_at, held_s, credit=msg.credit)
            if msg.after is not None:
                # Still open, or ended lately (proto.MAX_ENDED).
                before = self.streams.get(msg.after) or self._ended.get(msg.after)
                if before is not None:
                    stream.after = before
                    stream.continues = before.speaks()
                    before.followers.append(stream)
                    self._settle(before)
            self.streams[msg.sid] = stream
        elif isinstance(msg, proto.PushUnit):
            stream = self.streams.get(msg.sid)
            if stream is not None:
                stream.units.append((msg.index, msg.payload))
        elif isinstance(msg, proto.EndInput):
            stream = self.streams.get(msg.sid)
            if stream is not None:
                stream.ended = True
                self._maybe_finish(stream)
        elif isinstance(msg, proto.Credit):
            stream = self.streams.get(msg.sid)
            if stream is not None:
                stream.credit += msg.chunks
        elif isinstance(msg, proto.CancelStream):
            stream = self._remove(msg.sid, cancelled=True)
            if stream is not None:
                self._drop_job(stream)
            running = self.running.get(msg.sid)
            if running is not None and not running.requested:
                # Nobody will hear it: stop the step now rather than let it hold a core
                # (a late window can be a third of a second of one), and drop it when it ends.
                running.request()
                self.counters["cancelled_steps"] += 1
        elif isinstance(msg, proto.Ping):
            engine_counters = getattr(self.engine, "counters", {})  # e.g. the decoder's frames run and kept
            self.send(proto.Pong(msg.token, {**engine_counters, **self.counters, "streams": len(self.streams), "in_flight": self.in_flight}))
        elif isinstance(msg, proto.Shutdown):
            return False
        elif isinstance(msg, StepsDone):
            self.in_flight -= 1
            if msg.threads > 1:
                self.all_cores_in_flight -= 1
            if msg.members:
                self._step_times.append(msg.members[0][3])
            if msg.cpu_s is not None and self.cost is not None:
                chunks = [m[2].duration for m in msg.members if isinstance(m[2], AudioChunk)]
                self.cost.add(msg.cpu_s, sum(chunks), max(chunks, default=0.0))
            for member in msg.members:
                self._step_done(*member)
        return True

    def serve(self, handle=None) -> None:
        """Handle messages and dispatch steps until a message says stop (`handle`,
        by default `self.handle`, returns False); then stop the step pool.

        Everything already waiting is handled before choosing what to run next,
        so a cancel or a new stream is seen before the next step is dispatched.
        """
        handle = handle or self.handle
        running = True
        next_report = time.monotonic()
        while running:
            try:
                running = handle(self.inbox.get(timeout=max(0.0, next_report - time.monotonic())))
            except queue.Empty:
                pass
            while running:
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                running = handle(msg)
            if running:
                self.dispatch()
                now = time.monotonic()
                if now >= next_report:
                    next_report = now + LOAD_REPORT_S
                    self.share.sample(now)
                    self.send(self.load())
        self.pool.shutdown(wait=False, cancel_futures=True)

    # What the cores carry
    def capacity(self) -> float:
        """Listeners the cores keep speaking at 1x real time, less a reserve (engine/capacity.py)."""
        if self.fixed_capacity is not None:
            return self.fixed_capacity
        cores = min(self.slot_cores, self.share.free_cores)
        return capacity(self.cost.per_audio_s if self.cost else None, cores, RESERVE)

    def step_s(self) -> float:
        """A step's wall time to plan with: high in its recent spread (STEP_QUANTILE), and
        no less than the largest step at the measured cost (a burst's first steps are
        all small windows; the ones that keep the streams going after them are large)."""
        largest = self.cost.largest_step_s() if self.cost is not None else 0.0
        if not self._step_times:
            return max(FIRST_STEP_S, largest)
        times = sorted(self._step_times)
        return max(largest, times[min(len(times) - 1, int(STEP_QUANTILE * len(times)))])

    def speaking(self) -> int:
        """Listeners being kept speaking: one per queue of streams that has started."""
        return len({id(s.listener()) for s in self.streams.values() if s.speaks()})

    def _in_time(self, now: float) -> bool:
        """Whether every started stream with a step to run could still have its next
        STEPS_AHEAD steps before its listener runs dry, if a new stream's step went first:
        the i-th soonest deadline comes after 1 + STEPS_AHEAD * (i + 1) steps shared by
        the slots, and a margin."""
        due = sorted(s.deadline() for s in self.streams.values() if s.speaks() and s.runnable())
        if not due:
            return True
        step = self.step_s() / self.parallel
        return all(d - now >= (1 + STEPS_AHEAD * (i + 1)) * step + START_MARGIN_S for i, d in enumerate(due))

    def waiting(self, now: float) -> int:
        """Streams whose listener waits for first audio now and that have not started."""
        return sum(1 for s in self.streams.values()
                   if s.waiting_for_first(now) and not s.speaks() and (s.units or s.job is not None))

    def load(self) -> proto.Load:
        t = os.times()
        return proto.Load(
            cost=self.cost.per_audio_s if self.cost else None,
            cores=min(self.slot_cores, self.share.cores),
            others=self.share.others,
            capacity=self.capacity(),
            speaking=self.speaking(),
            waiting=self.waiting(time.monotonic()),
            underruns=self.counters["underruns"],
            cpu_s=t.user + t.system,
        )

    def _maybe_finish(self, stream: _Stream) -> None:
        if stream.ended and not stream.busy and stream.job is None and not stream.units:
            self._remove(stream.sid, cancelled=False)
            self.send(proto.StreamDone(stream.sid))

    def _remove(self, sid: int, *, cancelled: bool) -> _Stream | None:
        """Take a stream out of the scheduler: ended (finished, or failed: what it
        sent still plays) or cancelled (its listener hears no more of it)."""
        stream = self.streams.pop(sid, None)
        self._held.discard(sid)
        if stream is not None:
            stream.closed, stream.cancelled = True, cancelled
            if not cancelled:
                self._ended[sid] = stream
                while len(self._ended) > proto.MAX_ENDED:
                    self._ended.popitem(last=False)
            self._settle(stream)
        return stream

    @staticmethod
    def _settle(stream: _Stream) -> None:
        """Hand a closed stream's end to the streams queued behind it, once it no
        longer moves: an ended stream whose own predecessor has settled (its
        deadline is then fixed), or a cancelled one (its audio stops now). Those
        followers let go of it, so chains are no longer than the open streams
        they wait on, and the walk goes on to their followers in turn."""
        pending = [stream]
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

    def _drop_job(self, stream: _Stream) -> None:
        job, stream.job = stream.job, None
        if job is not None and not stream.busy:
            _close(job)

    def _begin_unit(self, stream: _Stream) -> None:
        index, text = stream.units[0]
        if isinstance(text, list):  # speech-tag pieces: pauses, rate spans
            pieces = from_wire(text)
            if self.stepwise:
                job: SynthesisJob = RenderJob(self.engine, pieces, stream.options)
            else:
                job = _GeneratorJob(iter(render(self.engine, pieces, stream.options)))
        elif self.stepwise:
            job = self.engine.start(text, stream.options)
        else:
            job = _GeneratorJob(iter(self.engine.synthesize(text, stream.options)))
        stream.units.popleft()
        stream.job, stream.current_index = job, index

    def dispatch(self) -> None:
        while self.in_flight < self.parallel:
            now = time.monotonic()
            # A stream that does not speak yet may start only while the cores keep
            # fewer listeners speaking than they can (or none at all): otherwise it
            # waits, and the started ones keep their pace (the module docstring).
            speaking = self.speaking()
            room = not self.hold_new or speaking == 0 or (speaking < self.capacity() and self._in_time(now))
            ready = [s for s in self.streams.values() if s.runnable() and (room or s.speaks())]
            if not room:
                for s in self.streams.values():
                    if s.sid not in self._held and s.runnable() and not s.speaks():
                        self._held.add(s.sid)
                        self.counters["held_streams"] += 1
            if not ready:
                return
            ready.sort(key=lambda s: s.priority(now))
            # While a listener waits for first audio, streams with audio to
            # spare wait too: they would only share its cores. Their running
            # steps are stopped, to be redone later.
            waiting = [s for s in self.streams.values() if s.waiting_for_first(now) and (s.busy or s.runnable())
                       and (room or s.speaks())]
            first_pending = bool(waiting)
            if first_pending and any(s.waiting_for_first(now) for s in ready):
                self._preempt(now)
            eligible = [s for s in ready if not first_pending or s.waiting_for_first(now) or self._urgent(s, now)]
            if not eligible:
                return
            stream = eligible[0]
            if self.all_cores_in_flight and not stream.waiting_for_first(now):
                # Every core is taken by an urgent step; only a listener who is
                # waiting for first audio may share them, the rest waits.
                return
            if stream.job is None:
                try:
                    self._begin_unit(stream)
                except Exception as exc:  # a bad voice name, say: this stream's error alone
                    self._remove(stream.sid, cancelled=False)
                    self.send(proto.StreamError(stream.sid, str(exc)))
                    continue
            # Every core for a step that runs alone and is urgent; one thread each
            # when steps run side by side: more audio per second from the cores.
            # Never every core beside a running step: each op of a many-thread
            # run waits for its slowest thread, and a thread that shares its core
            # makes every op that slow (a first chunk took up to 3x as long).
            # With one step at a time (parallel=1), every core.
            alone = self.in_flight == 0 and len(eligible) == 1
            every_core = self.parallel == 1 or (alone and self._urgent(stream, now))
            threads = self.max_threads if (every_core and self.stepwise) else 1
            if self.max_batch > 1 and not isinstance(stream.job, RenderJob):
                # One batched pass for several streams' next windows. Streams still
                # waiting for their first audio are batched only with each other,
                # so a new stream's first window never waits behind a full batch.
                fresh = stream.waiting_for_first(now)
                group = [stream]
                for s in eligible[1:]:
                    if len(group) >= self.max_batch:
                        break
                    if s.waiting_for_first(now) != fresh:
                        continue
                    if s.job is None:
                        try:
                            self._begin_unit(s)
                        except Exception:
                            continue  # it fails on its own turn, with its own error
                    if not isinstance(s.job, RenderJob):
                        group.append(s)
                self.counters["batches"] += 1
                self.counters["batched_streams"] += len(group)
                self.counters["largest_batch"] = max(self.counters["largest_batch"], len(group))
            else:
                group = [stream]
            active = sum(1 for s in self.streams.values() if s.busy or s.runnable())
            for member in group:
                # Capped: a stream far back in its listener's queue has an endless deadline.
                member.job.slack_s = min(max(0.0, member.deadline() - now), MAX_SLACK_S)
                member.job.load = active / self.parallel
                member.busy = True
                member.granted = True
                member.credit -= 1
                self.trace.append((member.sid, "first" if member.chunks_sent == 0 else "later"))
            self.counters["steps"] += 1
            if threads > 1:
                self.counters["all_core_steps"] += 1
                self.all_cores_in_flight += 1
            self.in_flight += 1
            stop = StopSignal()
            if len(group) == 1:
                self.running[stream.sid] = stop
            self.pool.submit(self._run, [(s.sid, s.job) for s in group], threads, stop)

    def _preempt(self, now: float) -> None:
        for sid, stop in self.running.items():
            stream = self.streams.get(sid)
            if stream is None or stop.requested or stream.waiting_for_first(now):
                continue
            if stream.deadline() - now >= PREEMPT_SLACK_S:
                stop.request()
                self.counters["stopped_steps"] += 1

    @staticmethod
    def _urgent(stream: _Stream, now: float) -> bool:
        return stream.deadline() - now < URGENT_SLACK_S

    def _run(self, members: list[tuple[int, SynthesisJob]], threads: int, stop: StopSignal) -> None:
        started = time.monotonic()  # CLOCK_MONOTONIC: comparable with the gateway's clock
        # Its cost: the thread's CPU time for a one-thread step; the process's for a step
        # on every thread when steps run one at a time; else not measured.
        alone = self.parallel == 1
        cpu0 = time.thread_time() if threads == 1 else (sum(os.times()[:2]) if alone else None)
        t0 = time.perf_counter()
        jobs = [job for _, job in members]
        try:
            if self.stepwise and not isinstance(jobs[0], RenderJob):
                results: list[object] = list(self.engine.step(jobs, threads, stop))
            else:
                results = [jobs[0].step(threads, stop)]
        except StepStopped:
            results = [_STOPPED] * len(jobs)
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
        self.inbox.put(StepsDone(
            [(sid, job, result, seconds, started) for (sid, job), result in zip(members, results)], threads, cpu_s,
        ))

    def _step_done(self, sid: int, job: SynthesisJob, result, seconds: float, started: float) -> None:
        self.running.pop(sid, None)
        stream = self.streams.get(sid)
        if stream is None or stream.job is not job:
            # Cancelled while the step ran: discard its audio.
            _close(job)
            return
        stream.busy = False
        if result is _STOPPED:
            stream.credit += 1  # the job is as it was; the step runs again later
            return
        if isinstance(result, Exception):
            self._remove(sid, cancelled=False)
            self.send(proto.StreamError(sid, str(result)))
            return
        if result is None:
            stream.credit += 1  # nothing was sent for this step
        else:
            chunk: AudioChunk = result
            now = time.monotonic()
            if stream.chunks_sent and now > stream.deadline():
                self.counters["underruns"] += 1  # its listener ran out of audio before this chunk
            stream.chunks_sent += 1
            if stream.first_sent_at is None:
                stream.first_sent_at = now
            stream.audio_s += chunk.duration
            message = proto.Chunk(
                sid=sid,
                unit_index=stream.current_index,
                sample_rate=chunk.sample_rate,
                text=chunk.text,
                # Plain floats: engines may time words in numpy scalars.
                words=[WordTiming(w.text, float(w.start), float(w.end)) for w in chunk.words],
                unit_end=chunk.unit_end,
                synth_s=seconds,
                synth_started_at=started,
            )
            self.send(message, chunk.pcm)
        if job.done:
            stream.job = None
            self._maybe_finish(stream)


def _close(job: object) -> None:
    close = getattr(job, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


def run_worker(
    conn, engine_name: str, engine_options: dict, parallel: int, log_level: str = "INFO", log_json: bool = False
) -> None:
    """Entry point of the spawned process; it logs as the gateway that started it (--log-level, --log-json)."""
    setup_logging(log_level, log_json)
    send_lock = threading.Lock()

    def send(message: proto.FromWorker, pcm=None) -> None:
        data = wire.pack(message, pcm)
        with send_lock:
            conn.send_bytes(data)

    try:
        engine = create_engine(engine_name, **engine_options)
        t0 = time.perf_counter()
        engine.load()
        info = engine.info()
        info["load_s"] = time.perf_counter() - t0
        info["pid"] = os.getpid()
    except Exception as exc:
        send(proto.Fatal(f"{type(exc).__name__}: {exc}"))
        return
    try:
        t0 = time.perf_counter()
        cost = calibrate(engine, parallel)
        info["synthesis_cost"] = cost.per_audio_s
        info["calibration_s"] = time.perf_counter() - t0
    except Exception as exc:  # the engine works; its capacity is then unmeasured until its first steps
        log.warning("synthesis cost not measured at start: %s", exc)
        cost = SynthesisCost()
    scheduler = Scheduler(engine, send=send, parallel=parallel, cost=cost)
    log.debug("worker %d: engine %s loaded in %.2f s, %d step(s) at once", info["pid"], engine_name, info["load_s"], parallel)
    send(proto.Ready(info))

    def reader() -> None:
        while True:
            try:
                record = conn.recv_bytes()
            except (EOFError, OSError):
                scheduler.inbox.put(proto.Shutdown())
                return
            message, _ = wire.unpack(record)
            scheduler.inbox.put(message)

    threading.Thread(target=reader, name="worker-reader", daemon=True).start()
    scheduler.serve()
    engine.close()
