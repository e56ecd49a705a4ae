"""How busy the machine's cores are with work other than this process's.

The engine asks before a step on every core whether the rest of the machine is
quiet: only then may onnxruntime's pool threads spin between ops, which cuts
the first chunk of a long sentence by about a fifth on an idle machine but makes
it 1.5x slower beside one busy process (bench/bench_streaming.py --only
spinning). The answer comes from /proc/stat (every process's CPU time) less
this process's own (os.times), over the time since the last reading; a reading
costs some tens of microseconds and is taken at most once per `window_s`.
Where /proc/stat cannot be read, the machine counts as busy.
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
# When onnxruntime's pool threads may spin between the ops of an every-core
# step: while the rest of the machine is quiet (the default), always, or never
# (--engine-spin; engine/piper_voice.py says why).
SPIN_POLICIES = ("auto", "always", "never")
# Readings closer together than this reuse the last answer: /proc/stat counts in
# 10 ms ticks, so a shorter span would say little.
WINDOW_S = 0.2


def _read_proc_stat(path: str = "/proc/stat") -> float | None:
    """Seconds of CPU time all processes have used since boot, or None."""
    try:
        with open(path, "rb") as f:
            line = f.readline(512)
    except OSError:
        return None
    fields = line.split()
    if len(fields) < 5 or fields[0] != b"cpu":
        return None
    try:
        ticks = [int(x) for x in fields[1:9]]
    except ValueError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    return busy / float(os.sysconf("SC_CLK_TCK"))


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """Whether the rest of the machine has been quiet lately (thread-safe)."""

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
        self._last: tuple[float, float, float] | None = None  # (when, total CPU s, own CPU s)
        self._others = float("inf")  # busy until measured

    def others_cores(self) -> float:
        """Cores other processes kept busy, on average, between the last two readings."""
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last[0] < self.window_s:
                return self._others
            total = self._read_total()
            if total is None:
                self._others = float("inf")
                return self._others
            own = self._read_own()
            if self._last is not None:
                when, total0, own0 = self._last
                self._others = max(0.0, (total - total0) - (own - own0)) / max(now - when, 1e-6)
            self._last = (now, total, own)
            return self._others

    def quiet(self) -> bool:
        return self.others_cores() <= self.quiet_cores
