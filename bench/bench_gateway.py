"""The gateway: time to first audio, pacer jitter, capacity, cancel-to-silence.

    python bench/bench_gateway.py           # about 5-6 minutes on 2 cores
    python bench/bench_gateway.py --quick   # under 2 minutes: fewer runs, shorter windows

The gateway runs in a child process started by this script (`--serve`, below):
the real `create_app` on loopback, exactly what `voxgate serve` runs, plus a
few read-only /bench routes that hand out the pacer's statistics, raw metric
samples, event-loop lag and CPU time. The clients are `voxgate.rtc_client.
RtcClient` aiortc peers in this process, over real UDP on 127.0.0.1, so the
server's figures are not mixed with the clients' work (but the two share the
machine's cores).

1. Time to first audio (Piper, the embedded voice). Server side: the
   `audio.started.ttfa_ms` the server reports (data-channel message in to the
   first Opus packet handed to RTP), paired per utterance with the engine
   first-chunk time the server itself measured for that utterance, and set
   against the engine's own first-chunk time from an `EngineClient` in this
   process with the server's engine settings, measured in the same run.
   Targets: server p50 within 10 ms of the engine's first chunk; at most 50 ms
   for a short first clause. Client side: send time to the first decoded
   non-silent frame, and the same minus the receive-side delay, which is
   estimated with the tone engine (whose synthesis takes ~0 ms): client time
   to sound - server ttfa = data channel + network + aiortc's jitter buffer
   (capacity 16, prefetch 4: about 80 ms) + decode.
2. Pacer (light load: one Piper session speaking continuously, 60 s; 15 s
   with --quick). Inter-departure intervals at the pacer (stdev, p99, max),
   late frames (> 5 ms after their deadline) and stalls, the same intervals
   measured where packets enter SRTP (wire), and event-loop lag sampled every
   10 ms in the server. Target: p99 within 2 ms of 20 ms.
3. Capacity (tone engine, continuous speech). Sessions ramp 5, 10, 20, 40, ...
   For each step, over a fixed window: late frames and stalls at the pacers,
   wire intervals over 25 ms, and CPU per session (server process + engine
   worker CPU time / window / sessions). The baseline is a server whose
   track returns 48 kHz PCM `av.AudioFrame`s so that aiortc encodes them
   itself (`PcmTrack` below; the rest of the server unchanged). Both servers
   run side by side; at each step the product's window and the baseline's
   alternate, the other server paused, so both see the same background load.
   Capacity = the largest step with every frame on time; CPU-bound capacity =
   1 / CPU per real-time session (CPU time per frame sent x 50), taken at the
   largest step where late frames stayed under 20%. Target: 3x the baseline's
   sessions per core. The capacity clients skip Opus decoding (their decoder
   is replaced by one that drops the packets) so that 2 cores are left for
   the server; everything on the server side is real.
4. Cancel to silence (Piper). Server side: the session's own measurement,
   cancel message handled to the next (silent) packet leaving, the samples
   behind the `voxgate_cancel_to_silence_seconds` histogram. Client side:
   send time of cancel to the arrival of the last non-silent decoded frame
   (this includes the receive-side delay of 1., reported beside it).

Figures go to stdout and to artifacts/bench-gateway.json; the child's log to
artifacts/bench-gateway-server-*.log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    ARTIFACTS,
    arg_parser,
    finish,
    fmt_ms,
    machine,
    percentile,
    print_machine,
    proc_cpu_s,
    section,
    summary_ms,
)

HELLO = "Hello!"
SURE = "Sure, "
CLAUSE = "Of course, I can help you with that."
TTFA_TEXTS = (HELLO, SURE, CLAUSE)
CANCEL_TEXT = (
    "Let me read the whole order back to you so that you can check every line of it before we go ahead, "
    "starting with the first item on the list."
)
PARAGRAPH = (
    "Thanks for calling the support line. I have pulled up your account and I can see the order you placed "
    "last Tuesday. It left our warehouse this morning and it should arrive tomorrow afternoon, "
    "although the carrier says there may be a short delay because of the weather in your area. "
    "If nobody is at home, the driver will leave it with a neighbour or at the nearest pick-up point. "
)
TONE_TEXT = "the quick brown fox jumps over the lazy dog. " * 22  # about 990 bytes: 40 s of tone speech
# Capacity load: utterances of 5.4 s, two queued at all times, so each session speaks
# without a break while its feeder encodes no further ahead than a real agent's would.
TONE_UTTERANCE = "the quick brown fox jumps over the lazy dog. " * 3


# ---------------------------------------------------------------------------
# The child process: the real gateway plus read-only bench routes.


class WireClock:
    """Inter-departure intervals of RTP packets as they enter SRTP, per DTLS transport."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.intervals: deque = deque(maxlen=3000)
        self.packets = 0
        self.gaps_over_25ms = 0

    def tick(self, now: float) -> None:
        self.packets += 1
        if self.last is not None:
            gap = now - self.last
            self.intervals.append(gap)
            if gap > 0.025:
                self.gaps_over_25ms += 1
        self.last = now


