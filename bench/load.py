"""Load: exact audio for every session under load, where frames start to run
late, and what the gateway does past its capacity.

    python bench/load.py                 # ramp 1, 4, 8, 16, 24, 32, 48, 64 (stops early once late), then capacity
    python bench/load.py --quick         # ramp 1, 4, 8, 16
    python bench/load.py --steps 1,10,20 --capacity 6

The gateway runs in this process (`create_app` + `aiohttp.web.AppRunner` on
127.0.0.1, tone engine), so the pacer of every session can be read directly:
`app["gateway"].peers[sid].track.pacer.stats`. The clients are
`voxgate.rtc_client.RtcClient` aiortc peers in the same process, over real
UDP on loopback, decoding real Opus. Clients and server share the event loop
and the machine's cores, so the sessions-per-core figure here includes the
clients' decoding: it is a lower bound for the server alone.

1. Ramp. For each step of N sessions: connect N clients, then every client
   queues two utterances of its own text (its number and a random tag, so no
   two sessions say the same thing) at the same moment. Once all are done,
   every client's received audio must decode (`voxgate.engine.tone.decode`)
   to exactly its two texts in order: nothing lost, duplicated, reordered or
   crossed between sessions. Timing, per step: server pacer late frames
   (> 5 ms after their deadline) and stalls (re-anchored after falling more
   than 3 frames behind) over the speaking window, client-side inter-arrival
   gaps of decoded frames (p99, max, count over 60 ms), and CPU seconds of
   this process plus the engine worker per session per second of speech.
   The 1-session step is the baseline for the late-frame and gap figures.
   The ramp stops after the first step a listener would hear (a pacer
   stall, audio that does not decode exactly), or when
   --time-budget runs out.
2. Past capacity. A second gateway with --max-sessions C: C sessions connect
   and speak; while they speak, C more offers arrive. They must get
   503 `at_capacity` with Retry-After (and /readyz 503) while the admitted C
   keep exact audio and on-time frames. After the first C close, a new
   session is admitted again.

Figures go to stdout and artifacts/bench-load.json.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import arg_parser, free_port, percentile, proc_cpu_s, ratio, run_recorded, section  # noqa: E402

# A step is degraded when a listener could hear it: a pacer stall (the loop fell
# more than 3 frames behind, so the receiver's jitter buffer runs dry), or
# audio that does not decode exactly. Frames a few ms late (the
# pacer's `late_frames`, > 5 ms) are reported against the 1-session baseline of
# the same run: on a shared machine some are late even with one session.
GAP_LIMIT_MS = 60.0


def degraded(row: dict) -> bool:
    # Client gaps are reported but do not stop the ramp: the clients share this
    # process and its cores, so their own decoding delays show up there too.
    return bool(row["stalls"] or row["wrong"] or row["timeouts"] or row["connect_failed"])


async def start_gateway(max_sessions: int):
    from aiohttp import web

    from voxgate.config import Settings
    from voxgate.signaling.server import create_app

    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, engine="tone", ice_host=["127.0.0.1"],
                        max_sessions=max_sessions, web=False, log_level="WARNING")
    app = create_app(settings)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return app, runner, f"http://127.0.0.1:{port}"


def texts_for(n: int, rng: random.Random) -> tuple[str, str]:
    tag = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
    return f"#{n} {tag}, the first of two utterances. ", f"#{n} and the second one: {tag[::-1]}."


def pacer_totals(gw, sids: list[str]) -> dict:
    out = {"frames": 0, "late_frames": 0, "stalls": 0}
    for sid in sids:
        peer = gw.peers.get(sid)
        if peer is None or peer.track is None:
            continue
        stats = peer.track.pacer.stats
        out["frames"] += stats.frames
        out["late_frames"] += stats.late_frames
        out["stalls"] += stats.stalls
    return out


def arrival_gaps(client, since: float, until: float) -> list[float]:
    times = [t for t, _ in client.audio.frames if since <= t <= until]
    return [b - a for a, b in zip(times, times[1:])]


async def speak_and_check(clients, rng: random.Random) -> dict:
    """Every client says its own two utterances at once; checks each one's audio exactly."""
    from voxgate.engine import tone

    expected = {}
    sent_at = {}
    for i, client in enumerate(clients):
        a, b = texts_for(i, rng)
        expected[client] = a + b
        sent_at[client] = client.send({"type": "speak", "text": a, "id": "a"})
        client.send({"type": "speak", "text": b, "id": "b"})
    t_start = time.perf_counter()
    waits = [c.wait_for("utterance.done", id="b", timeout=60) for c in clients]
    done = await asyncio.gather(*waits, return_exceptions=True)
    t_end = time.perf_counter()
    await asyncio.sleep(0.4)  # the receivers' jitter buffers still hold the tails
    wrong, timeouts, gaps, audio_ms = [], 0, [], 0
    for client, d in zip(clients, done):
        if isinstance(d, Exception):
            timeouts += 1
            continue
        audio_ms += d["audio_ms"]
        heard = tone.decode(client.audio.pcm(sent_at[client]), client.audio.sample_rate)
        if heard != expected[client]:
            wrong.append((expected[client], heard))
        first = client.audio.first_sound_after(sent_at[client])
        last = client.audio.last_sound()
        if first and last:
            gaps += arrival_gaps(client, first, last)
    return {"wrong": wrong, "timeouts": timeouts, "gaps": gaps, "window_s": t_end - t_start,
            "audio_s_per_session": audio_ms / 1000.0 / max(1, len(clients) - timeouts)}


