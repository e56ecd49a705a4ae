"""Prometheus metrics, one registry per gateway so tests can run several in a process."""

from __future__ import annotations

import gc
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from ..media.session_metrics import SessionMetrics, SessionMetricsFanOut

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
JITTER_BUCKETS = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttfa = Histogram("voxgate_ttfa_seconds", "Server-side time to first audio: first text in to first packet out", buckets=LATENCY_BUCKETS, registry=r)
        self.first_chunk = Histogram("voxgate_engine_first_chunk_seconds", "Engine time to first chunk of an utterance", ["engine"], buckets=LATENCY_BUCKETS, registry=r)
        self.aggregation_wait = Histogram("voxgate_text_aggregation_wait_seconds", "Time text waited in the segmenter before the first unit went to the engine", buckets=LATENCY_BUCKETS, registry=r)
        self.cancel_to_silence = Histogram("voxgate_cancel_to_silence_seconds", "Cancel or barge-in to the first silent packet", buckets=LATENCY_BUCKETS, registry=r)
        self.late_frames = Counter("voxgate_pacer_late_frames_total", "Frames sent more than 5 ms after their deadline", registry=r)
        self.keepalive_frames = Counter("voxgate_pacer_dtx_frames_total",
                                        "Frames between utterances covered by DTX keep-alives (one packet per 20 frames) "
                                        "instead of being sent", registry=r)
        self.underruns = Counter("voxgate_pacer_underruns_total", "Underruns inside an utterance, filled with silence", registry=r)
        self.jitter = Histogram("voxgate_pacer_departure_jitter_seconds", "Absolute deviation of inter-departure intervals from 20 ms", buckets=JITTER_BUCKETS, registry=r)
        # Frames sent, and late, as plain counts for admission (prometheus_client keeps the metrics' values private).
        self.frames_sent = self.frames_late = 0
        self.sessions = Gauge("voxgate_active_sessions", "Open sessions", registry=r)
        self.utterances_active = Gauge("voxgate_active_utterances", "Utterances queued or playing", registry=r)
        self.utterances = Counter("voxgate_utterances_total", "Utterances by outcome", ["outcome"], registry=r)
        self.engine_streams = Gauge("voxgate_engine_queue_depth", "Engine streams open in the worker", registry=r)
        self.engine_rtf = Histogram("voxgate_engine_rtf", "Engine real-time factor per chunk (synthesis time / audio time)", buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=r)
        self.worker_restarts = Counter("voxgate_engine_worker_restarts_total", "Engine worker restarts", registry=r)
        self.loop_lag = Histogram("voxgate_event_loop_lag_seconds", "Event-loop lag measured by a 100 ms ticker", buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0), registry=r)
        self.gc_pauses = CollectionPauses()
        r.register(self.gc_pauses)
        self.rejected = Counter("voxgate_sessions_rejected_total",
                                "Sessions and speech requests refused, by reason (gateway/load/admission.py REASONS)",
                                ["reason"], registry=r)
        # Admission's view of the node (gateway/load/admission.py), as real-time factors: seconds of audio per second.
        self.synthesis_budget = Gauge("voxgate_synthesis_budget_rtf",
                                      "Seconds of audio per second this node can speak, measured (-1: not measured yet)",
                                      registry=r)
        self.synthesis_demand = Gauge("voxgate_synthesis_demand_rtf",
                                      "Seconds of audio per second asked of this node: now (sessions speaking, requests), "
                                      "or expected (admission's plan: the others at --talk-share or their own recent share)",
                                      ["kind"], registry=r)
        self.synthesis_cost = Gauge("voxgate_synthesis_cost",
                                    "Cores one speaking session takes: engine (synthesis, core-seconds per audio second; "
                                    "0 with a pool) and media (this process), measured", ["part"], registry=r)
        self.talk_share = Gauge("voxgate_talk_share", "Share of session time spent speaking, over the last minutes "
                                "(to choose --talk-share from)", registry=r)
        self.speech_underruns = Counter("voxgate_speech_underruns_total",
                                        "Speech that ran out inside an utterance, by where: engine (a chunk of a started "
                                        "stream made after its listener's audio ran out), webrtc or telephony (the "
                                        "playout had no frame to send)", ["where"], registry=r)
        for where in ("engine", "webrtc", "telephony"):
            self.speech_underruns.labels(where)
        self.relay_connections = Counter("voxgate_relay_connections_total", "ConversationRelay connections by outcome: "
                                         "connected, ended, or why one failed", ["outcome"], registry=r)
        self.errors = Counter("voxgate_protocol_errors_total", "Error events sent to clients", ["code"], registry=r)
        self.opus_signal = Counter("voxgate_opus_signal_switches_total",
                                   "Sessions' Opus signal switches on their listeners' loss: to voice (in-band FEC on) or music",
                                   ["to"], registry=r)
        self.http_refused = Counter("voxgate_http_connections_refused_total",
                                    "HTTP connections refused with 503 at --max-connections or "
                                    "--max-connections-per-ip", ["reason"], registry=r)
        self.ice_dropped = Counter("voxgate_ice_dropped_total",
                                   "STUN datagrams and checks the sessions' ICE guards dropped (gateway/webrtc/ice.py): "
                                   "candidate_limit, stun_rate, check_budget, error", ["reason"], registry=r)
        self.mic_dropped = Counter("voxgate_mic_dropped_total",
                                   "WebRTC peers' RTP and RTCP dropped unread by a bound: ssrc (not one of the "
                                   "session's --max-ssrcs), packet_rate (--mic-max-packets-per-s), media_rate "
                                   "(RTP time faster than real time plus a margin)", ["reason"], registry=r)
        for reason in ("ssrc", "packet_rate", "media_rate"):
            self.mic_dropped.labels(reason)
        self.fast_path = Gauge("voxgate_fast_path_active",
                               "1 where a media fast path below aiortc's public API applies (gateway/media/rtc_internals.py, "
                               "checked at start against the installed aiortc, aioice and pylibsrtp; rtp_sender and "
                               "direct_wire 0 with --rtp-sender aiortc), 0 where aiortc's own path runs", ["path"], registry=r)
        self.caller_audio_frames = Counter("voxgate_caller_audio_frames_total",
                                           "Frames of callers' audio for backends that asked for it (?audio=pcm16): sent, "
                                           "or dropped because the backend read too slowly", ["outcome"], registry=r)
        self.stt_turns = Counter("voxgate_stt_turns_total",
                                 "Caller turns (or --stt-max-turn-s pieces) given to the recognizer: transcript, or "
                                 "the error they got instead (stt_busy: it could not keep up; stt_timeout; stt_failed)",
                                 ["outcome"], registry=r)
        for outcome in ("transcript", "stt_busy", "stt_timeout", "stt_failed"):
            self.stt_turns.labels(outcome)
        # Whatever else wants every session's samples (a benchmark's recorder), beside Prometheus;
        # read when a session is made.
        self.observers: list[SessionMetrics] = []

    def watch_collections(self) -> None:
        """Time every garbage collection from now until `unwatch_collections()`."""
        self.gc_pauses.watch()

    def unwatch_collections(self) -> None:
        self.gc_pauses.unwatch()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def for_session(self, engine: str) -> SessionMetrics:
        prometheus = _SessionMetrics(self, engine)
        return SessionMetricsFanOut(prometheus, *self.observers) if self.observers else prometheus