def run_server(mode: str, engine: str, port: int) -> None:
    import av
    from aiohttp import web
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
    from aiortc.rtcdtlstransport import RTCDtlsTransport
    from aiortc.rtp import is_rtcp

    from voxgate.config import Settings
    from voxgate.engine import tone
    from voxgate.gateway import peer as peer_module
    from voxgate.gateway.pacer import Pacer
    from voxgate.gateway.playout import Playout
    from voxgate.gateway.session import Session, SessionMetrics
    from voxgate.signaling.server import create_app

    logging.basicConfig(level=logging.WARNING)
    # Diagnosis only: a shorter GIL switch interval than Python's 5 ms.
    switch_ms = os.environ.get("VOXGATE_BENCH_SWITCH_INTERVAL_MS")
    if switch_ms:
        sys.setswitchinterval(float(switch_ms) / 1000.0)
    # Diagnosis only: fewer encoder threads than the session module's 2.
    encode_threads = os.environ.get("VOXGATE_BENCH_ENCODE_THREADS")
    if encode_threads:
        from concurrent.futures import ThreadPoolExecutor

        from voxgate.gateway import session as session_module

        session_module._encode_pool = ThreadPoolExecutor(int(encode_threads), thread_name_prefix="encode")

    # Where each RTP packet leaves: just before SRTP protection.
    clocks: dict[int, WireClock] = {}
    original_send_rtp = RTCDtlsTransport._send_rtp

    async def timed_send_rtp(self, data: bytes) -> None:
        if not is_rtcp(data):
            clocks.setdefault(id(self), WireClock()).tick(time.monotonic())
        await original_send_rtp(self, data)

    RTCDtlsTransport._send_rtp = timed_send_rtp

    speech48k = tone.encode(TONE_TEXT, 48000)

    class PcmTrack(MediaStreamTrack):
        """The baseline: raw 48 kHz PCM frames that aiortc resamples and encodes itself,
        on the same pacer as the real track so that lateness is measured the same way."""

        kind = "audio"

        def __init__(self, playout=None, clock_rate: int = 48000, pacer: Pacer | None = None) -> None:
            super().__init__()
            self.pacer = pacer or Pacer()
            self.on_departure = None
            self._pts = 0

        def set_clock_rate(self, clock_rate: int) -> None:
            pass

        async def recv(self) -> av.AudioFrame:
            if self.readyState != "live":
                raise MediaStreamError
            now = await self.pacer.wait()
            start = self._pts % (len(speech48k) - 960)
            frame = av.AudioFrame.from_ndarray(speech48k[start : start + 960].reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = 48000
            frame.pts = self._pts
            frame.time_base = Fraction(1, 48000)
            self._pts += 960
            if self.on_departure is not None:
                self.on_departure(now)
            return frame

    if mode == "baseline":
        peer_module.SpeechTrack = PcmTrack

    # The capacity comparison runs one server at a time: a paused track sends nothing.
    gate = asyncio.Event()
    gate.set()
    track_class = peer_module.SpeechTrack
    original_recv = track_class.recv

    async def gated_recv(self):
        if not gate.is_set():
            await gate.wait()
            # Start a fresh schedule: the pause is not lateness.
            self.pacer._deadline = None
            self.pacer._last_departure = None
        return await original_recv(self)

    track_class.recv = gated_recv

    settings = Settings(
        host="127.0.0.1", port=port, ice_host=["127.0.0.1"], engine=engine, web=False,
        max_sessions=1000, log_level="WARNING",
    )
    app = create_app(settings)
    gw = app["gateway"]
    raw: dict[str, list[float]] = {"ttfa": [], "first_chunk": [], "aggregation_wait": [], "cancel_to_silence": []}
    lag: list[float] = []

    class RecordingMetrics(SessionMetrics):
        """Keeps each sample the session reports, then passes it on to Prometheus."""

        def __init__(self, inner: SessionMetrics) -> None:
            self.inner = inner

        def ttfa(self, seconds: float) -> None:
            raw["ttfa"].append(seconds)
            self.inner.ttfa(seconds)

        def first_chunk(self, seconds: float) -> None:
            raw["first_chunk"].append(seconds)
            self.inner.first_chunk(seconds)

        def aggregation_wait(self, seconds: float) -> None:
            raw["aggregation_wait"].append(seconds)
            self.inner.aggregation_wait(seconds)

        def cancel_to_silence(self, seconds: float) -> None:
            raw["cancel_to_silence"].append(seconds)
            self.inner.cancel_to_silence(seconds)

        def utterance(self, outcome: str) -> None:
            self.inner.utterance(outcome)

    for_session = gw.metrics.for_session
    gw.metrics.for_session = lambda engine_name: RecordingMetrics(for_session(engine_name))

    # Where time to first audio goes: the first encoded frames reach the playout, then
    # the pacer's next tick sends the first one.
    raw["ready_to_first_frames_queued"] = []
    raw["first_frames_queued_to_departure"] = []
    original_push = Playout.push

    def timed_push(self, utt, frames) -> None:
        if frames and not hasattr(utt, "bench_first_push"):
            utt.bench_first_push = time.perf_counter()
        original_push(self, utt, frames)

    Playout.push = timed_push
    original_started = Session._on_audio_started

    def timed_started(self, play, at: float) -> None:
        pushed = getattr(play, "bench_first_push", None)
        if pushed is not None and play.ready_at is not None:
            raw["ready_to_first_frames_queued"].append(pushed - play.ready_at)
            raw["first_frames_queued_to_departure"].append(at - pushed)
        original_started(self, play, at)

    Session._on_audio_started = timed_started

    async def sample_lag() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            lag.append(time.monotonic() - t0 - 0.01)

    def tracks() -> dict:
        out = {}
        for sid, peer in list(gw.peers.items()):
            if peer.track is None:
                continue
            transport = None
            for sender in peer.pc.getSenders():
                transport = sender.transport
            out[sid] = (peer.track, clocks.get(id(transport)) if transport is not None else None)
        return out

    async def stats(request: web.Request) -> web.Response:
        with_jitter = request.query.get("jitter") == "1"
        sessions = {}
        for sid, (track, wire) in tracks().items():
            s = track.pacer.stats
            row = {"frames": s.frames, "late": s.late_frames, "stalls": s.stalls}
            session = gw.sessions.get(sid)
            if session is not None:
                row["speaking"] = session.playout.current is not None
                row["underruns"] = session.playout.stats.underruns
            if wire is not None:
                row["wire_packets"] = wire.packets
                row["wire_gaps_over_25ms"] = wire.gaps_over_25ms
            if with_jitter:
                row["jitter"] = s.jitter()
                if wire is not None:
                    row["wire_jitter"] = _interval_stats(list(wire.intervals))
            sessions[sid] = row
        worker = gw.engine.worker_pid
        return web.json_response(
            {
                "t": time.monotonic(),
                "cpu_s": time.process_time(),
                "worker_cpu_s": proc_cpu_s(worker) if worker else 0.0,
                "sessions": sessions,
                "loop_lag_ms": summary_ms(lag),
                "engine": gw.engine.info.get("engine"),
            }
        )

    async def reset(request: web.Request) -> web.Response:
        for track, wire in tracks().values():
            track.pacer.stats.intervals.clear()
            if wire is not None:
                wire.intervals.clear()
        lag.clear()
        for samples in raw.values():
            samples.clear()
        return web.json_response({"ok": True})

    async def raw_samples(request: web.Request) -> web.Response:
        return web.json_response(raw)

    async def pause(request: web.Request) -> web.Response:
        gate.clear()
        return web.json_response({"ok": True})

    async def resume(request: web.Request) -> web.Response:
        gate.set()
        return web.json_response({"ok": True})

    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    app.router.add_get("/bench/raw", raw_samples)
    app.router.add_post("/bench/pause", pause)
    app.router.add_post("/bench/resume", resume)

    async def start_lag(app) -> None:
        app["lag_task"] = asyncio.ensure_future(sample_lag())
        # Diagnosis: log every event-loop callback slower than this (asyncio debug mode).
        slow_ms = os.environ.get("VOXGATE_BENCH_SLOW_CALLBACK_MS")
        if slow_ms:
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = float(slow_ms) / 1000.0

    app.on_startup.append(start_lag)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


def _interval_stats(xs: list[float]) -> dict:
    if not xs:
        return {"count": 0}
    ms = [x * 1000.0 for x in xs]
    return {
        "count": len(ms),
        "mean_ms": round(statistics.fmean(ms), 3),
        "stdev_ms": round(statistics.pstdev(ms), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
    }


# ---------------------------------------------------------------------------
# The parent: clients and figures.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    """The gateway in a child process; its pid is ours to stop."""

    def __init__(self, mode: str, engine: str) -> None:
        self.mode, self.engine = mode, engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log_path = os.path.join(ARTIFACTS, f"bench-gateway-server-{mode}-{engine}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", mode, "--engine", engine, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = None

    async def start(self, timeout: float = 90.0) -> "BenchServer":
        import aiohttp

        self.http = aiohttp.ClientSession()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bench server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                async with self.http.get(self.url + "/readyz") as resp:
                    if resp.status == 200:
                        return self
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"bench server not ready after {timeout} s; see {self.log_path}")

    async def stats(self, jitter: bool = False) -> dict:
        async with self.http.get(self.url + "/bench/stats" + ("?jitter=1" if jitter else "")) as resp:
            return await resp.json()

    async def reset(self) -> None:
        await self.post("/bench/reset")

    async def post(self, path: str) -> None:
        async with self.http.post(self.url + path) as resp:
            await resp.read()

    async def raw(self) -> dict:
        async with self.http.get(self.url + "/bench/raw") as resp:
            return await resp.json()

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            for _ in range(100):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def connect(url: str):
    from voxgate.rtc_client import RtcClient

    client = RtcClient(url)
    await client.connect(timeout=30.0)
    return client


class _DropDecoder:
    """Capacity clients only: drop received packets instead of decoding them."""

    def decode(self, encoded_frame) -> list:
        return []


def light_clients(on: bool) -> None:
    import aiortc.rtcrtpreceiver as receiver

    if not hasattr(receiver, "_bench_get_decoder"):
        receiver._bench_get_decoder = receiver.get_decoder
    receiver.get_decoder = (lambda codec: _DropDecoder()) if on else receiver._bench_get_decoder


# 1. Time to first audio


async def start_engine_here():
    """An EngineClient in this process with the server's engine defaults."""
    from voxgate.config import Settings
    from voxgate.engine.client import EngineClient, EngineConfig

    s = Settings()
    client = EngineClient(
        EngineConfig(engine="piper", parallel=s.parallel, threads=s.engine_threads, first_unit_timeout=s.first_unit_timeout_ms / 1000.0)
    )
    await client.start()
    return client


async def engine_first_chunk(engine, text: str) -> float:
    from voxgate.engine.base import SynthesisOptions

    stream = engine.stream(SynthesisOptions())
    t0 = time.perf_counter()
    stream.push_text(text)
    stream.end_input()
    first = None
    async for _chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
    return first or float("nan")


async def ttfa_runs(client, server: BenchServer, texts: tuple[str, ...], reps: int, engine=None) -> dict:
    """speak each text reps times; server ttfa, server first chunk, client time to sound.
    With an engine here, its first chunk for the same text is measured just before each one."""
    await server.reset()
    rows: dict[str, dict[str, list[float]]] = {t: {"server": [], "client": [], "engine": [], "order": []} for t in texts}
    n = 0
    for rep in range(reps):
        for text in texts:
            if engine is not None:
                rows[text]["engine"].append(await engine_first_chunk(engine, text))
            uid = f"t{rep}-{texts.index(text)}-{random.randrange(1 << 30)}"
            t_send = client.send({"type": "speak", "text": text, "id": uid})
            started = await client.wait_for("audio.started", id=uid, timeout=30)
            await client.wait_for("utterance.done", id=uid, timeout=60)
            await asyncio.sleep(0.3)  # let the tail and the jitter buffer drain
            heard = client.audio.first_sound_after(t_send)
            rows[text]["server"].append(started["ttfa_ms"] / 1000.0)
            rows[text]["client"].append((heard - t_send) if heard else float("nan"))
            rows[text]["order"].append(n)
            n += 1
    raw = await server.raw()
    for text in texts:
        for key, name in (
            ("first_chunk", "server_first_chunk"),
            ("ready_to_first_frames_queued", "server_queued"),
            ("first_frames_queued_to_departure", "server_tick_wait"),
        ):
            rows[text][name] = [raw[key][i] for i in rows[text]["order"] if i < len(raw[key])]
    return rows


async def time_to_first_audio(reps: int) -> dict:
    section("1. time to first audio (Piper, embedded voice)")
    tone_server = await BenchServer("product", "tone").start()
    try:
        client = await connect(tone_server.url)
        await asyncio.sleep(0.5)
        tone_rows = await ttfa_runs(client, tone_server, ("ok",), reps)
        await client.close()
    finally:
        await tone_server.stop()
    r = tone_rows["ok"]
    rx = [c - s for c, s in zip(r["client"], r["server"]) if not math.isnan(c)]
    rx_p50 = percentile(rx, 50)
    print(
        f"receive-side delay (tone engine: client time to sound - server ttfa) {fmt_ms(summary_ms(rx))}; "
        f"tone server ttfa {fmt_ms(summary_ms(r['server']))}"
    )

    server = await BenchServer("product", "piper").start()
    out: dict = {"receive_delay_ms": summary_ms(rx), "tone_server_ttfa_ms": summary_ms(r["server"]), "texts": {}}
    engine = await start_engine_here()
    try:
        client = await connect(server.url)
        await asyncio.sleep(0.5)
        rows = await ttfa_runs(client, server, TTFA_TEXTS, reps, engine)
        await client.close()
    finally:
        await engine.close()
    for text in TTFA_TEXTS:
        row = rows[text]
        e = summary_ms(row["engine"])
        s = summary_ms(row["server"])
        sfc = summary_ms(row["server_first_chunk"])
        gap = [a - b for a, b in zip(row["server"], row["server_first_chunk"])]
        encode = [q - f for q, f in zip(row["server_queued"], row["server_first_chunk"])]
        paired = [a - b for a, b in zip(row["server"], row["engine"])]
        client_ms = summary_ms([c for c in row["client"] if not math.isnan(c)])
        adjusted = summary_ms([c - rx_p50 for c in row["client"] if not math.isnan(c)])
        delta = round(s["p50"] - e["p50"], 1)
        out["texts"][text] = {
            "engine_first_chunk_ms": e,
            "server_ttfa_ms": s,
            "server_p50_minus_engine_p50_ms": delta,
            "server_minus_engine_paired_ms": summary_ms(paired),
            "within_10ms_of_engine": delta <= 10.0,
            "at_most_50ms": s["p50"] <= 50.0,
            "server_engine_first_chunk_ms": sfc,
            "server_ttfa_minus_its_first_chunk_ms": summary_ms(gap),
            "server_first_chunk_to_frames_queued_ms": summary_ms(encode),
            "server_frames_queued_to_departure_ms": summary_ms(row["server_tick_wait"]),
            "client_time_to_sound_ms": client_ms,
            "client_minus_receive_delay_ms": adjusted,
        }
        print(f"{text!r}")
        print(f"   engine first chunk (EngineClient here)    {fmt_ms(e)}")
        print(f"   server ttfa (audio.started.ttfa_ms)       {fmt_ms(s)}   p50 - engine p50 = {delta:+.1f} ms "
              f"({'within' if delta <= 10 else 'OVER'} 10 ms; {'<=' if s['p50'] <= 50 else 'OVER'} 50 ms)")
        print(f"   server ttfa - engine here, run by run     {fmt_ms(summary_ms(paired))}")
        print(f"   server's own first chunk, same utterance  {fmt_ms(sfc)}")
        print(f"   server ttfa - that first chunk            {fmt_ms(summary_ms(gap))}")
        print(f"     of which resample+encode+queue          {fmt_ms(summary_ms(encode))}")
        print(f"     of which waiting for the pacer's tick   {fmt_ms(summary_ms(row['server_tick_wait']))}")
        print(f"   client: send to first sound               {fmt_ms(client_ms)}")
        print(f"   client minus receive delay ({rx_p50*1000:.0f} ms)      {fmt_ms(adjusted)}")
    out["_server"] = server
    return out


# 4. Cancel to silence


async def cancel_runs(server: BenchServer, reps: int, rx_p50_ms: float) -> dict:
    section("4. cancel to silence (Piper)")
    client = await connect(server.url)
    await asyncio.sleep(0.5)
    await server.reset()
    observed = []
    try:
        for rep in range(reps):
            uid = f"c{rep}"
            client.send({"type": "speak", "text": CANCEL_TEXT, "id": uid})
            await client.wait_for("audio.started", id=uid, timeout=30)
            await asyncio.sleep(random.uniform(0.3, 0.9))
            t_cancel = client.send({"type": "cancel"})
            await client.wait_for("utterance.interrupted", id=uid, timeout=10)
            await asyncio.sleep(0.5)
            last = client.audio.last_sound()
            observed.append((last - t_cancel) if last else float("nan"))
    finally:
        await client.close()
    raw = await server.raw()
    server_side = summary_ms(raw["cancel_to_silence"])
    client_side = summary_ms([x for x in observed if not math.isnan(x)])
    print(f"server: cancel handled to next (silent) packet   {fmt_ms(server_side, ('p50', 'max'))}")
    print(f"client: cancel sent to last non-silent frame     {fmt_ms(client_side, ('p50', 'max'))}  (receive-side delay p50 {rx_p50_ms:.0f} ms)")
    return {"server_ms": server_side, "client_ms": client_side, "receive_delay_p50_ms": rx_p50_ms}


# 2. Pacer


async def pacer_run(server: BenchServer, window: float) -> dict:
    section(f"2. pacer: one Piper session speaking continuously, {window:.0f} s")
    client = await connect(server.url)
    try:
        await asyncio.sleep(0.5)
        # Enough text to keep speaking past the window (about 25 s of speech each).
        n_utts = max(2, int(window / 20) + 2)
        for i in range(n_utts):
            client.send({"type": "speak", "text": PARAGRAPH, "id": f"p{i}"})
        await client.wait_for("audio.started", id="p0", timeout=30)
        await asyncio.sleep(1.0)
        await server.reset()
        s0 = await server.stats()
        await asyncio.sleep(window)
        s1 = await server.stats(jitter=True)
        done = [e for _, e in client.event_log if e.get("type") == "utterance.done"]
        client.send({"type": "cancel"})
    finally:
        await client.close()
    sid = client.session_id
    a, b = s0["sessions"][sid], s1["sessions"][sid]
    jit = b["jitter"]
    wire = b.get("wire_jitter", {})
    out = {
        "window_s": window,
        "frames": b["frames"] - a["frames"],
        "late_frames": b["late"] - a["late"],
        "stalls": b["stalls"] - a["stalls"],
        "pacer_intervals": jit,
        "wire_intervals": wire,
        "wire_gaps_over_25ms": b.get("wire_gaps_over_25ms", 0) - a.get("wire_gaps_over_25ms", 0),
        "loop_lag_ms": s1["loop_lag_ms"],
        "utterances_finished_in_window": len(done),
        "p99_within_2ms": abs(jit["p99_ms"] - 20.0) <= 2.0,
        "server_cpu_cores": round((s1["cpu_s"] - s0["cpu_s"]) / (s1["t"] - s0["t"]), 3),
        "worker_cpu_cores": round((s1["worker_cpu_s"] - s0["worker_cpu_s"]) / (s1["t"] - s0["t"]), 3),
    }
    print(
        f"pacer: {out['frames']} frames, interval mean {jit['mean_ms']:.3f} stdev {jit['stdev_ms']:.3f} p99 {jit['p99_ms']:.3f} "
        f"max {jit['max_ms']:.3f} ms; late {out['late_frames']}, stalls {out['stalls']} -> p99 "
        f"{'within' if out['p99_within_2ms'] else 'NOT within'} 2 ms of 20 ms"
    )
    if wire.get("count"):
        print(
            f"wire (into SRTP): stdev {wire['stdev_ms']:.3f} p99 {wire['p99_ms']:.3f} max {wire['max_ms']:.3f} ms; "
            f"gaps over 25 ms {out['wire_gaps_over_25ms']}"
        )
    lag = out["loop_lag_ms"]
    print(f"event-loop lag (10 ms ticker) ms {fmt_ms(lag, ('p50', 'p95', 'max'))}")
    print(f"server CPU {out['server_cpu_cores']*100:.1f}% of a core, engine worker {out['worker_cpu_cores']*100:.1f}%")
    return out


# 3. Capacity


async def keep_speaking(client) -> None:
    """Two utterances queued at all times: a new one each time one is done."""
    n = 0
    for _ in range(2):
        client.send({"type": "speak", "text": TONE_UTTERANCE, "id": f"s{n}"})
        n += 1
    try:
        while True:
            # Long timeout: a paused side sends nothing and finishes nothing.
            await client.wait_for("utterance.done", timeout=3600)
            client.send({"type": "speak", "text": TONE_UTTERANCE, "id": f"s{n}"})
            n += 1
    except (asyncio.TimeoutError, ConnectionError) as exc:
        print(f"   a session stopped speaking: {type(exc).__name__}: {exc}")


class Side:
    """One server of the capacity comparison and its sessions, paused between its windows."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.server = BenchServer(mode, "tone")
        self.clients: list = []
        self.speakers: list[asyncio.Task] = []
        self.rows: list[dict] = []
        self.done = False

    async def grow(self, n: int) -> float:
        t0 = time.monotonic()
        while len(self.clients) < n:
            batch = min(5, n - len(self.clients))
            new = await asyncio.gather(*(connect(self.server.url) for _ in range(batch)))
            if self.mode == "product":
                self.speakers.extend(asyncio.ensure_future(keep_speaking(c)) for c in new)
            self.clients.extend(new)
        return time.monotonic() - t0

    async def measure(self, n: int, window: float) -> dict:
        await self.server.post("/bench/resume")
        connect_s = await self.grow(n)
        await asyncio.sleep(2.0)
        s0 = await self.server.stats()
        await self.server.reset()
        c0 = time.process_time()
        await asyncio.sleep(window)
        s1 = await self.server.stats()
        c1 = time.process_time()
        await self.server.post("/bench/pause")
        dt = s1["t"] - s0["t"]
        late = stalls = frames = wire_gaps = short = underruns = speaking = 0
        for sid, b in s1["sessions"].items():
            a = s0["sessions"].get(sid)
            if a is None:
                continue
            late += b["late"] - a["late"]
            stalls += b["stalls"] - a["stalls"]
            frames += b["frames"] - a["frames"]
            wire_gaps += b.get("wire_gaps_over_25ms", 0) - a.get("wire_gaps_over_25ms", 0)
            underruns += b.get("underruns", 0) - a.get("underruns", 0)
            speaking += bool(b.get("speaking"))
            if b["frames"] - a["frames"] < 0.9 * dt * 50:
                short += 1
        server_cores = (s1["cpu_s"] - s0["cpu_s"]) / dt
        worker_cores = (s1["worker_cpu_s"] - s0["worker_cpu_s"]) / dt
        row = {
            "sessions": n,
            "window_s": round(dt, 2),
            "frames": frames,
            "expected_frames": int(n * dt * 50),
            "late_frames": late,
            "stalls": stalls,
            "late_pct": round(100.0 * (late + stalls) / max(1, frames), 3),
            "wire_gaps_over_25ms": wire_gaps,
            "sessions_short_of_frames": short,
            "sessions_speaking_at_end": speaking if self.mode == "product" else None,
            "playout_underruns": underruns if self.mode == "product" else None,
            "server_cpu_cores": round(server_cores, 3),
            "worker_cpu_cores": round(worker_cores, 3),
            "cpu_per_session_pct": round((server_cores + worker_cores) / n * 100.0, 2),
            # Per session that got all its 50 frames/s: fair where a saturated side sent fewer.
            "cpu_per_realtime_session_pct": round((server_cores + worker_cores) * dt / max(1, frames) * 50 * 100.0, 2),
            "client_cpu_cores": round((c1 - c0) / dt, 3),
            "loop_lag_ms": s1["loop_lag_ms"],
            "connect_s": round(connect_s, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        self.rows.append(row)
        lag = row["loop_lag_ms"]
        print(
            f"   {self.mode:8s} {n:3d} sessions: late {late:4d} stalls {stalls:3d} ({row['late_pct']:5.2f}%), wire gaps>25ms {wire_gaps:4d}, "
            f"CPU/rt session {row['cpu_per_realtime_session_pct']:5.2f}% (server {server_cores*100:3.0f}% + worker {worker_cores*100:2.0f}%), "
            f"loop lag p95 {lag.get('p95', float('nan')):5.1f} max {lag.get('max', float('nan')):5.1f} ms, load {row['loadavg_1m']}",
            flush=True,
        )
        # Far past the point of late frames, or out of CPU: larger steps would tell nothing new.
        # (Not at the first late frame: on a shared machine a neighbour's burst causes some.)
        if row["late_pct"] > 50.0 or server_cores + worker_cores > 1.8:
            self.done = True
        return row

    async def close(self) -> None:
        for task in self.speakers:
            task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        await self.server.stop()


def capacity_figures(rows: list[dict]) -> dict:
    clean = [r["sessions"] for r in rows if r["late_frames"] + r["stalls"] == 0]
    first_late = next((r["sessions"] for r in rows if r["late_frames"] + r["stalls"] > 0), None)
    tolerant = [r["sessions"] for r in rows if r["late_pct"] <= 0.1]
    # CPU per real-time session from the largest step that still kept up (late <= 20%),
    # where fixed costs weigh least; a saturated step understates it.
    usable = [r for r in rows if r["late_pct"] <= 20.0] or rows[:1]
    biggest = max(usable, key=lambda r: r["sessions"]) if usable else None
    per_session = biggest["cpu_per_realtime_session_pct"] / 100.0 if biggest else float("nan")
    return {
        "max_sessions_all_on_time": max(clean) if clean else 0,
        "first_step_with_late_frames": first_late,
        "max_sessions_late_under_0.1pct": max(tolerant) if tolerant else 0,
        "cpu_per_session_pct": round(per_session * 100.0, 3),
        "cpu_measured_at_sessions": biggest["sessions"] if biggest else None,
        "sessions_per_core_by_cpu": round(1.0 / per_session, 1) if per_session > 0 else None,
    }


async def capacity(steps: list[int], window: float, budget_s: float) -> dict:
    section(
        f"3. capacity: tone engine, continuous speech, {window:.0f} s windows; pre-encoded track (product) "
        "vs a PCM track that aiortc encodes (baseline), in alternation"
    )
    light_clients(True)
    deadline = time.monotonic() + budget_s
    product, baseline = Side("product"), Side("baseline")
    try:
        await product.server.start()
        await baseline.server.start()
        await product.server.post("/bench/pause")
        await baseline.server.post("/bench/pause")
        for n in steps:
            sides = [s for s in (product, baseline) if not s.done]
            need = sum(window + 3 + 0.3 * max(0, n - len(s.clients)) for s in sides)
            if not sides or time.monotonic() + need > deadline:
                if sides:
                    print(f"   stopping before {n} sessions (time budget)")
                break
            for side in sides:
                await side.measure(n, window)
    finally:
        light_clients(False)
        await product.close()
        await baseline.close()
    p, b = capacity_figures(product.rows), capacity_figures(baseline.rows)
    cores = os.cpu_count() or 1
    out = {"product": {"steps": product.rows, **p}, "baseline": {"steps": baseline.rows, **b}, "cores": cores}
    # Same-step comparison: CPU per real-time session at every step both reached, and
    # the headline at the largest step where both still kept up (late <= 20%).
    by_n = {r["sessions"]: r for r in baseline.rows}
    out["steps_compared"] = []
    for pr in product.rows:
        br = by_n.get(pr["sessions"])
        if br is None:
            continue
        a, b2 = pr["cpu_per_realtime_session_pct"], br["cpu_per_realtime_session_pct"]
        out["steps_compared"].append(
            {
                "sessions": pr["sessions"],
                "product_cpu_per_realtime_session_pct": a,
                "baseline_cpu_per_realtime_session_pct": b2,
                "cpu_ratio_baseline_over_product": round(b2 / a, 2) if a else None,
                "product_late_pct": pr["late_pct"],
                "baseline_late_pct": br["late_pct"],
            }
        )
    kept_up = [c for c in out["steps_compared"] if c["product_late_pct"] <= 20.0 and c["baseline_late_pct"] <= 20.0]
    if kept_up or out["steps_compared"]:
        out["same_step"] = (kept_up or out["steps_compared"][:1])[-1]
    if b["max_sessions_all_on_time"]:
        out["on_time_sessions_ratio"] = round(p["max_sessions_all_on_time"] / b["max_sessions_all_on_time"], 2)
    else:
        out["on_time_sessions_ratio"] = None
    for name, f in (("product", p), ("baseline", b)):
        print(
            f"{name:8s}: every frame on time up to {f['max_sessions_all_on_time']} sessions (first late frames at "
            f"{f['first_step_with_late_frames']}; late <= 0.1% up to {f['max_sessions_late_under_0.1pct']}); "
            f"CPU per real-time session {f['cpu_per_session_pct']:.2f}% (at {f['cpu_measured_at_sessions']}) -> {f['sessions_per_core_by_cpu']} sessions/core by CPU"
        )
    if "same_step" in out:
        s = out["same_step"]
        for c in out["steps_compared"]:
            print(
                f"   {c['sessions']:3d} sessions: CPU per real-time session baseline/product = {c['cpu_ratio_baseline_over_product']}x "
                f"(late {c['product_late_pct']:.2f}% vs {c['baseline_late_pct']:.2f}%)"
            )
        print(
            f"headline at {s['sessions']} sessions: baseline/product CPU = {s['cpu_ratio_baseline_over_product']}x; "
            f"on-time sessions product/baseline = {out['on_time_sessions_ratio']}x (target >= 3x sessions per core)"
        )
    return out


async def main(args: argparse.Namespace) -> None:
    quick = args.quick
    started = time.perf_counter()
    before = machine()
    print_machine(before, "machine at start")
    results: dict = {"quick": quick, "machine_start": before}
    reps = 6 if quick else 20
    ttfa = await time_to_first_audio(reps)
    server: BenchServer = ttfa.pop("_server")
    results["ttfa"] = ttfa
    rx_p50 = ttfa["receive_delay_ms"].get("p50", float("nan"))
    try:
        results["cancel"] = await cancel_runs(server, 5 if quick else 15, rx_p50)
        results["pacer"] = await pacer_run(server, 15.0 if quick else 60.0)
    finally:
        await server.stop()
    if quick:
        results["capacity"] = await capacity([5, 10, 20], 4.0, 60.0)
    else:
        results["capacity"] = await capacity([5, 10, 20, 40, 60, 80], 8.0, 170.0)
    finish("gateway", results, started)


if __name__ == "__main__":
    parser = arg_parser(__doc__)
    parser.add_argument("--serve", choices=("product", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="tone", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_server(args.serve, args.engine, args.port)
    else:
        asyncio.run(main(args))
