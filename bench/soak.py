"""Soak: open and close many sessions, each speaking a short utterance, and
watch the gateway's memory, file descriptors, threads and asyncio tasks.

    python bench/soak.py                    # 1,000 sessions, 4 at a time
    python bench/soak.py --sessions 200     # a shorter run
    python bench/soak.py --sessions 200 --out bench/results/soak.json

The gateway runs in this process (`create_app` + `aiohttp.web.AppRunner` on
127.0.0.1, tone engine) so that its figures can be read directly: RSS from
/proc/self/status, open descriptors from /proc/self/fd, threads, and
`asyncio.all_tasks()`. The clients are `voxgate.rtc_client.RtcClient` aiortc
peers in the same process over real UDP on loopback; each connects, speaks,
checks that its audio decodes to exactly its own text (tone engine), and
closes. The client's share of the figures goes away with the client, so after
the run everything should be back where it was.

The baseline is taken after a warm-up (thread pools, codec tables, imports
and caches fill on first use); the figures after the run are taken once the
server holds no session and a garbage collection has run. Flat means no leak:
ratios after/baseline near 1.0 for descriptors, threads and tasks, and RSS
growth that does not scale with the number of sessions (compare the middle
and the end of the run: both are taken idle, after a settle).

Then `--hold` sessions (20) are opened at once, each says one short
utterance, and RSS is read while all are open: (that - idle) / sessions is the
memory of one open session, an upper bound for the server's share because the
aiortc clients live in this process too.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import arg_parser, free_port, ratio, run_recorded, section  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def snapshot(gw) -> dict:
    return {
        "rss_mb": round(rss_mb(), 1),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(asyncio.all_tasks()),
        "server_sessions": len(gw.sessions),
        "server_peers": len(gw.peers),
        "engine_streams": gw.engine.active_streams,
    }


async def wait_idle(gw, timeout: float = 30.0) -> bool:
    """Until the server holds no session, peer or engine stream."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not gw.sessions and not gw.peers and gw.engine.active_streams == 0:
            return True
        await asyncio.sleep(0.1)
    return False


async def settle(gw) -> dict:
    await wait_idle(gw)
    # Closed peer connections finish their transports' tasks a moment later.
    for _ in range(3):
        await asyncio.sleep(1.0)
        gc.collect()
    return snapshot(gw)


async def one_session(url: str, n: int, results: dict) -> None:
    from voxgate.engine import tone
    from voxgate.rtc_client import RtcClient

    text = f"s{n}."
    client = RtcClient(url)
    try:
        await client.connect(timeout=20)
        sent = client.send({"type": "speak", "text": text, "id": "u"})
        done = await client.wait_for("utterance.done", id="u", timeout=20)
        await client.wait_tail(done)  # the receiver's jitter buffer still holds the tail
        heard = tone.decode(client.audio.pcm(sent), client.audio.sample_rate)
        results["ok" if heard == text else "wrong_audio"] += 1
        if heard != text:
            results.setdefault("wrong_examples", []).append((text, heard))
    except Exception as exc:
        results["failed"] += 1
        results.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}"[:200])
    finally:
        await client.close()


