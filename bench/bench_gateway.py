"""The gateway: time to first audio, pacer jitter, cancel-to-silence.
(Capacity, CPU per session against a plain aiortc server: bench/bench_capacity.py.)

    python bench/bench_gateway.py           # about 3-4 minutes on 2 cores
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
   first Opus packet handed to RTP). The gateway's share is settled by an A/B
   in the same server process: the server's own engine worker driven directly
   by its `EngineClient` (route /bench/engine_first_chunk: no session, no
   media), interleaved round by round with the utterances (direct before or
   after the utterance in turn), same text. Gateway share = server ttfa p50 -
   direct first chunk p50, with a 95 % bootstrap interval, and per round.
   This counts any delay the gateway causes its engine, which "server ttfa -
   the server's own first-chunk time for that utterance" (also printed) hides.
   Client side: send time to the first decoded non-silent frame, and the same
   minus the receive-side delay, which is estimated with the tone engine
   (whose synthesis takes ~0 ms): client time to sound - server ttfa = data
   channel + network + aiortc's jitter buffer + decode.
2. Pacer (light load: one Piper session speaking continuously, 60 s; 15 s
   with --quick). Inter-departure intervals at the pacer (stdev, p99, max),
   late frames (> 5 ms after their deadline) and stalls, the same intervals
   measured where packets enter SRTP (wire), and event-loop lag sampled every
   10 ms in the server. Target: p99 within 2 ms of 20 ms.
3. Cancel to silence (Piper), at a random point 0.3-0.9 s into speech.
   Wire: the client's cancel send time to the first silent RTP packet (the
   session's silence payload) handed to the server's DTLS transport; the
   server's clock and the client's are the same CLOCK_MONOTONIC
   (time.perf_counter on Linux). Client: send time of cancel to the first
   decoded frame at the aiortc client from which every later frame is silent
   (this includes aiortc's jitter buffer, see 1.). Also printed: the
   session's own `voxgate_cancel_to_silence_seconds` samples (interrupt() to
   the pacer's next departure, at most one tick).

Figures go to stdout and to artifacts/bench-gateway.json (or --out); the child's log to
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
import statistics
import subprocess
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    ARTIFACTS,
    arg_parser,
    finish,
    fmt_ms,
    free_port,
    machine,
    percentile,
    print_machine,
    proc_cpu_s,
    section,
    stop_server_async,
    summary_ci_ms,
    summary_ms,
)
from bench_streaming import first_chunk_s  # noqa: E402

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


# ---------------------------------------------------------------------------
# The child process: the real gateway plus read-only bench routes.


class WireClock:
    """Inter-departure intervals of RTP packets as they enter SRTP, per DTLS transport."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.intervals: deque = deque(maxlen=3000)
        # (perf_counter, RTP payload) of the latest packets, to find the first silent one after a cancel.
        self.log: deque = deque(maxlen=500)
        self.packets = 0
        self.gaps_over_25ms = 0

    def tick(self, now: float, payload: bytes = b"") -> None:
        self.packets += 1
        self.log.append((now, payload))
        if self.last is not None:
            gap = now - self.last
            self.intervals.append(gap)
            if gap > 0.025:
                self.gaps_over_25ms += 1
        self.last = now


