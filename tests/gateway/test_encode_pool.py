"""Where encoding runs (gateway/media/encode_pool.py): on the event loop when nothing else waits, within
a budget per turn, or on threads; results and errors arrive on the caller's loop either way."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from voxgate.config import ConfigError, Settings
from voxgate.gateway.media import encode_pool as pool_module
from voxgate.gateway.media.encode_pool import FIRST, LATER, EncodePool, default_threads, parse_threads


async def test_results_and_errors_arrive_on_the_calling_loop():
    pool = EncodePool(threads=2)
    results = [pool.submit(pow, 2, n) for n in range(20)]
    assert [await r for r in results] == [2**n for n in range(20)]
    with pytest.raises(ZeroDivisionError):
        await pool.submit(divmod, 1, 0)


async def test_without_threads_jobs_run_on_the_loop_and_never_inside_submit():
    pool = EncodePool(threads=0)
    ran_on: list[int] = []

    def job(n: int) -> int:
        ran_on.append(threading.get_ident())
        return n * n

    futures = [pool.submit(job, n) for n in range(20)]
    assert ran_on == []  # submit only queues: the caller's coroutine is never blocked by encoding
    assert [await f for f in futures] == [n * n for n in range(20)]
    assert set(ran_on) == {threading.get_ident()}
    with pytest.raises(ZeroDivisionError):
        await pool.submit(divmod, 1, 0)
    assert not pool._workers  # no thread was started


async def test_without_threads_an_iteration_runs_jobs_for_the_budget_then_lets_the_loop_go_round(monkeypatch):
    # As when nothing else waits: the counting callback below would otherwise make encoding give way.
    monkeypatch.setattr(pool_module.loop_internals, "callbacks_waiting", lambda loop: False)
    pool = EncodePool(threads=0)
    loop = asyncio.get_running_loop()
    job_s = pool_module.LOOP_BUDGET_S / 2
    iterations_seen: list[int] = []
    iteration = 0

    def count_iterations() -> None:
        nonlocal iteration
        iteration += 1
        if pool._here:
            loop.call_soon(count_iterations)

    def job() -> None:
        iterations_seen.append(iteration)
        until = time.perf_counter() + job_s
        while time.perf_counter() < until:
            pass

    futures = [pool.submit(job) for _ in range(12)]
    loop.call_soon(count_iterations)
    await asyncio.gather(*futures)
    per_iteration = [iterations_seen.count(i) for i in sorted(set(iterations_seen))]
    # Half the budget each: the budget runs out after two or three jobs, never all twelve at once.
    assert max(per_iteration) <= 3, per_iteration
    assert len(per_iteration) >= 4, per_iteration


async def test_without_threads_encoding_waits_while_other_callbacks_are_ready(monkeypatch):
    """The frames a tick releases go before encoding: a job starts only in a turn where
    nothing else waits, here after a chain of six callbacks, each scheduling the next."""
    monkeypatch.setattr(pool_module, "MAX_YIELD_S", 60.0)  # no forced run, however slow the machine
    pool = EncodePool(threads=0)
    loop = asyncio.get_running_loop()
    events: list[str] = []

    def other(n: int) -> None:
        events.append(f"other{n}")
        if n < 5:
            loop.call_soon(other, n + 1)

    job = pool.submit(events.append, "job")
    loop.call_soon(other, 0)
    await job
    assert events == [f"other{n}" for n in range(6)] + ["job"]


async def test_without_threads_a_failing_job_fails_alone():
    """A job's exception goes to its awaiting coroutine, and the loop's later jobs still run,
    even for exceptions a future refuses (StopIteration) or that are not Exceptions."""

    class Abort(BaseException):
        pass

    def stop() -> None:
        raise StopIteration

    def abort() -> None:
        raise Abort

    for threads in (0, 1):
        pool = EncodePool(threads=threads)
        stopped, aborted = pool.submit(stop), pool.submit(abort)
        after = pool.submit(pow, 2, 5)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await stopped
        with pytest.raises(Abort):
            await aborted
        assert await after == 32
        assert await pool.submit(pow, 3, 2) == 9


def test_without_threads_a_loop_closed_with_jobs_queued_is_forgotten():
    pool = EncodePool(threads=0)

    async def submit_only() -> None:
        pool.submit(int, "1")

    async def submit_and_wait() -> int:
        return await pool.submit(int, "2")

    asyncio.run(submit_only())
    assert len(pool._here) == 1  # its loop closed with the job queued
    assert asyncio.run(submit_and_wait()) == 2
    assert not pool._here


async def test_without_threads_a_loop_that_is_never_idle_still_encodes(monkeypatch):
    """Giving way is bounded by MAX_YIELD_S: callbacks that never stop do not starve encoding."""
    monkeypatch.setattr(pool_module, "MAX_YIELD_S", 0.002)
    pool = EncodePool(threads=0)
    loop = asyncio.get_running_loop()
    turns_before_the_jobs = 0
    jobs = [pool.submit(int, str(n)) for n in range(3)]

    def busy() -> None:
        nonlocal turns_before_the_jobs
        if not jobs[0].done():
            turns_before_the_jobs += 1
        if not all(job.done() for job in jobs):
            loop.call_soon(busy)

    loop.call_soon(busy)
    assert await asyncio.gather(*jobs) == [0, 1, 2]
    assert turns_before_the_jobs > 1  # it did give way first


async def test_without_threads_first_audio_jumps_the_queue_and_cancelled_jobs_are_skipped():
    pool = EncodePool(threads=0)
    order: list[str] = []
    later = [pool.submit(order.append, f"later{n}", priority=LATER) for n in range(3)]
    later[1].cancel()
    first = pool.submit(order.append, "first", priority=FIRST)
    await asyncio.gather(first, later[0], later[2])
    assert order == ["first", "later0", "later2"]


def test_auto_is_a_thread_per_core_beyond_the_loops_and_at_least_one(monkeypatch):
    for cores, threads in ((1, 1), (2, 1), (4, 3), (16, 15)):
        monkeypatch.setattr(pool_module.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert default_threads() == threads
        assert parse_threads("auto") == threads


def test_by_default_speech_is_encoded_on_the_event_loop():
    assert parse_threads(Settings().encode_threads) == 0
    assert EncodePool().threads == 0


def test_encode_threads_setting_is_checked_and_says_what_to_give():
    assert parse_threads("0") == 0 and parse_threads("3") == 3
    for bad in ("x", "-1", "65", "1.5", ""):
        with pytest.raises(ConfigError, match="--encode-threads .*give auto or 0 to 64"):
            Settings(encode_threads=bad).check()


async def test_configure_after_the_threads_started_is_refused():
    pool = EncodePool(threads=1)
    await pool.submit(int, "1")
    with pytest.raises(RuntimeError, match="configure it before the first job"):
        pool.configure(0)
    idle = EncodePool(threads=1)
    idle.configure(0)
    assert idle.threads == 0


async def test_a_default_server_encodes_on_its_event_loop_speaks_and_starts_no_thread(server_factory):
    """The default (--encode-threads 0) end to end: a real aiortc listener hears the utterance's
    tones, and the server has as many threads after the speech as before (threads would start
    at the first job)."""
    from voxgate.engine import tone
    from voxgate.rtc_client import RtcClient

    server = server_factory("tone")
    async with RtcClient(server.url) as client:
        threads = len(os.listdir(f"/proc/{server.proc.pid}/task"))
        sent = client.send({"type": "speak", "text": "ab", "id": "u1"})
        await client.wait_for("utterance.done", id="u1", timeout=20)
        await client.audio.wait_frames(10, since=sent, timeout=10)
        assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == "ab"
        assert len(os.listdir(f"/proc/{server.proc.pid}/task")) == threads
