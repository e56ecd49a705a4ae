"""--media-priority: which of a real server's threads run real-time, and what a refusal says.

The servers are real `voxgate serve` processes; thread policies are read from
the kernel (sched_getscheduler on each thread id under /proc).
"""

import os
import shutil
import subprocess
import sys

import pytest

from voxgate.config import ConfigError, Settings
from voxgate.gateway import priority
from voxgate.gateway.encode_pool import encode_pool
from voxgate.rtc_client import RtcClient

from tests.gateway.test_resilience import children_of

FIFO = os.SCHED_FIFO


def _policies(pid: int) -> dict[int, int]:
    """Each thread of `pid`: its scheduling policy without the reset-on-fork flag."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getscheduler(int(tid)) & ~os.SCHED_RESET_ON_FORK
        except ProcessLookupError:
            pass  # a thread that just ended
    return out


def _realtime_allowed() -> bool:
    """Whether this machine lets a process of ours take SCHED_FIFO (root, CAP_SYS_NICE or an rtprio limit)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(%d))" % priority.RT_PRIORITY
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="--media-priority 'fast': choose one of normal, realtime"):
        Settings(media_priority="fast").check()
    with pytest.raises(priority.PriorityError, match="choose one of normal, realtime"):
        priority.apply("fast")


async def test_realtime_covers_the_loop_and_the_media_threads_but_not_the_engine_worker(server_factory):
    if not _realtime_allowed():
        pytest.skip("this machine refuses SCHED_FIFO to this user (not root, no CAP_SYS_NICE, ulimit -r 0)")
    server = server_factory("tone", ["--media-priority", "realtime"])
    async with RtcClient(server.url) as client:
        # Speech starts the encode pool's threads, which take the loop's priority as they start.
        client.send({"type": "speak", "text": "Frames on time.", "id": "u1"})
        await client.wait_for("utterance.done", id="u1", timeout=20)
        threads = _policies(server.proc.pid)
        realtime = [tid for tid, policy in threads.items() if policy == FIFO]
        # The event loop's thread, the engine reader and the encode pool: nothing else.
        assert server.proc.pid in realtime
        assert len(realtime) == 2 + encode_pool.threads, threads
        (worker,) = [pid for pid in children_of(server.proc.pid) if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert set(_policies(worker).values()) == {os.SCHED_OTHER}  # synthesis never takes the loop's core


async def test_normal_leaves_every_thread_normal(tone_server):
    async with RtcClient(tone_server.url) as client:
        client.send({"type": "speak", "text": "Plain.", "id": "n1"})
        await client.wait_for("utterance.done", id="n1", timeout=20)
    assert set(_policies(tone_server.proc.pid).values()) == {os.SCHED_OTHER}


def _without_cap_sys_nice(rtprio: int, argv: list[str]) -> list[str]:
    """`argv` with CAP_SYS_NICE gone and RLIMIT_RTPRIO at `rtprio`, as for a container's non-root user."""
    if os.geteuid() == 0:
        # Root keeps what its bounding set allows across exec: drop CAP_SYS_NICE from it.
        assert shutil.which("setpriv"), "util-linux's setpriv is needed to drop CAP_SYS_NICE"
        argv = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", *argv]
    return ["prlimit", f"--rtprio={rtprio}", *argv]


SERVE_REALTIME = [sys.executable, "-m", "voxgate.cli", "serve", "--engine", "tone", "--port", "0", "--media-priority", "realtime"]


def test_a_refused_priority_stops_the_server_and_says_what_to_do():
    """Without CAP_SYS_NICE and with `ulimit -r 0`, as for most containers and users.

    The other way in, a real-time limit without the capability (`docker run
    --ulimit rtprio=10`), is not tested: raising the hard limit needs
    CAP_SYS_RESOURCE, which this machine's containers lack."""
    result = subprocess.run(_without_cap_sys_nice(0, SERVE_REALTIME), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--media-priority realtime" in result.stderr and "CAP_SYS_NICE" in result.stderr
    assert "--ulimit rtprio=10" in result.stderr and "ulimit -r 10" in result.stderr
    assert "Traceback" not in result.stderr
