"""gateway/load/late_blame.py: whose work made the frames late."""

from __future__ import annotations

from voxgate.gateway.load.late_blame import BLAME_MIN_CORES, LateBlame


class Link:
    def __init__(self) -> None:
        self.shed_for: list[str] = []

    def shed(self, why: str) -> None:
        self.shed_for.append(why)


def test_the_tenant_whose_work_dominates_is_blamed_and_its_costliest_source_shed():
    blame = LateBlame(10.0)
    small, big, other = Link(), Link(), Link()
    blame.charge("key:a", 1.0, small)
    blame.charge("key:a", 3.0, big)
    blame.charge("key:b", 0.5, other)
    blame.tick(1.0, own_cpu_s=8.0, late=True)  # a: 4 of 8 s, 0.4 cores
    assert blame.culprit == "key:a"
    assert big.shed_for and not small.shed_for and not other.shed_for  # 3 of its 4: half is reached
    blame.tick(1.0, own_cpu_s=1.0, late=False)
    assert blame.culprit is None  # frames on time: nobody is to blame


def test_nobody_is_blamed_when_no_one_tenants_work_explains_the_load():
    blame = LateBlame(10.0)
    blame.charge("key:a", 1.0)
    blame.charge("key:b", 1.0)
    blame.tick(1.0, own_cpu_s=12.0, late=True)  # each a twelfth: the node is simply full
    assert blame.culprit is None
    blame = LateBlame(10.0)
    blame.charge("key:a", 0.5 * BLAME_MIN_CORES * 10.0)
    blame.tick(1.0, own_cpu_s=0.6 * BLAME_MIN_CORES * 10.0, late=True)  # most of little: too little to matter
    assert blame.culprit is None


def test_charges_decay_over_the_window_and_ended_sources_are_forgotten():
    blame = LateBlame(10.0)
    link = Link()
    blame.charge("key:a", 5.0, link)
    blame.forget(link)
    for _ in range(200):  # e^-20 of it: under the floor, so gone
        blame.tick(1.0, own_cpu_s=0.0, late=False)
    assert blame.load("key:a") == 0.0
    blame.tick(1.0, own_cpu_s=0.0, late=True)
    assert blame.culprit is None and not link.shed_for


def test_many_small_sources_are_shed_half_at_a_time():
    blame = LateBlame(10.0)
    links = [Link() for _ in range(100)]
    for link in links:
        blame.charge("key:a", 0.05, link)
    blame.tick(1.0, own_cpu_s=6.0, late=True)
    assert sum(bool(link.shed_for) for link in links) in (50, 51)  # half of their cost (floating point)
