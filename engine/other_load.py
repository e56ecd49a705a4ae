"""How busy the machine's cores are with work other than this process's.

The engine asks before each model run on every core whether the rest of the
machine is quiet: only then may onnxruntime's pool threads spin between ops,
which speeds up the first chunk of a long sentence on an idle machine but
slows it beside a busy process (`python bench/bench_streaming.py --only
spinning`; docs/benchmarks.md). The answer comes from /proc/stat (every
process's CPU time, steal included) less this process's own (os.times), over
the last `window_s`: a daemon thread takes a reading every `window_s` (some
tens of microseconds each), so the answer is never older than that, however
long the engine sat idle. Where /proc/stat cannot be read, the machine counts
as busy.

The threshold was chosen on this project's 2-core machines; on a host with
many cores, background work alone may keep `auto` from spinning, which costs
only the speed-up (`--engine-spin always` spins regardless).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

# Busy cores of other processes above which the machine is not quiet: the
# gateway's event loop and Opus encoding for a few sessions stay below it, one
# busy-looping process does not.
QUIET_OTHERS_CORES = 0.35
# The span of one reading: /proc/stat counts in 10 ms ticks, so a shorter span
# would say little, and a longer one would answer for a machine that has changed.
WINDOW_S = 0.2
# A reading older than this many spans counts for nothing.
STALE_WINDOWS = 5


def _read_proc_stat(path: str = "/proc/stat") -> float | None:
    """Seconds of CPU time all processes have used since boot, or None."""
    # os.read, not open(): a file object is one more object for the garbage
    # collector, alive across a freeze of the heap (see OtherLoad._run).
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            head = os.read(fd, 512)
        finally:
            os.close(fd)
    except OSError:
        return None
    fields = head.split(b"\n", 1)[0].split()
    if len(fields) < 5 or fields[0] != b"cpu":
        return None
    try:
        # user nice system idle iowait irq softirq steal (guest time is inside user and nice).
        ticks = [int(x) for x in fields[1:9]]
    except ValueError:
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / float(os.sysconf("SC_CLK_TCK"))


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def usable_cores(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> float:
    """Cores this process may run on: its CPU affinity, and the tightest CPU quota
    of its cgroup and the cgroups above it (v2 `cpu.max`, v1 `cpu.cfs_quota_us`)."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = float(os.cpu_count() or 1)
    for quota in _cgroup_quotas(proc, cgroup_root):
        cores = min(cores, quota)
    return cores


def _cgroup_quotas(proc: str, root: str) -> list[float]:
    """CPU quotas in cores along this process's cgroup path, from its own cgroup up to the root."""
    try:
        with open(os.path.join(proc, "self/cgroup"), "rb") as f:
            lines = f.read(8192).decode("ascii", "replace").splitlines()
    except OSError:
        return []
    quotas = []
    for line in lines[:64]:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1].split(","), parts[2].strip("/")
        files: tuple[str, ...]
        if parts[1] == "":  # v2: one unified hierarchy
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers:  # v1: the cpu controller's own hierarchy
            base, files = next((os.path.join(root, d) for d in ("cpu,cpuacct", "cpu") if os.path.isdir(os.path.join(root, d))), root), (
                "cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        steps = path.split("/") if path else []
        for depth in range(len(steps), -1, -1):
            folder = os.path.join(base, *steps[:depth])
            quota = _read_quota(folder, files)
            if quota is not None:
                quotas.append(quota)
    return quotas


def _read_quota(folder: str, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:
            with open(os.path.join(folder, files[0]), "rb") as f:
                raw_quota, raw_period = f.read(64).split()[:2]
            return None if raw_quota == b"max" else int(raw_quota) / int(raw_period)
        with open(os.path.join(folder, files[0]), "rb") as f:
            quota = int(f.read(32))
        with open(os.path.join(folder, files[1]), "rb") as f:
            period = int(f.read(32))
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


class OtherLoad:
    """Whether the rest of the machine is quiet now (thread-safe).

    `sample()` takes one reading; the background thread that `start()` runs
    calls it every `window_s`. Tests drive `sample()` with scripted readers.
    """

    def __init__(
        self,
        quiet_cores: float = QUIET_OTHERS_CORES,
        window_s: float = WINDOW_S,
        read_total: Callable[[], float | None] = _read_proc_stat,
        read_own: Callable[[], float] = _own_cpu_s,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quiet_cores = quiet_cores
        self.window_s = window_s
        self._read_total, self._read_own, self._clock = read_total, read_own, clock
        self._lock = threading.Lock()
        # The last reading, as plain floats: a reading every 0.2 s allocates nothing the
        # garbage collector tracks, so it never frees an object of a frozen heap
        # (gateway/heap.py settle; tests/gateway/test_heap.py had seen one go).
        self._when: float | None = None  # None: no reading yet
        self._total = self._own = 0.0  # CPU seconds, every process and this one
        self._others = float("inf")  # busy until measured
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="other-load", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # time.sleep, not Event.wait: a waiting Event holds objects the garbage
        # collector tracks, and one held while the server freezes its start-up
        # heap (gateway/heap.py settle) is freed from that frozen heap
        # later (tests/gateway/test_heap.py saw it). close() takes effect within
        # one span.
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.window_s)

    def sample(self) -> None:
        with self._lock:
            now, total = self._clock(), self._read_total()
            if total is None:
                self._others, self._when = float("inf"), None
                return
            own = self._read_own()
            if self._when is not None:
                self._others = max(0.0, (total - self._total) - (own - self._own)) / max(now - self._when, 1e-6)
            self._when, self._total, self._own = now, total, own

    def others_cores(self) -> float:
        """Cores other processes kept busy, on average, over the last reading's span."""
        return self._others

    def quiet(self) -> bool:
        """Quiet by the last reading, if it is recent: a sampler that has stopped
        (closed, or its thread lost in a fork) answers busy, never quiet forever."""
        when = self._when
        if when is None or self._clock() - when > STALE_WINDOWS * self.window_s:
            return False
        return self._others <= self.quiet_cores


_shared: OtherLoad | None = None
_shared_lock = threading.Lock()


def _forget_shared() -> None:
    global _shared
    _shared = None  # a forked child has no sampler thread; it starts its own on first use


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared)


def shared_other_load() -> OtherLoad:
    """The process's one sampler, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = OtherLoad()
            _shared.start()
        return _shared