class CollectionPauses:
    """`voxgate_gc_pause_seconds`: how long each garbage collection held the process, by generation.

    A full collection (generation 2) stops every session's frames while it runs. The gc
    callback only adds to plain lists, and the histogram is built when /metrics is read.
    The callback must take no lock: a collection can start while this thread holds one
    (prometheus_client's metric locks among them), and taking that lock again would hang
    the event loop for good.
    """

    NAME = "voxgate_gc_pause_seconds"
    HELP = "Time a garbage collection held the process, every session's frames waiting behind it, by generation (2: a full collection)"

    def __init__(self) -> None:
        self._counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]  # per generation; the last bucket is +Inf
        self._sums = [0.0, 0.0, 0.0]
        self._started: float | None = None  # collections do not nest, and any thread's holds the GIL

    def watch(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def unwatch(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        generation = min(int(info["generation"]), 2)
        self._counts[generation][bisect_left(PAUSE_BUCKETS, pause)] += 1
        self._sums[generation] += pause

    def collect(self):
        family = HistogramMetricFamily(self.NAME, self.HELP, labels=["generation"])
        for generation, counts in enumerate(self._counts):
            if not any(counts):
                continue  # a series starts at its generation's first collection, as labelled histograms do
            buckets, total = [], 0
            for bound, count in zip((*(repr(b) for b in PAUSE_BUCKETS), "+Inf"), counts):
                total += count
                buckets.append((bound, total))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family


class _SessionMetrics(SessionMetrics):
    def __init__(self, metrics: GatewayMetrics, engine: str) -> None:
        self.m = metrics
        self.engine = engine

    def ttfa(self, seconds: float) -> None:
        self.m.ttfa.observe(seconds)

    def first_chunk(self, seconds: float) -> None:
        self.m.first_chunk.labels(self.engine).observe(seconds)

    def aggregation_wait(self, seconds: float) -> None:
        self.m.aggregation_wait.observe(seconds)

    def cancel_to_silence(self, seconds: float) -> None:
        self.m.cancel_to_silence.observe(seconds)

    def utterance(self, outcome: str) -> None:
        self.m.utterances.labels(outcome).inc()

    def frame_sent(self, interval: float, lateness: float) -> None:
        m = self.m
        m.jitter.observe(abs(interval - 0.020))
        m.frames_sent += 1
        if lateness > 0.005:
            m.late_frames.inc()
            m.frames_late += 1

    def keepalive(self, frames: int) -> None:
        self.m.keepalive_frames.inc(frames)

    def underrun(self, output: str) -> None:
        self.m.underruns.inc()
        self.m.speech_underruns.labels(output).inc()

    def engine_chunk(self, synth_s: float, audio_s: float) -> None:
        self.m.engine_rtf.observe(synth_s / audio_s)

    def opus_signal_switch(self, signal: str) -> None:
        self.m.opus_signal.labels(signal).inc()

    def ice_dropped(self, reason: str) -> None:
        self.m.ice_dropped.labels(reason).inc()

    def mic_dropped(self, reason: str) -> None:
        self.m.mic_dropped.labels(reason).inc()

    def error(self, code: str) -> None:
        self.m.errors.labels(code).inc()
