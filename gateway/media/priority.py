"""How the operating system schedules the media threads: `--media-priority`.

Every session's frames leave on one 5 ms clock in the event loop's thread
(`pacer.py`), encoded there too or, with `--encode-threads N`, on the encode pool's threads
(`encode_pool.py`). When
other work keeps the cores busy (the engine worker synthesizing, other
processes; in `bench/bench_capacity.py`, the load generators beside the
server), Linux makes the woken event loop wait for a core. Measured at 60
conversations on 2 cores with the generators beside it: the loop's thread
waited on the run queue for a tenth of the wall time, in stretches of 3-6 ms,
and the frames due in those stretches were the late ones; a nice of -10 only
halved them.

`realtime` puts the event loop's thread, the encode pool's threads, the
engine client's reader thread and the /v1/tts formatting threads in
SCHED_FIFO at a low real-time priority, so a woken loop runs at once. The
other threads share the loop's priority because they hold the GIL between
their C calls: one preempted there would keep a real-time loop waiting on a
normal thread. SCHED_RESET_ON_FORK keeps everything else normal: threads
started from these ones, and child processes (the engine worker, whose
synthesis should not take the loop's core from it).

What it costs and risks. The kernel keeps 5 % of each second for normal
threads by default (`/proc/sys/kernel/sched_rt_runtime_us`; apply() warns
where that is off), so a loop that spins cannot lock a core for good. But a
machine past its capacity gives the media threads the cores first and the
engine worker only what they leave, and real-time threads escape CFS CPU
quotas (`docker --cpus`, Kubernetes `limits.cpu`): keep `--max-sessions`
within the measured capacity. On a stock kernel the network's softirq work
runs in normal threads (ksoftirqd) when it is deferred, so a saturated loop
delays its own packets too.

It needs an RLIMIT_RTPRIO of at least RT_PRIORITY (`docker run --ulimit
rtprio=10`, `LimitRTPRIO=10` in a systemd unit, `ulimit -r 10`), which also
works for the images' non-root user, or CAP_SYS_NICE (root, `--cap-add
SYS_NICE`); on cgroup v1 with real-time group scheduling the cgroup needs a
real-time budget too. `normal`, the default, needs nothing.
"""

from __future__ import annotations

import logging
import os
import resource

from ...config import MEDIA_PRIORITIES

# Low on purpose: above every normal thread, below the threaded interrupt
# handlers (priority 50) on kernels that have them.
RT_PRIORITY = 10
CAP_SYS_NICE = 23  # the capability's bit in /proc/self/status CapEff
RT_RUNTIME = "/proc/sys/kernel/sched_rt_runtime_us"

log = logging.getLogger(__name__)

_policy = "normal"  # what apply() set for this process's media threads


class PriorityError(RuntimeError):
    """The operating system refused the priority; the message says what to do."""


def apply(policy: str) -> None:
    """Give the calling thread (the event loop's) `policy`; media threads started later follow it."""
    global _policy
    if policy not in MEDIA_PRIORITIES:
        raise PriorityError(f"--media-priority {policy!r}: choose one of {', '.join(MEDIA_PRIORITIES)}")
    if policy == "realtime":
        _set_realtime()
        log.info("media threads run in SCHED_FIFO at priority %d (--media-priority realtime)", RT_PRIORITY)
        if _rt_runtime_us() == -1:
            log.warning(
                "real-time threads are not throttled on this machine (%s is -1): a media thread that spun "
                "would hold its core; the default (950000) leaves 5 %% of each second to other threads", RT_RUNTIME
            )
    _policy = policy


def enter_media_thread() -> None:
    """Called by a media thread when it starts: the event loop's priority, where one was set."""
    if _policy != "realtime":
        return
    try:
        _set_realtime()
    except PriorityError as exc:  # the loop got it, so this is unexpected; the thread runs on, normal
        log.warning("a media thread (encoding, the engine reader or /v1/tts) stays at normal priority: %s", exc)


def _set_realtime() -> None:
    if not hasattr(os, "sched_setscheduler"):
        raise PriorityError("--media-priority realtime needs Linux (SCHED_FIFO); use --media-priority normal here")
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(RT_PRIORITY))
    except PermissionError:
        if _may_use_realtime():
            # Allowed by the limit or the capability, refused anyway: cgroup v1's real-time
            # group scheduling, where a cgroup without a real-time budget answers EPERM.
            raise PriorityError(
                "--media-priority realtime: the system refused SCHED_FIFO although this process may use it, "
                "so its cgroup has no real-time budget (cgroup v1 with real-time group scheduling: the cgroup's "
                "cpu.rt_runtime_us is 0; in Docker, start the daemon with --cpu-rt-runtime and the container "
                "with docker run --cpu-rt-runtime=950000); or leave --media-priority at normal"
            ) from None
        raise PriorityError(
            "--media-priority realtime: the system refused a real-time priority for the media threads. "
            f"Allow real-time priorities up to {RT_PRIORITY} for this user (docker run --ulimit rtprio={RT_PRIORITY}, "
            f"ulimits: {{rtprio: {RT_PRIORITY}}} in compose, LimitRTPRIO={RT_PRIORITY} in a systemd unit, "
            f"ulimit -r {RT_PRIORITY} in a shell), or give the process CAP_SYS_NICE (root, docker run --cap-add "
            "SYS_NICE, AmbientCapabilities=CAP_SYS_NICE in a systemd unit); or leave --media-priority at normal"
        ) from None
    except OSError as exc:  # EINVAL and the like: a kernel without real-time scheduling
        raise PriorityError(
            f"--media-priority realtime: the system refused SCHED_FIFO ({exc.strerror or exc}); "
            "leave --media-priority at normal"
        ) from None


def _may_use_realtime() -> bool:
    """Whether the rtprio limit or CAP_SYS_NICE allows this process RT_PRIORITY."""
    soft, _ = resource.getrlimit(resource.RLIMIT_RTPRIO)
    if soft == resource.RLIM_INFINITY or soft >= RT_PRIORITY:
        return True
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except OSError:
        pass
    return False


def _rt_runtime_us() -> int | None:
    try:
        with open(RT_RUNTIME) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
