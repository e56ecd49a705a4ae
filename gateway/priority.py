"""How the operating system schedules the media threads: `--media-priority`.

Every session's frames leave on one 5 ms clock in the event loop's thread
(`pacer.py`), encoded on the encode pool's threads (`encode_pool.py`). When
other work keeps the cores busy (the engine worker synthesizing, other
processes; in `bench/bench_capacity.py`, the load generators beside the
server), Linux makes the woken event loop wait for a core. Measured at 60
conversations on 2 cores with the generators beside it: the loop's thread
waited on the run queue for a tenth of the wall time, in stretches of 3-6 ms,
and the frames due in those stretches were the late ones; a nice of -10 only
halved them.

`realtime` puts the event loop's thread and the encode pool's threads in
SCHED_FIFO at a low real-time priority, so a woken loop runs at once. The
encode threads share the loop's priority because they hold the GIL between
libopus calls: one preempted there would keep a real-time loop waiting on a
normal thread. SCHED_RESET_ON_FORK keeps everything else normal: threads
started from these ones, and child processes (the engine worker, whose
synthesis must never take the loop's core from it).

The kernel still throttles real-time threads to 95 % of each second by
default (`/proc/sys/kernel/sched_rt_runtime_us`), so a loop that spins cannot
lock a core for good. It needs an RLIMIT_RTPRIO of at least RT_PRIORITY
(`docker run --ulimit rtprio=10`, `ulimit -r 10`), which also works for the
images' non-root user, or CAP_SYS_NICE (root, `--cap-add SYS_NICE`);
`normal`, the default, needs nothing.
"""

from __future__ import annotations

import logging
import os

MEDIA_PRIORITIES = ("normal", "realtime")
# Low on purpose: above every normal thread, below the kernel's own real-time
# threads (interrupt threads run at 50), so the network still gets served.
RT_PRIORITY = 10

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
    _policy = policy


def enter_media_thread() -> None:
    """Called by a media thread when it starts: the event loop's priority, where one was set."""
    if _policy != "realtime":
        return
    try:
        _set_realtime()
    except PriorityError as exc:  # the loop got it, so this is unexpected; the thread runs on, normal
        log.warning("an encoding thread stays at normal priority: %s", exc)


def current() -> str:
    return _policy


def _set_realtime() -> None:
    if not hasattr(os, "sched_setscheduler"):
        raise PriorityError("--media-priority realtime needs Linux (SCHED_FIFO); use --media-priority normal here")
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(RT_PRIORITY))
    except PermissionError:
        raise PriorityError(
            "--media-priority realtime: the system refused a real-time priority for the media threads. "
            f"Allow real-time priorities up to {RT_PRIORITY} for this user (docker run --ulimit rtprio={RT_PRIORITY}, "
            f"ulimits: {{rtprio: {RT_PRIORITY}}} in compose, ulimit -r {RT_PRIORITY} in a shell, rtprio in "
            "/etc/security/limits.conf), or give the process CAP_SYS_NICE (root, or docker run --cap-add SYS_NICE); "
            "or leave --media-priority at normal"
        ) from None
    except OSError as exc:  # EINVAL and the like: a kernel or cgroup without real-time scheduling
        raise PriorityError(
            f"--media-priority realtime: the system refused SCHED_FIFO ({exc.strerror or exc}); under cgroup v1 "
            "the container's cgroup needs a real-time budget (cpu.rt_runtime_us); or leave --media-priority at normal"
        ) from None
