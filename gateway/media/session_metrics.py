"""What a session reports about itself: the hooks Prometheus (and a benchmark) listen on.

The session, its feeder and its output call these hooks at the moments that
matter for latency (first audio, a cancel, each frame's departure). The
gateway's metrics point them at Prometheus (`gateway/load/metrics.py`,
`GatewayMetrics`); anything else that wants the same samples
(bench/bench_gateway.py) adds itself as an observer there
(`GatewayMetrics.observers`), and `SessionMetricsFanOut` hands every sample to
each of them, so nobody has to patch the session to watch it.
"""

from __future__ import annotations


class SessionMetrics:
    """Hooks the signaling layer points at Prometheus; no-ops by default.

    Times are seconds; `at` arguments are `time.perf_counter()` values.
    """

    def ttfa(self, seconds: float) -> None: ...
    def ttfa_parts(self, to_first_frames: float, to_departure: float) -> None:
        """TTFA in two: from ready to the first encoded frames in the playout (text, engine,
        resampling, encoding), then from there to the first departure (pre-roll, the next tick)."""

    def first_chunk(self, seconds: float) -> None: ...
    def aggregation_wait(self, seconds: float) -> None: ...
    def interrupted(self, reason: str, at: float) -> None:
        """A cancel, barge-in or error emptied the session at `at`: where cancel-to-silence starts."""

    def cancel_to_silence(self, seconds: float) -> None: ...
    def utterance(self, outcome: str) -> None: ...
    def frame_sent(self, interval: float, lateness: float) -> None: ...
    def keepalive(self, frames: int) -> None:
        """A DTX keep-alive between utterances left, covering `frames` frames of RTP time."""

    def underrun(self, output: str) -> None:
        """The playout had nothing to send inside an utterance; `output`: webrtc or telephony."""
    def engine_chunk(self, synth_s: float, audio_s: float) -> None: ...
    def opus_signal_switch(self, signal: str) -> None:
        """With --opus-signal auto, the listener's loss turned in-band FEC on (voice) or off (music)."""

    def error(self, code: str) -> None:
        """An `error` event went to a client (a refused message, an engine or recognizer failure)."""

    def ice_dropped(self, reason: str) -> None:
        """The session's ICE guard dropped a datagram or a check (gateway/webrtc/ice.py's IceGuard)."""

    def mic_dropped(self, reason: str) -> None:
        """A datagram from the peer dropped unread by a bound: `ssrc` (gateway/media/ssrcs.py), `packet_rate`
        or `media_rate` (gateway/caller/mic.py)."""


HOOKS = tuple(name for name in vars(SessionMetrics) if not name.startswith("_"))


class SessionMetricsFanOut(SessionMetrics):
    """Every hook, passed on to each observer in turn (Prometheus first)."""

    def __init__(self, *observers: SessionMetrics) -> None:
        self.observers = observers


def _forward(name: str):
    def hook(self: SessionMetricsFanOut, *args) -> None:
        for observer in self.observers:
            getattr(observer, name)(*args)

    hook.__name__ = hook.__qualname__ = name
    return hook


# One forwarding method per hook, made from the list above, so a new hook cannot be forgotten here.
for _name in HOOKS:
    setattr(SessionMetricsFanOut, _name, _forward(_name))
