"""What synthesis costs on this engine's cores, and how many listeners those cores keep speaking.

Measured, never configured. The cost is core-seconds of synthesis per second of
audio: seeded at start by `calibrate` (a fixed sentence per step slot, one
thread each, as steps run under load) and kept current from the worker's own
steps (`SynthesisCost.add`, the CPU time of every one-thread step, those that
make no audio too: a sentence's encoder pass, a step stopped to be redone).
CPU time rather than wall time, so that the figure does not change with what
else the cores run; what else they run is measured apart (`CoreShare`: every
process's CPU time from /proc/stat, less the ones named as ours), and the
capacity is the cores left over divided by the cost:

    capacity (listeners at 1x real time) = (usable cores - others' cores) / cost

The worker's scheduler plans with it (engine/runtime/worker.py: a stream may start
speaking only while fewer than that many listeners are being kept speaking),
and reports it, with the demand it serves, in `proto.Load`; the gateway's
admission (gateway/load/admission.py) adds the media's own cost to it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from ..base import Engine, SynthesisOptions
from ..other_load import _read_proc_stat, usable_cores

# A sentence of ordinary speech, about 4 s of audio with the default voice: long enough
# that its windows are the size they are under load, short enough to cost a worker's
# start about a fifth of a second of its cores.
CALIBRATION_TEXT = "I can help you with that today, so let me look up your order and check when the next delivery is due."
# Under load each stream has a second or two of audio in hand and shares its core with
# a few others; calibration steps are told as much, so their windows are sized as then.
CALIBRATION_SLACK_S = 2.0
CALIBRATION_LOAD = 4.0
# A step's cost weighs half as much once this much more audio has been made:
# the last few minutes of speech set the figure.
HALF_LIFE_AUDIO_S = 120.0
# The cost never counts as less than this (a tone engine costs next to nothing;
# the media then sets the node's capacity).
MIN_COST = 1e-4
# The largest step counted (a generator engine's chunk can be a whole unit).
MAX_CHUNK_S = 10.0
# Other processes' busy cores, smoothed over about this long (a load balancer's
# probe must not flap with one busy second).
OTHERS_TAU_S = 10.0
# Of the cores left for synthesis, this share stays spare in the scheduler's plan:
# windows, texts and the cores' own speed vary from step to step.
RESERVE = 0.1
# What the media of one speaking listener costs the gateway on the same node, in cores
# (a cautious default above the figures in docs/benchmarks.md). A worker beside
# its gateway charges it per listener it starts, so that a burst's media is planned for
# before other processes' measured load (smoothed over OTHERS_TAU_S) shows it.
LISTENER_MEDIA_COST = 0.015


class SynthesisCost:
    """Core-seconds of synthesis per second of audio, a decayed average (thread-safe
    enough: only the worker's scheduler thread adds to it)."""

    def __init__(self, cpu_s: float = 0.0, audio_s: float = 0.0, largest_chunk_s: float = 0.0) -> None:
        self._cpu = max(0.0, cpu_s)
        self._audio = max(0.0, audio_s)
        # The most audio one step has made (windows are capped: engine/piper/windows.py).
        self.largest_chunk_s = min(MAX_CHUNK_S, max(0.0, largest_chunk_s))

    def largest_step_s(self) -> float:
        """CPU seconds of the largest step, at the current cost."""
        return (self.per_audio_s or 0.0) * self.largest_chunk_s

    def add(self, cpu_s: float, audio_s: float, largest_chunk_s: float = 0.0) -> None:
        self.largest_chunk_s = min(MAX_CHUNK_S, max(self.largest_chunk_s, largest_chunk_s))
        if audio_s > 0:
            keep = 0.5 ** (audio_s / HALF_LIFE_AUDIO_S)
            self._cpu *= keep
            self._audio *= keep
        self._cpu += max(0.0, cpu_s)
        self._audio += max(0.0, audio_s)

    @property
    def per_audio_s(self) -> float | None:
        """Core-seconds per audio second; None before any audio was measured."""
        if self._audio <= 0:
            return None
        return max(MIN_COST, self._cpu / self._audio)


def calibrate(engine: Engine, slots: int) -> SynthesisCost:
    """Synthesize CALIBRATION_TEXT once per step slot (at most one per usable core),
    side by side, each step on one thread, and time the steps' CPU: the cost a worker
    starts with. A few tenths of a second of the cores, once, at start."""
    slots = max(1, min(int(slots), int(usable_cores()) or 1))
    options = SynthesisOptions()

    def one(_: int) -> tuple[float, float, float]:
        cpu = audio = largest = 0.0
        if engine.stepwise:
            job = engine.start(CALIBRATION_TEXT, options)
            while not job.done:
                job.slack_s, job.load = CALIBRATION_SLACK_S, CALIBRATION_LOAD
                t0 = time.thread_time()
                chunk = engine.step([job], 1)[0]
                cpu += time.thread_time() - t0
                if chunk is not None:
                    audio += chunk.duration
                    largest = max(largest, chunk.duration)
        else:
            chunks = iter(engine.synthesize(CALIBRATION_TEXT, options))
            while True:
                t0 = time.thread_time()
                chunk = next(chunks, None)
                cpu += time.thread_time() - t0
                if chunk is None:
                    break
                audio += chunk.duration
                largest = max(largest, chunk.duration)
        return cpu, audio, largest

    with ThreadPoolExecutor(slots, thread_name_prefix="calibrate") as pool:
        results = list(pool.map(one, range(slots)))
    return SynthesisCost(sum(r[0] for r in results), sum(r[1] for r in results), max(r[2] for r in results))


def _pid_cpu_s(pid: int) -> float | None:
    """A process's CPU seconds so far (user + system, every thread), from /proc."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            raw = os.read(fd, 1024)
        finally:
            os.close(fd)
        fields = raw[raw.rindex(b")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class CoreShare:
    """How many cores processes other than ours keep busy, smoothed over OTHERS_TAU_S.

    `ours` lists the pids counted as ours (0: this process). Call `sample()` every
    second or so; it reads /proc/stat and /proc/PID/stat (some tens of microseconds).
    Where /proc cannot be read, others count as 0: the measured cost still holds.
    """

    def __init__(self, ours: tuple[int, ...] = (0,), cores: float | None = None, tau_s: float = OTHERS_TAU_S) -> None:
        self.ours = list(ours)
        self.cores = cores if cores is not None else usable_cores()
        self.tau_s = tau_s
        self.others = 0.0
        # Cores our own processes used over the last span (smoothed the same way).
        self.own = 0.0
        self._last: tuple[float, float, float] | None = None  # (when, total busy, ours)

    def _ours_s(self) -> float:
        total = 0.0
        for pid in self.ours:
            if pid == 0:
                t = os.times()
                total += t.user + t.system
            else:
                cpu = _pid_cpu_s(pid)
                if cpu is not None:
                    total += cpu
        return total

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        busy = _read_proc_stat()
        if busy is None:
            return
        ours = self._ours_s()
        if self._last is not None:
            when, busy0, ours0 = self._last
            span = now - when
            if span <= 0:
                return
            if ours < ours0:  # a process of ours restarted: its count began again
                ours0 = ours
            others = max(0.0, (busy - busy0) - (ours - ours0)) / span
            own = max(0.0, ours - ours0) / span
            weight = min(1.0, span / self.tau_s)
            self.others += (others - self.others) * weight
            self.own += (own - self.own) * weight
        self._last = (now, busy, ours)

    @property
    def free_cores(self) -> float:
        """The usable cores less what other processes keep busy (never under a tenth of one)."""
        return max(0.1, self.cores - self.others)


def capacity(cost_per_audio_s: float | None, free_cores: float, reserve: float = 0.0, media: float = 0.0) -> float:
    """Listeners kept speaking at 1x real time by `free_cores` at that cost (and `media`
    cores per listener beside it); inf when unmeasured."""
    if not cost_per_audio_s:
        return float("inf")
    return free_cores * (1.0 - reserve) / (max(MIN_COST, cost_per_audio_s) + media)