def run_server(engine: str, port: int) -> None:
    from aiohttp import web
    from aiortc.rtcdtlstransport import RTCDtlsTransport
    from aiortc.rtp import RtpPacket, is_rtcp

    from voxgate.config import Settings
    from voxgate.gateway.media.session_metrics import SessionMetrics
    from voxgate.signaling.server import create_app

    logging.basicConfig(level=logging.WARNING)
    # Diagnosis only: a shorter GIL switch interval than Python's 5 ms.
    switch_ms = os.environ.get("VOXGATE_BENCH_SWITCH_INTERVAL_MS")
    if switch_ms:
        sys.setswitchinterval(float(switch_ms) / 1000.0)

    # Where each RTP packet leaves: handed to the DTLS transport, just before SRTP
    # protection and the socket. perf_counter is CLOCK_MONOTONIC on Linux, one clock
    # for every process, so these times compare with the clients' in the parent.
    # These patches are aiortc's and the direct wire's, not the product's logic: the moment
    # a packet enters SRTP lies inside them. The session's own samples come through
    # the product's seam below (GatewayMetrics.observers).
    clocks: dict[int, WireClock] = {}
    original_send_rtp = RTCDtlsTransport._send_rtp

    async def timed_send_rtp(self, data: bytes) -> None:
        if not is_rtcp(data):
            clocks.setdefault(id(self), WireClock()).tick(time.perf_counter(), RtpPacket.parse(data).payload)
        await original_send_rtp(self, data)

    RTCDtlsTransport._send_rtp = timed_send_rtp
    # The speech track's packets skip _send_rtp where they can (rtp_send.direct_wire: SRTP and
    # the socket in one call), so they are timed at the same point there: just before SRTP.
    from voxgate.gateway.media import rtp_send

    original_direct_wire = rtp_send.direct_wire

    def timed_direct_wire(dtls):
        send = original_direct_wire(dtls)
        if send is None:
            return None

        def timed(data: bytes) -> bool:
            at = time.perf_counter()
            if not send(data):
                return False  # not sent: _send_rtp sends (and times) it
            clocks.setdefault(id(dtls), WireClock()).tick(at, RtpPacket.parse(data).payload)
            return True

        return timed

    rtp_send.direct_wire = timed_direct_wire

    settings = Settings(
        host="127.0.0.1", port=port, ice_host=["127.0.0.1"], engine=engine, web=False,
        max_sessions=1000, log_level="WARNING",
    )
    app = create_app(settings)
    gw = app["gateway"]
    raw: dict[str, list[float]] = {
        key: []
        for key in (
            "ttfa", "first_chunk", "aggregation_wait", "cancel_to_silence",
            "ready_to_first_frames_queued", "first_frames_queued_to_departure", "interrupt_at",
        )
    }
    lag: list[float] = []

    class Recorder(SessionMetrics):
        """Keeps the samples every session reports (the product's seam: GatewayMetrics.observers;
        Prometheus gets them as well)."""

        def ttfa(self, seconds: float) -> None:
            raw["ttfa"].append(seconds)

        def ttfa_parts(self, to_first_frames: float, to_departure: float) -> None:
            # Where time to first audio goes: the first encoded frames reach the playout,
            # then the pacer's next tick sends the first one.
            raw["ready_to_first_frames_queued"].append(to_first_frames)
            raw["first_frames_queued_to_departure"].append(to_departure)

        def first_chunk(self, seconds: float) -> None:
            raw["first_chunk"].append(seconds)

        def aggregation_wait(self, seconds: float) -> None:
            raw["aggregation_wait"].append(seconds)

        def interrupted(self, reason: str, at: float) -> None:
            # When the session handled the cancel (the start of its own cancel-to-silence figure).
            raw["interrupt_at"].append(at)

        def cancel_to_silence(self, seconds: float) -> None:
            raw["cancel_to_silence"].append(seconds)

    gw.metrics.observers.append(Recorder())

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

    async def engine_first_chunk(request: web.Request) -> web.Response:
        """The server's own engine worker, driven directly by its EngineClient (no session, no
        media): push the text, end input, time to the first chunk; the rest is drained."""
        text = (await request.json())["text"]
        return web.json_response({"first_chunk_s": await first_chunk_s(gw.engine, text)})

    async def wire_silence(request: web.Request) -> web.Response:
        """The first silent RTP packet handed to a transport at or after `after` (perf_counter),
        and the last non-silent one before it, over the transports that sent packets since."""
        after = float(request.query["after"])
        silent = {s.playout.silence for s in gw.sessions.values()}
        found = None
        for wire in list(clocks.values()):
            log = [(t, p) for t, p in wire.log if t >= after]
            if not log:
                continue
            first_silent = next((t for t, p in log if p in silent), None)
            last_sound = max((t for t, p in log if p not in silent and (first_silent is None or t < first_silent)), default=None)
            found = {"first_silent_at": first_silent, "last_sound_at": last_sound, "packets": len(log)}
        return web.json_response(found or {})

    app.router.add_post("/bench/engine_first_chunk", engine_first_chunk)
    app.router.add_get("/bench/wire_silence", wire_silence)
    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    app.router.add_get("/bench/raw", raw_samples)

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


