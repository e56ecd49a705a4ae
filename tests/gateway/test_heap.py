"""The server's heap after start-up (signaling/server.py settle_heap): out of the collector's reach."""

from __future__ import annotations

import gc

from voxgate.signaling.server import settle_heap


def test_start_up_objects_leave_the_collectors_walk_and_later_ones_do_not():
    """Red if settle_heap stops freezing: every full collection would walk the start-up heap
    again, with the event loop and every session's frames stopped behind it."""
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        settle_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules and everything else this process made so far
        gc.collect()
        # A collection leaves the frozen heap alone (a thaw would take it to 0). Other
        # threads of this test process (an engine's load sampler, a client's reader)
        # may free a few frozen objects they held at the freeze: that is not a thaw.
        assert frozen - 100 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
