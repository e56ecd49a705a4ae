"""The encoding threads (gateway/encode_pool.py): results and errors on the caller's loop."""

from __future__ import annotations

import pytest

from voxgate.gateway.encode_pool import EncodePool


async def test_results_and_errors_arrive_on_the_calling_loop():
    pool = EncodePool(threads=2)
    results = [pool.submit(pow, 2, n) for n in range(20)]
    assert [await r for r in results] == [2**n for n in range(20)]
    with pytest.raises(ZeroDivisionError):
        await pool.submit(divmod, 1, 0)
