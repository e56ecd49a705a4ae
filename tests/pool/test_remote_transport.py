"""RemoteTransport's playout deadline (engine/cluster/remote.py), reckoned as the worker's Scheduler does.

The deadline it sends with each request to the pool is computed in the
gateway's process from the stream's own fields and the stream queued before
it; the fields are set by hand here, so nothing depends on timing. The
requests themselves are tested against a real pool in test_pool.py.
"""

from __future__ import annotations

import time

import pytest

from voxgate.engine.cluster.remote_stream import RemoteTransport


class NoStreams:
    """A client without the transports' streams: their request tasks end at once."""

    def stream_of(self, sid: int) -> None:
        return None


async def test_a_queued_stream_follows_its_predecessor_until_that_one_is_done():
    client = NoStreams()
    first = RemoteTransport(client, 1, {}, 4.0)
    queued = RemoteTransport(client, 2, {}, 0.0, after=first)
    first.end_input()  # its text has ended, not its audio
    first.first_audio_at, first.audio_s = time.monotonic(), 1.0
    assert queued.start() == pytest.approx(first.deadline()) and queued.after is first
    first.audio_s = 2.0  # more audio arrives: the queued stream's start moves with it
    assert queued.start() == pytest.approx(first.deadline())
    assert queued.deadline_in() > 5.0
    first.done = True  # all of it has arrived: its deadline is fixed, and kept as a time
    start = queued.start()
    assert start == pytest.approx(first.deadline()) and queued.after is None and queued.start_at == start


async def test_a_stream_behind_a_cancelled_one_is_needed_from_its_own_start():
    client = NoStreams()
    first = RemoteTransport(client, 1, {}, 4.0)
    queued = RemoteTransport(client, 2, {}, 0.0, after=first)
    assert queued.deadline_in() > 3.0
    first.cancel()
    assert queued.deadline_in() < 0.5 and queued.after is None


async def test_audio_held_back_brings_the_deadline_forward():
    client = NoStreams()
    now = time.monotonic()
    plain, held = RemoteTransport(client, 1, {}, 0.0), RemoteTransport(client, 2, {}, 0.0, held_s=0.2)
    for t in (plain, held):
        t.first_audio_at, t.audio_s = now, 2.0
    assert held.deadline() == pytest.approx(plain.deadline() - 0.2, abs=0.01)