async def run(args) -> dict:
    from aiohttp import web

    from voxgate.config import Settings
    from voxgate.signaling.server import create_app

    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, engine="tone", ice_host=["127.0.0.1"],
                        max_sessions=max(200, args.concurrency * 4), web=False, log_level="WARNING")
    app = create_app(settings)
    gw = app["gateway"]
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    url = f"http://127.0.0.1:{port}"
    results = {"ok": 0, "wrong_audio": 0, "failed": 0}
    samples = []
    t0 = time.monotonic()
    try:
        section("warm-up")
        before_warmup = snapshot(gw)
        await asyncio.gather(*(one_session(url, -i, results) for i in range(args.warmup)))
        baseline = await settle(gw)
        print(f"at start {before_warmup}\nbaseline {baseline}  (after {args.warmup} warm-up sessions)")

        section(f"{args.sessions} sessions, {args.concurrency} at a time")
        done = 0
        every = max(1, args.sessions // 10)
        peak = dict(baseline)
        half = args.sessions // 2
        numbers = iter(range(half))

        # A fixed pool of workers, so the task count reflects sessions, not a queue of waiting coroutines.
        async def worker() -> None:
            nonlocal done
            for i in numbers:
                await one_session(url, i, results)
                done += 1
                snap = snapshot(gw)
                for k, v in snap.items():
                    peak[k] = max(peak[k], v)
                if done % every == 0:
                    snap["sessions_done"] = done
                    snap["elapsed_s"] = round(time.monotonic() - t0, 1)
                    samples.append(snap)
                    print(f"{done:6d} done  rss {snap['rss_mb']:7.1f} MiB  fds {snap['fds']:4d}  threads {snap['threads']:3d}  "
                          f"tasks {snap['tasks']:4d}  server sessions {snap['server_sessions']:3d}  "
                          f"ok {results['ok']}  wrong {results['wrong_audio']}  failed {results['failed']}", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        # Halfway, the server settles as at the end, so the two halves' growth compares idle with idle.
        mid_idle = await settle(gw)
        print(f"idle after {done} sessions: {mid_idle}")
        numbers = iter(range(half, args.sessions))
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - t0
        idle = await wait_idle(gw)
        after = await settle(gw)

        held = None
        if args.hold:
            section(f"{args.hold} sessions open at once (server and clients in this process)")
            clients = []
            from voxgate.rtc_client import RtcClient

            try:
                for _ in range(args.hold):
                    c = RtcClient(url)
                    clients.append(c)
                    await c.connect(timeout=20)
                for c in clients:
                    c.send({"type": "speak", "text": "ok.", "id": "h"})
                for c in clients:
                    await c.wait_for("utterance.done", id="h", timeout=30)
                gc.collect()
                held = snapshot(gw)
            finally:
                await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            released = await settle(gw)
            held["per_open_session_kib"] = round(1024 * (held["rss_mb"] - after["rss_mb"]) / args.hold, 1)
            held["idle_after_release"] = released
            print(f"held {held}\nRSS per open session (server + its in-process client): {held['per_open_session_kib']} KiB")
    finally:
        await runner.cleanup()

    section("result")
    mid = mid_idle
    print(f"{'':10s} {'baseline':>10s} {'peak':>10s} {'after':>10s} {'after/baseline':>15s}")
    for key in ("rss_mb", "fds", "threads", "tasks", "server_sessions", "server_peers", "engine_streams"):
        print(f"{key:16s} {baseline[key]:10} {peak[key]:10} {after[key]:10} {ratio(after[key], baseline[key]):15.3f}")
    growth_first = mid["rss_mb"] - baseline["rss_mb"]
    growth_second = after["rss_mb"] - mid["rss_mb"]
    per_session_kib = 1024 * (after["rss_mb"] - baseline["rss_mb"]) / max(1, args.sessions)
    print(f"RSS growth, idle to idle: first half {growth_first:+.1f} MiB, second half {growth_second:+.1f} MiB "
          f"({per_session_kib:+.1f} KiB per session served)")
    print(f"sessions: {results['ok']} ok, {results['wrong_audio']} wrong audio, {results['failed']} failed "
          f"in {elapsed:.0f} s ({args.sessions / elapsed:.1f} sessions/s); server idle at the end: {idle}")
    for e in results.get("errors", [])[:5]:
        print("  error:", e)
    for e in results.get("wrong_examples", [])[:5]:
        print("  wrong audio:", e)
    return {"baseline": baseline, "peak": peak, "mid_idle": mid_idle, "after": after, "samples": samples, "results": results,
            "rss_growth_mib": {"first_half": round(growth_first, 1), "second_half": round(growth_second, 1),
                               "what": "idle to idle: after warm-up, after half the sessions, after all (each once no session is open and gc ran)"},
            "rss_growth_per_session_served_kib": round(per_session_kib, 1),
            "held": held,
            "elapsed_s": elapsed, "server_idle_at_end": idle,
            "ratios": {k: ratio(after[k], baseline[k]) for k in ("rss_mb", "fds", "threads", "tasks")}}


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--hold", type=int, default=20, help="then open this many sessions at once and measure RSS per open session (0: skip)")
    args = parser.parse_args()
    if args.quick:
        args.sessions = min(args.sessions, 100)
    logging.basicConfig(level=logging.WARNING)
    data = run_recorded("soak", run(args), args)
    r = data["results"]
    return 0 if r["failed"] == 0 and r["wrong_audio"] == 0 and data["server_idle_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
