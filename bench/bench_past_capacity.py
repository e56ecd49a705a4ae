"""Past capacity with the real voice (issue 41's Done-when): admitted speech never stutters,
the excess is refused at once, and a burst makes newcomers wait instead of stretching speech.

    python bench/bench_past_capacity.py --out bench/results/past-capacity.json   # ~4 minutes on 2 cores
    python bench/bench_past_capacity.py --quick                                  # the shorter reply, fewer sessions

One `voxgate serve` as users run it (default engine and voice, default settings, loopback
ICE), started and stopped by this script; the clients are `voxgate.rtc_client.RtcClient`
aiortc peers in this process over UDP on loopback, decoding real Opus and asking for DTX
between utterances as the bundled page does. The node's capacity C is what its admission
measures: the budget (`budget_rtf` on /readyz, seconds of audio per second) once the
server is up, so C sessions speaking at once.

1. 2x C, all speaking at once. 2*ceil(C) offers arrive one after another, each admitted
   session speaking its reply (about 14 s) from the moment it is connected (so the next
   offer finds it speaking). Per admitted session: wall time from its `audio.started` to
   its `utterance.done` (as they reach the client) over its `audio_ms`; client gaps over
   60 ms between decoded frames of the reply; whether it was ever refused or closed
   later. Per refused offer: status, code and reason, and how long the refusal took at the
   client (the POST's round trip).
2. A burst at 1.5x C of conversations. Offers arrive without speaking (each counted at the
   default --talk-share of 0.4) until admission refuses (at most --max-conversations);
   then round(1.5*C) of them speak a shorter reply at the same moment. Per utterance: TTFA
   (`audio.started` ttfa_ms), wall time over audio, client gaps over 60 ms once started;
   the server's `voxgate_speech_underruns_total` and `voxgate_pacer_underruns_total` over
   the burst. "Waiting" utterances are those beyond the first floor(C) to start (ranked by
   TTFA): their TTFA p50 and p95 are what the burst costs.

Client gaps are this process's too: its event loop's lag and its garbage collector's pauses
are reported beside them (`client_process`), with the server's late frames, loop lag and
underruns (`server`), so that a gap can be placed. The clients' objects are frozen out of
the collector for each arm (`gc.freeze()`, as the gateway does with its own).

Figures go to stdout and artifacts/bench-past-capacity.json (or --out).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import re
import subprocess
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    ARTIFACTS, arg_parser, finish, free_port, machine, percentile, print_machine, section, stop_server, wait_ready,
)

from voxgate.rtc_client import OfferRefused, RtcClient  # noqa: E402

GAP_S = 0.060
SOUND_RMS = 100.0  # int16 RMS over which a frame carries sound (-50 dBFS)
WALL_LIMIT = 1.03
REFUSAL_LIMIT_S = 0.100
REPLY = ("Thanks for calling. I have found your order, and it shipped on Monday from our warehouse in Ohio. "
         "It should arrive by Thursday afternoon. If it does not, call us back and we will send a replacement "
         "at no charge, or refund the full amount to your card within three business days.")
SHORT_REPLY = "Sure, I can help with that. Your order shipped on Monday, and it should arrive by Thursday afternoon."


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            m = re.match(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


class LoopWatch:
    """This process's own stalls (the clients'): the event loop's lag by a 10 ms ticker, and
    the garbage collector's pauses, so that a client gap can be told from a server's."""

    def __init__(self) -> None:
        self.lags: list[tuple[float, float]] = []  # (perf_counter, lag s) over 40 ms
        self.gc_pauses: list[tuple[float, float, int]] = []  # (perf_counter, s, generation) over 20 ms
        self._gc_at = 0.0
        self._task: asyncio.Task | None = None

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_at = time.perf_counter()
        elif time.perf_counter() - self._gc_at > 0.020:
            self.gc_pauses.append((time.perf_counter(), time.perf_counter() - self._gc_at, info.get("generation", -1)))

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.010)
            lag = time.perf_counter() - before - 0.010
            if lag > 0.040:
                self.lags.append((time.perf_counter(), lag))

    def __enter__(self) -> "LoopWatch":
        # The clients' own objects (every peer connected so far) are set aside from the
        # collector, as the gateway does with its own at start: a full collection over
        # 60 aiortc peers stalled this process 85 ms, which the listeners counted as gaps.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._gc)
        self._task = asyncio.ensure_future(self._tick())
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._gc)
        gc.unfreeze()
        if self._task is not None:
            self._task.cancel()

    def report(self) -> dict:
        return {"loop_lags_over_40ms": len(self.lags), "longest_loop_lag_ms": round(1000 * max((g for _, g in self.lags), default=0.0), 1),
                "gc_pauses_over_20ms": len(self.gc_pauses),
                "longest_gc_pause_ms": round(1000 * max((g for _, g, _ in self.gc_pauses), default=0.0), 1)}


def server_figures(m0: str, m1: str) -> dict:
    """What the server saw over an arm: its underruns, late frames and loop lag."""
    def delta(name: str) -> float:
        return metric(m1, name) - metric(m0, name)

    return {
        "speech_underruns": delta("voxgate_speech_underruns_total"),
        "pacer_underruns": delta("voxgate_pacer_underruns_total"),
        "late_frames": delta("voxgate_pacer_late_frames_total"),
        "frames": delta("voxgate_pacer_departure_jitter_seconds_count"),
        "loop_lag_ticks_over_100ms": delta("voxgate_event_loop_lag_seconds_count") - delta('voxgate_event_loop_lag_seconds_bucket{le="0.1"}'),
    }


class Server:
    """`voxgate serve` on loopback as users run it, with `extra` arguments, logging to ARTIFACTS/`log_name`."""

    def __init__(self, extra: list[str], log_name: str = "bench-past-capacity-server.log") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log = open(os.path.join(ARTIFACTS, log_name), "w")
        self.cmd = [sys.executable, "-m", "voxgate.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--ice-host", "127.0.0.1", "--no-web", *extra]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    async def get(self, path: str):
        async with aiohttp.ClientSession() as http:
            async with http.get(self.url + path) as resp:
                return resp.status, (await resp.json() if path == "/readyz" else await resp.text())

    async def wait_empty(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, ready = await self.get("/readyz")
            if ready["sessions"] == 0:
                return
            await asyncio.sleep(0.2)  # another process's state
        raise RuntimeError("sessions still open after the clients closed")

    def stop(self) -> None:
        stop_server(self.proc)
        self.log.close()


def gaps_between(client: RtcClient, start: dict, end: dict) -> list[tuple[int, float]]:
    """(index, inter-arrival time) of the decoded frames the server sent between two events,
    where the listener would hear it: a frame on either side carries sound. A pause the
    encoder sent as DTX (the listener asked for it: one packet per 400 ms of silence) is
    silence on both sides and is not a gap; a speech frame that came late is."""
    i, j = client.frame_index(start), client.frame_index(end)
    if i is None or j is None:
        return []
    frames = client.audio.frames[i:j]
    loud = [len(p) > 0 and float(np.sqrt(np.mean(p.astype(np.float64) ** 2))) > SOUND_RMS for _, p in frames]
    return [(k, b[0] - a[0]) for k, (a, b) in enumerate(zip(frames, frames[1:])) if loud[k] or loud[k + 1]]


async def utterance(client: RtcClient, uid: str, timeout: float) -> dict:
    """Wait for the utterance to play out; its figures at this client."""
    started = await client.wait_for_any(("audio.started", "session.closed", "utterance.interrupted"), timeout=timeout)
    if started["type"] != "audio.started":
        return {"ok": False, "why": started["type"]}
    done = await client.wait_for_any(("utterance.done", "session.closed", "utterance.interrupted"), timeout=timeout)
    if done["type"] != "utterance.done":
        return {"ok": False, "why": done["type"], "ttfa_ms": started.get("ttfa_ms")}
    await client.wait_tail(done)
    wall = client.arrival(done) - client.arrival(started)
    found = gaps_between(client, started, done)
    gaps = [g for _, g in found]
    late = [(k, round(1000 * g, 1)) for k, g in found if g > GAP_S]
    errors = [e for _, e in client.event_log if e.get("type") in ("error", "session.closed")]
    return {
        "ok": not errors, "why": errors[0].get("code", errors[0]["type"]) if errors else None,
        "ttfa_ms": started.get("ttfa_ms"), "audio_ms": done["audio_ms"], "wall_s": round(wall, 3),
        "wall_over_audio": round(wall / (done["audio_ms"] / 1000.0), 4),
        "gaps_over_60ms": sum(1 for g in gaps if g > GAP_S), "longest_gap_ms": round(1000 * max(gaps, default=0.0), 1),
        "frames": len(gaps) + 1 if gaps else 0,
        "gaps": late[:8],  # (frame, ms) of the first gaps over 60 ms
    }


async def offer(url: str) -> tuple[RtcClient | None, dict]:
    client = RtcClient(url, dtx=True)
    try:
        await client.connect()
    except OfferRefused as exc:
        await client.close()
        err = exc.body.get("error", {})
        return None, {"status": exc.status, "code": err.get("code"), "reason": err.get("reason"),
                      "retry_after": None, "refused_ms": round(1000 * (client.offer_s or float("nan")), 1)}
    return client, {"status": 200, "answered_ms": round(1000 * client.offer_s, 1)}


def summary(xs: list[float], digits: int = 1) -> dict:
    return {"n": len(xs), "p50": round(percentile(xs, 50), digits) if xs else None,
            "p95": round(percentile(xs, 95), digits) if xs else None, "max": round(max(xs), digits) if xs else None}


async def arm_twice(server: Server, capacity: float, sessions: int, reply: str) -> dict:
    _, m0 = await server.get("/metrics")
    admitted: list[tuple[int, RtcClient]] = []
    refused: list[dict] = []
    answers: list[dict] = []
    t0 = time.perf_counter()
    for i in range(sessions):
        client, info = await offer(server.url)
        info["arrival"] = i
        if client is None:
            refused.append(info)
            continue
        answers.append(info)
        client.send({"type": "speak", "text": reply, "id": f"r{i}"})
        await client.wait_for("utterance.queued", timeout=10.0)  # speaking: the next offer counts it
        admitted.append((i, client))
    arrivals_s = time.perf_counter() - t0
    with LoopWatch() as watch:
        results = await asyncio.gather(*(utterance(c, f"r{i}", 180.0) for i, c in admitted))
    _, m1 = await server.get("/metrics")
    for _, c in admitted:
        await c.close()
    await server.wait_empty()
    played = [r for r in results if r.get("audio_ms")]
    out = {
        "offers": sessions, "admitted": len(admitted), "refused": len(refused), "arrivals_s": round(arrivals_s, 2),
        "sessions": results, "refusals": refused, "answers_ms": summary([a["answered_ms"] for a in answers]),
        "refused_ms": summary([r["refused_ms"] for r in refused]),
        "refusal_codes": sorted({f"{r['status']} {r['code']} {r['reason']}" for r in refused}),
        "wall_over_audio": summary([r["wall_over_audio"] for r in played], 4),
        "gaps_over_60ms": sum(r["gaps_over_60ms"] for r in played),
        "longest_gap_ms": max((r["longest_gap_ms"] for r in played), default=None),
        "ttfa_ms": summary([r["ttfa_ms"] for r in played]),
        "refused_later": sum(1 for r in results if not r["ok"]),
        "server_underruns": {
            "speech": metric(m1, "voxgate_speech_underruns_total") - metric(m0, "voxgate_speech_underruns_total"),
            "pacer": metric(m1, "voxgate_pacer_underruns_total") - metric(m0, "voxgate_pacer_underruns_total"),
        },
        "server": server_figures(m0, m1), "client_process": watch.report(),
    }
    out["checks"] = {
        "every admitted wall <= 1.03x audio": all(r.get("wall_over_audio", 9) <= WALL_LIMIT for r in results),
        "0 client gaps > 60 ms": out["gaps_over_60ms"] == 0,
        "excess refused at_capacity": bool(refused) and all(r["status"] == 503 and r["code"] == "at_capacity" for r in refused),
        "refused within 100 ms": bool(refused) and all(r["refused_ms"] <= 1000 * REFUSAL_LIMIT_S for r in refused),
        "no admitted session refused later": out["refused_later"] == 0,
    }
    return out


async def arm_burst(server: Server, capacity: float, most: int, reply: str) -> dict:
    conversations: list[RtcClient] = []
    refusal = None
    for _ in range(most):
        client, info = await offer(server.url)
        if client is None:
            refusal = info
            break
        conversations.append(client)
    _, ready = await server.get("/readyz")
    speakers = min(len(conversations), round(1.5 * capacity))
    _, m0 = await server.get("/metrics")
    burst = conversations[:speakers]
    with LoopWatch() as watch:
        for i, c in enumerate(burst):
            c.send({"type": "speak", "text": reply, "id": f"b{i}"})
        results = await asyncio.gather(*(utterance(c, f"b{i}", 240.0) for i, c in enumerate(burst)))
    _, m1 = await server.get("/metrics")
    for c in conversations:
        await c.close()
    await server.wait_empty()
    ttfas = sorted(r["ttfa_ms"] for r in results if r.get("ttfa_ms") is not None)
    waiting = ttfas[math.floor(capacity):]
    played = [r for r in results if r.get("audio_ms")]
    out = {
        "conversations": len(conversations), "first_refusal": refusal, "readyz_when_full": ready,
        "speakers": speakers, "utterances": results,
        "ttfa_ms_all": summary(ttfas), "ttfa_ms_waiting": summary(waiting), "waiting": len(waiting),
        "ttfa_ms_sorted": ttfas,
        "gaps_over_60ms": sum(r["gaps_over_60ms"] for r in played),
        "longest_gap_ms": max((r["longest_gap_ms"] for r in played), default=None),
        "wall_over_audio": summary([r["wall_over_audio"] for r in played], 4),
        "server_underruns": {
            "speech": metric(m1, "voxgate_speech_underruns_total") - metric(m0, "voxgate_speech_underruns_total"),
            "pacer": metric(m1, "voxgate_pacer_underruns_total") - metric(m0, "voxgate_pacer_underruns_total"),
        },
        "server": server_figures(m0, m1), "client_process": watch.report(),
        "refused_later": sum(1 for r in results if not r["ok"]),
    }
    out["checks"] = {
        "started utterances 0 underruns (server)": out["server_underruns"]["speech"] == 0 and out["server_underruns"]["pacer"] == 0,
        "started utterances 0 client gaps > 60 ms": out["gaps_over_60ms"] == 0,
        "every utterance played": len(played) == speakers and out["refused_later"] == 0,
    }
    return out


async def run(args) -> dict:
    server = Server(args.server_args.split() if args.server_args else [])
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, server.url, 180)
        # Admission's budget once the worker has calibrated and other processes' load has been sampled.
        await asyncio.sleep(3.0)
        _, ready = await server.get("/readyz")
        _, metrics = await server.get("/metrics")
        capacity = float(ready["budget_rtf"])
        out = {"server": " ".join(server.cmd[1:]), "readyz_idle": ready, "capacity_sessions": capacity,
               "cost": {"engine": metric(metrics, 'voxgate_synthesis_cost{part="engine"}'),
                        "media": metric(metrics, 'voxgate_synthesis_cost{part="media"}')}}
        print(f"budget {capacity:.2f} s of audio per second (capacity C); synthesis cost {out['cost']}")
        sessions = args.sessions or 2 * math.ceil(capacity)
        if "twice" in args.arms:
            section(f"1. {sessions} offers (2x C), each speaking at once when admitted")
            out["twice"] = await arm_twice(server, capacity, sessions, SHORT_REPLY if args.quick else REPLY)
            t = out["twice"]
            print(f"admitted {t['admitted']}, refused {t['refused']} ({t['refusal_codes']}) in {t['refused_ms']} ms; "
                  f"wall/audio {t['wall_over_audio']}; gaps > 60 ms {t['gaps_over_60ms']} (longest {t['longest_gap_ms']} ms); "
                  f"TTFA {t['ttfa_ms']} ms; refused later {t['refused_later']}; underruns {t['server_underruns']}")
            print(f"server {t['server']}; client process {t['client_process']}")
            print(json.dumps(t["checks"], indent=1))
        if "burst" in args.arms:
            _, ready = await server.get("/readyz")
            section("2. burst: conversations at talk share 0.4 until refused, then 1.5x C speak at once")
            out["burst"] = await arm_burst(server, capacity, args.max_conversations, SHORT_REPLY)
            b = out["burst"]
            print(f"{b['conversations']} conversations admitted; {b['speakers']} spoke at once; TTFA all {b['ttfa_ms_all']} ms, "
                  f"waiting ({b['waiting']}) {b['ttfa_ms_waiting']} ms; gaps > 60 ms {b['gaps_over_60ms']} "
                  f"(longest {b['longest_gap_ms']} ms); wall/audio {b['wall_over_audio']}; underruns {b['server_underruns']}")
            print(f"server {b['server']}; client process {b['client_process']}")
            print(json.dumps(b["checks"], indent=1))
        _, out["metrics_end"] = await server.get("/readyz")
        return out
    finally:
        server.stop()


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=0, help="offers in arm 1 (default 2*ceil(C))")
    parser.add_argument("--max-conversations", type=int, default=60, help="most conversations arm 2 opens (default 60)")
    parser.add_argument("--arms", default="twice,burst", help="which arms: twice, burst (default both)")
    parser.add_argument("--server-args", default="", help="more arguments for voxgate serve")
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = asyncio.run(run(args))
    results["machine"] = info
    results["args"] = vars(args)
    ok = all(v for arm in ("twice", "burst") if arm in results for v in results[arm]["checks"].values())
    results["all_checks_pass"] = ok
    finish("past-capacity", results, started, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
