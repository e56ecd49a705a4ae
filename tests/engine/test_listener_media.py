"""The gateway's own worker plans each listener's media with its synthesis (issue 41): a burst
starts no more streams than the node's cores carry with the gateway encoding them, before the
other processes' smoothed load has caught up with the burst."""

from __future__ import annotations

import pytest

from voxgate.engine.runtime.capacity import LISTENER_MEDIA_COST, RESERVE, CoreShare, SynthesisCost
from voxgate.engine.registry import create_engine
from voxgate.engine.runtime.scheduler import Scheduler


@pytest.fixture
def scheduler():
    def make(media_cost: float, others: float, speaking: int) -> Scheduler:
        share = CoreShare((0,), cores=2.0)
        share.others = others
        s = Scheduler(create_engine("tone"), send=lambda *a: None, parallel=2, cost=SynthesisCost(6.0, 100.0),
                      share=share, media_cost=media_cost)
        s.speaking = lambda: speaking
        made.append(s)
        return s

    made: list[Scheduler] = []
    yield make
    for s in made:
        s.pool.shutdown()


def test_a_burst_is_planned_with_each_listeners_media(scheduler):
    synthesis = 0.06
    # At a burst's start nothing else is measured yet: the media is charged per listener all the same.
    assert scheduler(LISTENER_MEDIA_COST, 0.0, 0).capacity() == pytest.approx(2.0 * (1 - RESERVE) / (synthesis + LISTENER_MEDIA_COST))
    # Once the others' load shows the listeners' media, it is not counted twice.
    steady = scheduler(LISTENER_MEDIA_COST, 20 * LISTENER_MEDIA_COST + 0.2, 20).capacity()
    assert steady == pytest.approx(1.8 * (1 - RESERVE) / (synthesis + LISTENER_MEDIA_COST))
    # A pool replica (no gateway beside it) plans with synthesis alone.
    assert scheduler(0.0, 0.0, 0).capacity() == pytest.approx(2.0 * (1 - RESERVE) / synthesis)
