"""The fleet's routing cost: a session reached through another gateway (B) vs its own (A).

    python bench/bench_fleet.py --out bench/results/fleet.json
    python bench/bench_fleet.py --quick          # fewer rounds

Starts Debian's redis-server and two `voxgate serve` processes (tone engine,
so synthesis costs ~0 ms and the figures are routing and media) on loopback,
with the session directory on. Every session is made on A. Each figure is
measured both ways in the same run, the two paths interleaved round by round
(which goes first alternates), and printed with the ratio B/A:

1. GET /v1/sessions/{id}: client time from request to full answer (client side,
   loopback HTTP). Through B: B's directory lookup (one Redis GET) and the
   proxied request to A.
2. speak -> audio.started over the backend WebSocket: client send time of
   `speak` to arrival of `audio.started` (client side). One session per path,
   each with a WebRTC listener attached; the WebSocket goes to A directly, or
   to B, which proxies it frame by frame. Each utterance is cancelled once
   started, so rounds do not wait for speech to end.
3. A listener's first frame: client time from the joining offer's POST to the
   first decoded audio frame (client side: offer proxy + answer + ICE + DTLS
   + the first RTP packet). The offer goes to A, or to B which proxies it;
   media always flows straight from A.

Figures to stdout and to the JSON (--out); the gateways' logs to artifacts/.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ARTIFACTS, arg_parser, free_port, ratio, run_recorded, section, summary_ci_ms, wait_ready  # noqa: E402

KEY = "bench-fleet-key-" + "k" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}


class Redis:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")


class Gateway:
    def __init__(self, name: str, redis_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log = open(os.path.join(ARTIFACTS, f"bench-fleet-{name}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voxgate.cli", "serve", "--port", str(self.port), "--ice-host", "127.0.0.1",
             "--engine", "tone", "--redis-url", redis_url, "--advertise-url", self.url],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "VOXGATE_API_KEY": KEY, "VOXGATE_TOKEN_SECRET": "bench-fleet-token-secret-" + "s" * 16},
        )

    def wait_ready(self) -> None:
        wait_ready(self.url)


async def make_session(http: aiohttp.ClientSession, a: Gateway) -> dict:
    async with http.post(a.url + "/v1/sessions", headers=AUTH) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


async def next_event(ws, kind: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        msg = await asyncio.wait_for(ws.receive(), max(0.01, deadline - time.monotonic()))
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"WebSocket ended before {kind}")
        event = json.loads(msg.data)
        if event["type"] == kind:
            return event


async def get_latency(http, paths: dict, sid: str, rounds: int) -> dict:
    samples = {name: [] for name in paths}
    for i in range(rounds):
        for name in (list(paths) if i % 2 == 0 else list(reversed(paths))):
            t0 = time.perf_counter()
            async with http.get(f"{paths[name]}/v1/sessions/{sid}", headers=AUTH) as resp:
                await resp.read()
                assert resp.status == 200
            samples[name].append(time.perf_counter() - t0)
    return samples


async def speak_latency(http, paths: dict, a: Gateway, rounds: int) -> dict:
    from voxgate.rtc_client import RtcClient

    conns = {}
    listeners = []
    try:
        for name, base in paths.items():
            made = await make_session(http, a)
            listener = RtcClient(a.url, session_id=made["session_id"], token=made["client_token"])
            listeners.append(listener)
            await listener.connect()
            ws = await http.ws_connect(f"{base}/v1/sessions/{made['session_id']}/ws", headers=AUTH)
            await next_event(ws, "session.ready")
            conns[name] = ws
        samples = {name: [] for name in paths}
        for i in range(rounds):
            for name in (list(paths) if i % 2 == 0 else list(reversed(paths))):
                ws, uid = conns[name], f"u{i}"
                t0 = time.perf_counter()
                await ws.send_str(json.dumps({"type": "speak", "text": "fleet", "id": uid}))
                await next_event(ws, "audio.started")
                samples[name].append(time.perf_counter() - t0)
                await ws.send_str(json.dumps({"type": "cancel"}))
                await next_event(ws, "utterance.interrupted")
        return samples
    finally:
        for ws in conns.values():
            await ws.close()
        for listener in listeners:
            await listener.close()


async def first_frame(http, paths: dict, a: Gateway, rounds: int) -> dict:
    from voxgate.rtc_client import RtcClient

    samples = {name: [] for name in paths}
    for i in range(rounds):
        for name in (list(paths) if i % 2 == 0 else list(reversed(paths))):
            made = await make_session(http, a)
            listener = RtcClient(paths[name], session_id=made["session_id"], token=made["client_token"])
            try:
                t0 = time.perf_counter()
                await listener.connect()
                await listener.audio.wait_frames(1, since=t0)
                samples[name].append(listener.audio.frames[0][0] - t0)
            finally:
                await listener.close()
            async with http.delete(f"{a.url}/v1/sessions/{made['session_id']}", headers=AUTH) as resp:
                assert resp.status in (200, 404)  # 404: it ended with its listener
    return samples


def report(title: str, samples: dict) -> dict:
    a, b = summary_ci_ms(samples["direct"]), summary_ci_ms(samples["through_b"])
    out = {"direct_a": a, "through_b": b, "ratio_p50": round(ratio(b["p50"], a["p50"]), 3),
           "ratio_p95": round(ratio(b["p95"], a["p95"]), 3), "added_p50_ms": round(b["p50"] - a["p50"], 2)}
    print(f"{title}\n    direct to A  p50 {a['p50']:7.2f} ms  p95 {a['p95']:7.2f} ms  (n={a['n']})"
          f"\n    through B    p50 {b['p50']:7.2f} ms  p95 {b['p95']:7.2f} ms  (n={b['n']})"
          f"\n    B/A          p50 {out['ratio_p50']:.2f}x  p95 {out['ratio_p95']:.2f}x  (+{out['added_p50_ms']:.2f} ms p50)")
    return out


async def main(args) -> dict:
    redis = Redis()
    a, b = Gateway("a", redis.url), Gateway("b", redis.url)
    try:
        a.wait_ready()
        b.wait_ready()
        paths = {"direct": a.url, "through_b": b.url}
        n_get, n_speak, n_frame = (100, 20, 6) if args.quick else (400, 60, 20)
        async with aiohttp.ClientSession() as http:
            sid = (await make_session(http, a))["session_id"]
            await get_latency(http, paths, sid, 20)  # warm-up: connections, the Lua script cache
            section("GET /v1/sessions/{id}, client side, loopback")
            get = report("request to full answer", await get_latency(http, paths, sid, n_get))
            section("speak -> audio.started over the backend WebSocket, client side")
            speak = report("send of speak to arrival of audio.started", await speak_latency(http, paths, a, n_speak))
            section("a listener's first frame, client side")
            frame = report("joining offer POST to first decoded frame", await first_frame(http, paths, a, n_frame))
        return {"engine": "tone", "where": "client side, loopback, 2 gateways + Redis on this machine",
                "get_session": get, "speak_to_audio_started": speak, "offer_to_first_frame": frame}
    finally:
        for g in (a, b):
            g.proc.terminate()
            g.proc.wait(20)
        redis.proc.terminate()
        redis.proc.wait(10)


if __name__ == "__main__":
    parser = arg_parser(__doc__)
    args = parser.parse_args()
    run_recorded("fleet", main(args), args)
