"""The encoding threads (gateway/encode_pool.py): results on the caller's loop, and the loop first on a busy core."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from voxgate.gateway.encode_pool import ENCODE_NICE, EncodePool


async def test_results_and_errors_arrive_on_the_calling_loop():
    pool = EncodePool(threads=2)
    results = [pool.submit(pow, 2, n) for n in range(20)]
    assert [await r for r in results] == [2**n for n in range(20)]
    with pytest.raises(ZeroDivisionError):
        await pool.submit(divmod, 1, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
async def test_encoding_threads_give_way_to_the_event_loop():
    """Red if the threads run at the loop's priority: a frame would then wait out an encoder's time slice."""
    pool = EncodePool(threads=1)

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    loop_nice = niceness()
    assert await pool.submit(niceness) == min(19, loop_nice + ENCODE_NICE)
    assert niceness() == loop_nice
