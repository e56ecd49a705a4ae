"""Session metrics hooks (gateway/media/session_metrics.py): the fan-out that lets a benchmark watch beside Prometheus."""

from __future__ import annotations

from voxgate.gateway.media.session_metrics import HOOKS, SessionMetrics, SessionMetricsFanOut
from voxgate.gateway.load.metrics import GatewayMetrics


class Calls(SessionMetrics):
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def __getattribute__(self, attr: str):
        if attr in HOOKS:
            return lambda *args: self.log.append((self.name, attr, args))
        return object.__getattribute__(self, attr)


def test_every_hook_reaches_every_observer_in_order():
    assert {"ttfa", "ttfa_parts", "interrupted", "frame_sent", "cancel_to_silence"} <= set(HOOKS)
    log: list = []
    fan = SessionMetricsFanOut(Calls(log, "a"), Calls(log, "b"))
    for hook in HOOKS:
        args = (1.0,) * (getattr(SessionMetrics, hook).__code__.co_argcount - 1)
        getattr(fan, hook)(*args)
    assert log == [(who, hook, log[2 * i][2]) for i, hook in enumerate(HOOKS) for who in ("a", "b")]


def test_gateway_metrics_adds_observers_beside_prometheus():
    metrics = GatewayMetrics()
    assert not isinstance(metrics.for_session("tone"), SessionMetricsFanOut)  # no observer: no extra call per frame
    log: list = []
    metrics.observers.append(Calls(log, "bench"))
    session_metrics = metrics.for_session("tone")
    session_metrics.ttfa(0.25)
    assert log == [("bench", "ttfa", (0.25,))]
    assert b"voxgate_ttfa_seconds_count 1.0" in metrics.render()