def median_difference_ci(a_s: list[float], b_s: list[float], n: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(a) - median(b), in ms (a and b resampled apart)."""
    a = [x * 1000.0 for x in a_s if not math.isnan(x)]
    b = [x * 1000.0 for x in b_s if not math.isnan(x)]
    if len(a) < 2 or len(b) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(1)
    diffs = sorted(
        percentile([rng.choice(a) for _ in a], 50) - percentile([rng.choice(b) for _ in b], 50) for _ in range(n)
    )
    return round(diffs[int(0.025 * n)], 1), round(diffs[int(0.975 * n) - 1], 1)


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


class BenchServer:
    """The gateway in a child process; its pid is ours to stop."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log_path = os.path.join(ARTIFACTS, f"bench-gateway-server-{engine}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--engine", engine, "--port", str(self.port)]
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
        await stop_server_async(self.proc, signal.SIGINT)
        self.log.close()


async def connect(url: str):
    from voxgate.rtc_client import RtcClient

    client = RtcClient(url)
    await client.connect(timeout=30.0)
    return client


# 1. Time to first audio


async def server_engine_first_chunk(server: BenchServer, text: str) -> float:
    """The server's own engine worker driven directly (no session): first chunk, seconds."""
    async with server.http.post(server.url + "/bench/engine_first_chunk", json={"text": text}) as resp:
        return (await resp.json())["first_chunk_s"]


async def ttfa_runs(client, server: BenchServer, texts: tuple[str, ...], reps: int, direct: bool = False) -> dict:
    """speak each text reps times; server ttfa, server first chunk, client time to sound.
    With `direct`, the server's own engine worker is also driven directly for the same text
    in each round (the A/B of the gateway's share), before or after the utterance in turn."""
    await server.reset()
    rows: dict[str, dict[str, list[float]]] = {t: {"server": [], "client": [], "engine": [], "order": []} for t in texts}
    n = 0
    for rep in range(reps):
        for text in texts:
            if direct and (rep + n) % 2 == 0:
                rows[text]["engine"].append(await server_engine_first_chunk(server, text))
            uid = f"t{rep}-{texts.index(text)}-{random.randrange(1 << 30)}"
            t_send = client.send({"type": "speak", "text": text, "id": uid})
            started = await client.wait_for("audio.started", id=uid, timeout=30)
            done = await client.wait_for("utterance.done", id=uid, timeout=60)
            await client.wait_tail(done)  # the tail and the jitter buffer have drained
            heard = client.audio.first_sound_after(t_send)
            rows[text]["server"].append(started["ttfa_ms"] / 1000.0)
            rows[text]["client"].append((heard - t_send) if heard else float("nan"))
            rows[text]["order"].append(n)
            if direct and (rep + n) % 2 == 1:
                rows[text]["engine"].append(await server_engine_first_chunk(server, text))
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
    tone_server = await BenchServer("tone").start()
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

    server = await BenchServer("piper").start()
    out: dict = {"receive_delay_ms": summary_ms(rx), "tone_server_ttfa_ms": summary_ms(r["server"]), "texts": {}}
    client = await connect(server.url)
    await asyncio.sleep(0.5)
    rows = await ttfa_runs(client, server, TTFA_TEXTS, reps, direct=True)
    await client.close()
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
        lo, hi = median_difference_ci(row["server"], row["engine"])
        out["texts"][text] = {
            "engine_first_chunk_ms": e,
            "engine_first_chunk_what": "the server's own engine worker, driven directly by its EngineClient in the server process, interleaved with the utterances",
            "server_ttfa_ms": s,
            "server_p50_minus_engine_p50_ms": delta,
            "server_p50_minus_engine_p50_ci95_ms": [lo, hi],
            "server_minus_engine_paired_ms": summary_ci_ms(paired),
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
        print(f"   engine first chunk (server's worker, direct) {fmt_ms(e)}")
        print(f"   server ttfa (audio.started.ttfa_ms)       {fmt_ms(s)}   p50 - engine p50 = {delta:+.1f} ms "
              f"[95% CI {lo:+.1f}, {hi:+.1f}] ({'within' if delta <= 10 else 'OVER'} 10 ms; {'<=' if s['p50'] <= 50 else 'OVER'} 50 ms)")
        print(f"   server ttfa - direct engine, same round   {fmt_ms(summary_ms(paired))}")
        print(f"   server's own first chunk, same utterance  {fmt_ms(sfc)}")
        print(f"   server ttfa - that first chunk            {fmt_ms(summary_ms(gap))}")
        print(f"     of which resample+encode+queue          {fmt_ms(summary_ms(encode))}")
        print(f"     of which waiting for the pacer's tick   {fmt_ms(summary_ms(row['server_tick_wait']))}")
        print(f"   client: send to first sound               {fmt_ms(client_ms)}")
        print(f"   client minus receive delay ({rx_p50*1000:.0f} ms)      {fmt_ms(adjusted)}")
    out["_server"] = server
    return out


# 4. Cancel to silence


def _rms(pcm) -> float:
    import numpy as np

    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if len(pcm) else 0.0


def lasting_silence_after(frames: list, since: float, threshold: float = 300.0) -> float | None:
    """Arrival of the first decoded frame after `since` from which every later frame is silent
    (RMS at most `threshold`, the same threshold as `first_sound_after`)."""
    after = [(t, p) for t, p in frames if t >= since]
    last_loud = max((i for i, (_, p) in enumerate(after) if _rms(p) > threshold), default=-1)
    if last_loud + 1 >= len(after):
        return None
    return after[last_loud + 1][0]


async def cancel_runs(server: BenchServer, reps: int, rx_p50_ms: float) -> dict:
    section("3. cancel to silence (Piper)")
    client = await connect(server.url)
    await asyncio.sleep(0.5)
    await server.reset()
    wire, wire_handled, dc, client_silent, client_last = [], [], [], [], []
    try:
        for rep in range(reps):
            uid = f"c{rep}"
            client.send({"type": "speak", "text": CANCEL_TEXT, "id": uid})
            await client.wait_for("audio.started", id=uid, timeout=30)
            await asyncio.sleep(random.uniform(0.3, 0.9))  # cancel at a random point of the speech
            t_cancel = client.send({"type": "cancel"})
            event = await client.wait_for("utterance.interrupted", id=uid, timeout=10)
            await client.wait_tail(event)  # everything sent before the event has been decoded
            async with server.http.get(server.url + "/bench/wire_silence", params={"after": repr(t_cancel)}) as resp:
                w = await resp.json()
            handled = [t for t in (await server.raw())["interrupt_at"] if t >= t_cancel]
            if w.get("first_silent_at") is not None:
                wire.append(w["first_silent_at"] - t_cancel)
                if handled:
                    wire_handled.append(w["first_silent_at"] - handled[0])
            if handled:
                dc.append(handled[0] - t_cancel)
            silent_at = lasting_silence_after(client.audio.frames, t_cancel)
            if silent_at is not None:
                client_silent.append(silent_at - t_cancel)
            last = client.audio.last_sound()
            if last is not None and last >= t_cancel:
                client_last.append(last - t_cancel)
    finally:
        await client.close()
    raw = await server.raw()
    out = {
        "reps": reps,
        "wire_ms": summary_ms(wire),
        "wire_what": "client sends cancel -> first silent RTP packet (the session's silence payload) handed to the server's DTLS transport, one monotonic clock",
        "wire_from_cancel_handled_ms": summary_ms(wire_handled),
        "data_channel_ms": summary_ms(dc),
        "data_channel_what": "client sends cancel -> Session.interrupt runs in the server",
        "server_metric_ms": summary_ms(raw["cancel_to_silence"]),
        "server_metric_what": "voxgate_cancel_to_silence_seconds: interrupt() -> the pacer's next departure (at most one 20 ms tick)",
        "client_ms": summary_ms(client_silent),
        "client_what": "client sends cancel -> first decoded frame (aiortc client) from which every later frame is silent (RMS <= 300)",
        "client_last_sound_ms": summary_ms(client_last),
        "receive_delay_p50_ms": rx_p50_ms,
    }
    keys = ("p50", "p95", "max")
    print(f"wire: cancel sent -> first silent RTP packet to transport   {fmt_ms(out['wire_ms'], keys)}")
    print(f"   of which data channel (cancel sent -> interrupt())      {fmt_ms(out['data_channel_ms'], keys)}")
    print(f"   interrupt() -> first silent RTP packet                  {fmt_ms(out['wire_from_cancel_handled_ms'], keys)}")
    print(f"server metric: interrupt() -> pacer's next departure       {fmt_ms(out['server_metric_ms'], keys)}")
    print(f"client: cancel sent -> first frame of lasting silence       {fmt_ms(out['client_ms'], keys)}  (receive-side delay p50 {rx_p50_ms:.0f} ms)")
    print(f"client: cancel sent -> last non-silent frame                {fmt_ms(out['client_last_sound_ms'], keys)}")
    return out


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


async def main(args: argparse.Namespace) -> None:
    quick = args.quick
    started = time.perf_counter()
    before = machine()
    print_machine(before, "machine at start")
    results: dict = {"quick": quick, "machine_start": before}
    reps = args.reps or (6 if quick else 20)
    ttfa = await time_to_first_audio(reps)
    server: BenchServer = ttfa.pop("_server")
    results["ttfa"] = ttfa
    rx_p50 = ttfa["receive_delay_ms"].get("p50", float("nan"))
    try:
        results["cancel"] = await cancel_runs(server, 5 if quick else 15, rx_p50)
        results["pacer"] = await pacer_run(server, 15.0 if quick else 60.0)
    finally:
        await server.stop()
    finish("gateway", results, started, args.out)


if __name__ == "__main__":
    parser = arg_parser(__doc__)
    parser.add_argument("--reps", type=int, default=0, help="rounds of each first-audio text (default 20; 6 with --quick)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="tone", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_server(args.engine, args.port)
    else:
        asyncio.run(main(args))
