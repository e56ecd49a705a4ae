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
from voxgate.gateway.media import priority
from voxgate.rtc_client import RtcClient

from tests.gateway.test_resilience import engine_worker_pid

FIFO = os.SCHED_FIFO  # Linux, as the gateway's real-time setting


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


class _Calls:
    """A stand-in for os.sched_setscheduler: records each call, or raises `error`."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.error = error

    def __call__(self, pid, policy, param) -> None:
        if self.error is not None:
            raise self.error
        self.calls.append((pid, policy, param.sched_priority))


@pytest.fixture
def sched(monkeypatch):
    """The policy module with the kernel call stood in for: these tests must not make pytest real-time."""
    calls = _Calls()
    monkeypatch.setattr(priority, "_policy", "normal")  # restored after the test
    monkeypatch.setattr(os, "sched_setscheduler", calls)
    return calls


def test_realtime_asks_for_fifo_that_children_do_not_inherit(sched):
    priority.apply("realtime")
    priority.enter_media_thread()
    expected = (0, FIFO | os.SCHED_RESET_ON_FORK, priority.RT_PRIORITY)
    assert sched.calls == [expected, expected]  # the loop's thread, then a media thread


def test_normal_asks_the_kernel_for_nothing(sched):
    priority.apply("normal")
    priority.enter_media_thread()
    assert sched.calls == []


@pytest.mark.parametrize(
    "allowed, says, not_says",
    [
        (False, ["--ulimit rtprio=10", "LimitRTPRIO=10", "CAP_SYS_NICE"], "rt_runtime"),
        # Allowed by the limit or the capability and refused anyway: cgroup v1's real-time budget.
        (True, ["cpu.rt_runtime_us", "--cpu-rt-runtime"], "CAP_SYS_NICE"),
    ],
)
def test_a_refusal_names_what_is_missing(sched, monkeypatch, allowed, says, not_says):
    sched.error = PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(priority, "_may_use_realtime", lambda: allowed)
    with pytest.raises(priority.PriorityError) as refused:
        priority.apply("realtime")
    for text in says:
        assert text in str(refused.value)
    assert not_says not in str(refused.value)
    assert priority._policy == "normal"  # media threads started later stay normal too


def test_a_media_thread_refused_after_the_loop_runs_on_normal_and_says_so(sched, caplog):
    priority.apply("realtime")
    sched.error = PermissionError(1, "Operation not permitted")
    priority.enter_media_thread()  # no exception: the thread does its work at normal priority
    assert "stays at normal priority" in caplog.text


def test_unthrottled_real_time_is_warned_about(sched, monkeypatch, caplog):
    monkeypatch.setattr(priority, "_rt_runtime_us", lambda: -1)
    priority.apply("realtime")
    assert "not throttled" in caplog.text


async def test_realtime_covers_the_loop_and_the_media_threads_but_not_the_engine_worker(server_factory):
    if not _realtime_allowed():
        pytest.skip("this machine refuses SCHED_FIFO to this user (not root, no CAP_SYS_NICE, ulimit -r 0)")
    # Two encoding threads, whatever this machine's cores would choose.
    server = server_factory("tone", ["--media-priority", "realtime", "--encode-threads", "2"])
    async with RtcClient(server.url) as client:
        # Speech starts the encode pool's threads, which take the loop's priority as they start.
        client.send({"type": "speak", "text": "Frames on time.", "id": "u1"})
        await client.wait_for("utterance.done", id="u1", timeout=20)
        threads = _policies(server.proc.pid)
        realtime = [tid for tid, policy in threads.items() if policy == FIFO]
        # The event loop's thread, the engine reader and the two encoding threads: nothing else.
        assert server.proc.pid in realtime
        assert len(realtime) == 2 + 2, threads
        worker = engine_worker_pid(server.proc.pid)
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