async def connect_all(url: str, n: int):
    from voxgate.rtc_client import RtcClient

    clients = [RtcClient(url) for _ in range(n)]
    results = await asyncio.gather(*(c.connect(timeout=30) for c in clients), return_exceptions=True)
    ok = [c for c, r in zip(clients, results) if not isinstance(r, Exception)]
    failed = [(c, r) for c, r in zip(clients, results) if isinstance(r, Exception)]
    return ok, failed


async def close_all(clients) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def wait_idle(gw, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (gw.sessions or gw.peers) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def ramp(args) -> list[dict]:
    app, runner, url = await start_gateway(max_sessions=max(args.steps) + 10)
    gw = app["gateway"]
    rng = random.Random(1)
    rows = []
    t_begin = time.monotonic()
    baseline_p99 = baseline_late = None
    try:
        for n in args.steps:
            if time.monotonic() - t_begin > args.time_budget:
                print(f"time budget of {args.time_budget} s spent; stopping before {n} sessions")
                break
            clients, failed = await connect_all(url, n)
            await asyncio.sleep(0.5)
            sids = [c.session_id for c in clients]
            before = pacer_totals(gw, sids)
            cpu0 = proc_cpu_s(os.getpid()) + (proc_cpu_s(gw.engine.worker_pid) if gw.engine.worker_pid else 0.0)
            result = await speak_and_check(clients, rng)
            cpu1 = proc_cpu_s(os.getpid()) + (proc_cpu_s(gw.engine.worker_pid) if gw.engine.worker_pid else 0.0)
            after = pacer_totals(gw, sids)
            await close_all(clients)
            await wait_idle(gw)
            frames = after["frames"] - before["frames"]
            late = after["late_frames"] - before["late_frames"]
            stalls = after["stalls"] - before["stalls"]
            gaps_ms = [g * 1000 for g in result["gaps"]]
            p99 = percentile(gaps_ms, 99)
            if baseline_p99 is None:
                baseline_p99, baseline_late = p99, ratio(late, frames)
            cpu_per_session_s = (cpu1 - cpu0) / result["window_s"] / max(1, len(clients))
            row = {
                "sessions": n, "connected": len(clients), "connect_failed": len(failed),
                "exact": len(clients) - len(result["wrong"]) - result["timeouts"],
                "wrong": len(result["wrong"]), "timeouts": result["timeouts"],
                "frames": frames, "late_frames": late, "stalls": stalls,
                "late_fraction": ratio(late, frames),
                "gap_p50_ms": percentile(gaps_ms, 50), "gap_p99_ms": p99, "gap_max_ms": max(gaps_ms) if gaps_ms else float("nan"),
                "gaps_over_60ms": sum(1 for g in gaps_ms if g > GAP_LIMIT_MS),
                "late_fraction_vs_1_session": ratio(ratio(late, frames), baseline_late),
                "gap_p99_vs_1_session": ratio(p99, baseline_p99),
                "cpu_per_session": cpu_per_session_s,
                "window_s": result["window_s"], "audio_s_per_session": result["audio_s_per_session"],
                "wrong_examples": result["wrong"][:3],
                "connect_errors": [f"{type(r).__name__}: {r}"[:160] for _, r in failed[:3]],
            }
            rows.append(row)
            print(f"{n:4d} sessions: exact {row['exact']}/{n}  late {late}/{frames} ({100 * row['late_fraction']:.1f} %, x{row['late_fraction_vs_1_session']:.1f} vs 1 session)  "
                  f"stalls {stalls}  client gaps p50 {row['gap_p50_ms']:.1f} p99 {p99:.1f} max {row['gap_max_ms']:.1f} ms "
                  f"(p99 x{row['gap_p99_vs_1_session']:.2f} vs 1 session, {row['gaps_over_60ms']} over 60 ms)  "
                  f"CPU {100 * cpu_per_session_s:.1f} % of a core per session  window {result['window_s']:.1f} s", flush=True)
            for expected, heard in row["wrong_examples"]:
                print(f"      wrong audio: expected {expected!r}, decoded {heard!r}")
            for e in row["connect_errors"]:
                print(f"      connect failed: {e}")
            if degraded(row):
                print(f"audible degradation at {n} sessions (pacer stalls or wrong audio); the ramp stops here")
                break
    finally:
        await runner.cleanup()
    return rows


async def post_offer(url: str) -> tuple[int, dict, dict]:
    """A real aiortc offer, posted by hand so the refusal can be inspected."""
    import aiohttp
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/offer", json={"sdp": pc.localDescription.sdp, "type": "offer"}) as resp:
                return resp.status, dict(resp.headers), await resp.json()
    finally:
        await pc.close()


async def past_capacity(args) -> dict:
    import aiohttp

    from voxgate.rtc_client import RtcClient

    cap = args.capacity
    app, runner, url = await start_gateway(max_sessions=cap)
    gw = app["gateway"]
    rng = random.Random(2)
    try:
        clients, failed = await connect_all(url, cap)
        sids = [c.session_id for c in clients]
        before = pacer_totals(gw, sids)
        speaking = asyncio.ensure_future(speak_and_check(clients, rng))
        await asyncio.sleep(0.3)
        refusals = await asyncio.gather(*(post_offer(url) for _ in range(cap)))
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz") as resp:
                readyz_full = resp.status
        result = await speaking
        after = pacer_totals(gw, sids)
        statuses = [s for s, _, _ in refusals]
        codes = [b.get("error", {}).get("code") for _, _, b in refusals]
        retry_after = [h.get("Retry-After") for _, h, _ in refusals]
        await close_all(clients)
        await wait_idle(gw)
        again = RtcClient(url)
        try:
            await again.connect(timeout=20)
            admitted_after = True
        except Exception:
            admitted_after = False
        finally:
            await again.close()
    finally:
        await runner.cleanup()
    frames = after["frames"] - before["frames"]
    out = {
        "capacity": cap, "admitted": len(clients), "admit_failed": len(failed),
        "extra_offers": cap, "extra_statuses": statuses, "extra_codes": codes, "retry_after": retry_after,
        "readyz_when_full": readyz_full,
        "admitted_exact": len(clients) - len(result["wrong"]) - result["timeouts"],
        "admitted_late_frames": after["late_frames"] - before["late_frames"], "admitted_frames": frames,
        "admitted_stalls": after["stalls"] - before["stalls"],
        "admitted_again_after_close": admitted_after,
    }
    print(f"max-sessions {cap}: {out['admitted']} admitted, exact audio for {out['admitted_exact']}; "
          f"late {out['admitted_late_frames']}/{frames}, stalls {out['admitted_stalls']}")
    print(f"{cap} more offers while full: statuses {sorted(set(statuses))}, codes {sorted(set(map(str, codes)))}, "
          f"Retry-After {sorted(set(map(str, retry_after)))}; /readyz {readyz_full}; "
          f"a new session admitted after the first ones closed: {admitted_after}")
    return out


def sessions_per_core(rows: list[dict]) -> dict:
    on_time = [r for r in rows if not degraded(r)]
    best = max(on_time, key=lambda r: r["sessions"]) if on_time else None
    loaded = [r for r in on_time if r["sessions"] >= 4]
    cpu = sorted(r["cpu_per_session"] for r in loaded) if loaded else []
    median_cpu = cpu[len(cpu) // 2] if cpu else float("nan")
    return {"largest_on_time_step": best["sessions"] if best else 0,
            "cpu_per_session_median": median_cpu,
            "sessions_per_core_cpu_bound": ratio(1.0, median_cpu)}


async def run(args) -> dict:
    section("ramp (tone engine, every session checked for exact audio)")
    rows = await ramp(args)
    summary = sessions_per_core(rows)
    print(f"largest step without audible degradation: {summary['largest_on_time_step']} sessions; "
          f"CPU per speaking session (server + clients + engine worker): {100 * summary['cpu_per_session_median']:.1f} % "
          f"of a core, so about {summary['sessions_per_core_cpu_bound']:.1f} sessions per core with the clients in-process")
    section(f"past capacity (--max-sessions {args.capacity})")
    capacity = await past_capacity(args)
    return {"ramp": rows, "summary": summary, "past_capacity": capacity}


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--steps", default="1,4,8,16,24,32,48,64", help="session counts to ramp through")
    parser.add_argument("--capacity", type=int, default=6, help="--max-sessions of the past-capacity gateway")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds the ramp may take")
    args = parser.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    if args.quick:
        args.steps = [s for s in args.steps if s <= 16]
        args.time_budget = min(args.time_budget, 120.0)
    logging.basicConfig(level=logging.WARNING)
    data = run_recorded("load", run(args), args)
    cap = data["past_capacity"]
    ok = (all(r["wrong"] == 0 for r in data["ramp"])
          and cap["admitted_exact"] == cap["admitted"] == cap["capacity"]
          and set(cap["extra_codes"]) == {"at_capacity"} and cap["admitted_again_after_close"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
