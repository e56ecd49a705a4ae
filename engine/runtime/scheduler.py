"""The worker's scheduler: which stream's step runs next, on how many threads.

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
the worker measures what its steps cost (engine/runtime/capacity.py) and so how many
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
import os
import queue
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from .. import proto
from ..base import AudioChunk, Engine, StopSignal, SynthesisJob, SynthesisOptions, WordTiming
from .capacity import RESERVE, CoreShare, SynthesisCost, capacity
from .scheduling import (
    FIRST_STEP_S, MAX_SLACK_S, LOAD_REPORT_S, PREEMPT_SLACK_S, START_MARGIN_S, STEP_QUANTILE,
    STEPS_AHEAD, STEPS_TIMED, STOPPED, StepsDone, Stream, close_job, run_step,
)
from ..text.tags import RenderJob

log = logging.getLogger(__name__)


class Scheduler:
    """Chooses which stream's step runs next, on how many threads, in the worker.

    Many streams share one model and a few cores; running bounded steps in
    playout-deadline order is what keeps a new listener's first audio from
    waiting behind another stream's long text (see the module docstring).
    """

    def __init__(
        self, engine: Engine, *, send, parallel: int, cost: SynthesisCost | None = None,
        capacity: float | None = None, share: CoreShare | None = None, hold_new: bool = True,
        media_cost: float = 0.0,
    ) -> None:
        """`cost`: what synthesis costs here, measured (engine/runtime/capacity.py); without it,
        and without a fixed `capacity` (listeners kept speaking at once), the cores
        count as endless. `share`: the sampler of other processes' load (default: one
        for this process). `hold_new=False` lets every stream start at once, as the
        scheduler did before it protected started speech (benchmarks compare the two).
        `media_cost`: cores per speaking listener that its gateway spends beside this
        worker on the same cores (LISTENER_MEDIA_COST for the gateway's own worker; 0 for
        a pool replica, whose gateways run elsewhere)."""
        self.engine = engine
        self.send = send
        self.parallel = max(1, parallel)
        self.streams: dict[int, Stream] = {}
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
        self.media_cost = max(0.0, media_cost)
        # The cores steps can use: one per slot under load, every thread when steps run one at a time.
        self.slot_cores = float(self.parallel if self.parallel > 1 else self.max_threads)
        self._held: set[int] = set()  # sids counted in held_streams
        self._step_times: deque = deque(maxlen=STEPS_TIMED)  # recent steps' wall times
        # The stop signal of each stream's running step.
        self.running: dict[int, StopSignal] = {}
        # Streams that ended lately, oldest first, for OpenStream.after (at most proto.MAX_ENDED).
        self._ended: "OrderedDict[int, Stream]" = OrderedDict()
        # (sid, kind) per dispatched step, kind "first" or "later"; tests read the order.
        self.trace: deque = deque(maxlen=4096)

    # Messages from the gateway (engine/proto.py), and this process's own StepsDone
    def handle(self, msg: proto.ToWorker | StepsDone) -> bool:
        """Apply one message; False once the worker should stop."""
        if isinstance(msg, proto.OpenStream):
            start_at = time.monotonic() + max(0.0, float(msg.start_in_s))
            held_s = min(max(0.0, float(msg.held_s)), proto.MAX_HELD_S)
            opened = Stream(msg.sid, SynthesisOptions.from_dict(msg.options), start_at, held_s, credit=msg.credit)
            if msg.after is not None:
                # Still open, or ended lately (proto.MAX_ENDED).
                before = self.streams.get(msg.after) or self._ended.get(msg.after)
                if before is not None:
                    opened.after = before
                    opened.continues = before.speaks()
                    before.followers.append(opened)
                    before.settle()
            self.streams[msg.sid] = opened
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
        """Listeners the cores keep speaking at 1x real time, less a reserve (engine/runtime/capacity.py)."""
        if self.fixed_capacity is not None:
            return self.fixed_capacity
        free = self.share.free_cores
        if self.media_cost:
            # The gateway's media is charged per listener, at once; the part of the others'
            # measured load that is the current listeners' media is not counted twice.
            free = max(0.1, self.share.cores - max(0.0, self.share.others - self.speaking() * self.media_cost))
        cores = min(self.slot_cores, free)
        return capacity(self.cost.per_audio_s if self.cost else None, cores, RESERVE, self.media_cost)

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

    def _maybe_finish(self, stream: Stream) -> None:
        if stream.ended and not stream.busy and stream.job is None and not stream.units:
            self._remove(stream.sid, cancelled=False)
            self.send(proto.StreamDone(stream.sid))

    def _remove(self, sid: int, *, cancelled: bool) -> Stream | None:
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
            stream.settle()
        return stream

    def _drop_job(self, stream: Stream) -> None:
        job, stream.job = stream.job, None
        if job is not None and not stream.busy:
            close_job(job)

    def dispatch(self) -> None:
        """Start steps while cores are free: the most pressing eligible stream's, batched with
        others' where the engine batches, on as many threads as it should have."""
        while self.in_flight < self.parallel:
            now = time.monotonic()
            eligible = self._eligible(now)
            if not eligible:
                return
            stream = eligible[0]
            if self.all_cores_in_flight and not stream.waiting_for_first(now):
                # Every core is taken by an urgent step; only a listener who is
                # waiting for first audio may share them, the rest waits.
                return
            if stream.job is None and not self._begin(stream):
                continue
            # Every core for a step that runs alone and is urgent; one thread each
            # when steps run side by side: more audio per second from the cores.
            # Never every core beside a running step: each op of a many-thread
            # run waits for its slowest thread, and a thread that shares its core
            # makes every op that slow (a first chunk took up to 3x as long).
            # With one step at a time (parallel=1), every core.
            alone = self.in_flight == 0 and len(eligible) == 1
            every_core = self.parallel == 1 or (alone and stream.urgent(now))
            threads = self.max_threads if (every_core and self.stepwise) else 1
            self._launch(self._batch(stream, eligible[1:], now), threads, now)

    def _eligible(self, now: float) -> list[Stream]:
        """The streams that may step now, most pressing first (none: nothing starts now)."""
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
            return []
        ready.sort(key=lambda s: s.priority(now))
        # While a listener waits for first audio, streams with audio to
        # spare wait too: they would only share its cores. Their running
        # steps are stopped, to be redone later.
        waiting = [s for s in self.streams.values() if s.waiting_for_first(now) and (s.busy or s.runnable())
                   and (room or s.speaks())]
        first_pending = bool(waiting)
        if first_pending and any(s.waiting_for_first(now) for s in ready):
            self._preempt(now)
        return [s for s in ready if not first_pending or s.waiting_for_first(now) or s.urgent(now)]

    def _begin(self, stream: Stream) -> bool:
        """Begin the stream's next unit; a unit that cannot begin (a bad voice name, say) is this stream's error alone."""
        try:
            stream.begin_unit(self.engine)
        except Exception as exc:
            self._remove(stream.sid, cancelled=False)
            self.send(proto.StreamError(stream.sid, str(exc)))
            return False
        return True

    def _batch(self, stream: Stream, others: list[Stream], now: float) -> list[Stream]:
        """`stream` and the streams whose next windows go in one pass with it (just it, unbatched)."""
        if self.max_batch <= 1 or isinstance(stream.job, RenderJob):
            return [stream]
        # Streams still waiting for their first audio are batched only with each other,
        # so a new stream's first window never waits behind a full batch.
        fresh = stream.waiting_for_first(now)
        group = [stream]
        for s in others:
            if len(group) >= self.max_batch:
                break
            if s.waiting_for_first(now) != fresh:
                continue
            if s.job is None:
                try:
                    s.begin_unit(self.engine)
                except Exception:
                    continue  # it fails on its own turn, with its own error
            if not isinstance(s.job, RenderJob):
                group.append(s)
        self.counters["batches"] += 1
        self.counters["batched_streams"] += len(group)
        self.counters["largest_batch"] = max(self.counters["largest_batch"], len(group))
        return group

    def _launch(self, group: list[Stream], threads: int, now: float) -> None:
        """One step for `group` (its first stream's, and any batched with it) on the pool's threads."""
        active = sum(1 for s in self.streams.values() if s.busy or s.runnable())
        members: list[tuple[int, SynthesisJob]] = []
        for member in group:
            job = member.job
            assert job is not None  # each member's unit has begun
            members.append((member.sid, job))
            # Capped: a stream far back in its listener's queue has an endless deadline.
            job.slack_s = min(max(0.0, member.deadline() - now), MAX_SLACK_S)
            job.load = active / self.parallel
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
            self.running[group[0].sid] = stop
        self.pool.submit(self._run, members, threads, stop)

    def _preempt(self, now: float) -> None:
        for sid, stop in self.running.items():
            stream = self.streams.get(sid)
            if stream is None or stop.requested or stream.waiting_for_first(now):
                continue
            if stream.deadline() - now >= PREEMPT_SLACK_S:
                stop.request()
                self.counters["stopped_steps"] += 1

    def _run(self, members: list[tuple[int, SynthesisJob]], threads: int, stop: StopSignal) -> None:
        self.inbox.put(run_step(self.engine, members, threads, stop, alone=self.parallel == 1))

    def _step_done(self, sid: int, job: SynthesisJob, result, seconds: float, started: float) -> None:
        self.running.pop(sid, None)
        stream = self.streams.get(sid)
        if stream is None or stream.job is not job:
            # Cancelled while the step ran: discard its audio.
            close_job(job)
            return
        stream.busy = False
        if result is STOPPED:
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
