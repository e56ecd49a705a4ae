"""The engine pool on Ray Serve against the local engine worker, in the same run.

    python bench/bench_pool.py --out bench/results/pool.json
    python bench/bench_pool.py --quick      # fewer repetitions

One local Ray (2 CPUs) runs Serve's HTTP proxy and one pool replica, with
Serve's direct ingress on (the replica also listens itself), with the
piper voice (joe), 2 synthesis steps at once and 2 threads per step: the same
settings as the local worker it is compared with (EngineConfig(parallel=2,
threads=2)). Both engines stay loaded for the whole run and are used in
alternation, so drift on this shared machine hits both alike.

1. TTFA overhead (server side, at the gateway's engine client, before Opus):
   push_text of one sentence to its first chunk, through EngineClient (pipe to
   the worker process) and through two RemoteEngineClients: `direct` (HTTP
   straight to the replica's own port, the gateway's default) and `proxy`
   (HTTP through Serve's proxy, --no-engine-direct), interleaved rep by rep in
   rotating order. overhead = remote - local per rep; target p50 <= +5 ms.
2. Ingress round trip of a request that does no synthesis (the replica's
   stats), over HTTP and over gRPC, each through Serve's proxy and straight to
   the replica, against the local worker's ping over its pipe; and the first
   frame of one raw stream request (one sentence, the same bytes) over the four
   routes, to pick the ingress that streams with less overhead.
3. Throughput at 8 streams: audio seconds per wall second, 8 four-sentence
   replies at once, 9 rounds of the three in rotating order; remote / local:
   the median of the rounds' own ratios, and the ratio of the medians;
   target >= 0.95.
4. A replica killed mid-speech: 2 gateway processes (`voxgate serve
   --engine-url`) with 2 WebRTC sessions each (aiortc over loopback) speaking
   long text; the replica actor is killed; per session: engine_crashed error
   received, peer still connected, and seconds from the kill until its next
   utterance is done.
No GPU on this machine: one replica on a GPU serving both gateways at 32 and
128 streams was not measured.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_streaming import first_chunk_s  # noqa: E402
from _common import arg_parser, finish, fmt_ms, free_port, machine, print_machine, ratio, section, summary_ci_ms, wait_ready  # noqa: E402

from voxgate.engine.base import SynthesisOptions  # noqa: E402
from voxgate.engine.runtime.client import EngineClient, EngineConfig  # noqa: E402
from voxgate.engine.cluster.pool import APP_NAME, GRPC_SERVICE, PoolConfig, start_local  # noqa: E402
from voxgate.engine.runtime.codec import FRAME_HEAD, frame_sizes  # noqa: E402
from voxgate.engine.cluster.pool_protocol import STATS_PATH, STREAM_PATH, StreamRequest  # noqa: E402
from voxgate.engine.cluster.remote import RemoteEngineClient  # noqa: E402

SENTENCES = [
    "The package arrives on Tuesday morning.",
    "Please hold while I check your account.",
    "Your appointment is confirmed for three o'clock.",
    "I can help you with that right away.",
    "The weather today is mild with light wind.",
    "Thanks for calling, have a great evening.",
]
REPLY = " ".join(SENTENCES[:4])


async def throughput(client, streams: int) -> float:
    """Audio seconds per wall second with `streams` replies synthesized at once."""
    async def one() -> float:
        stream = client.stream(SynthesisOptions())
        stream.push_text(REPLY)
        stream.end_input()
        return sum([chunk.duration async for chunk in stream])

    t0 = time.perf_counter()
    audio = await asyncio.gather(*(one() for _ in range(streams)))
    return sum(audio) / (time.perf_counter() - t0)


def grpc_replica_address() -> str:
    """The replica's own gRPC port, as Serve's controller lists it (this bench is the Ray driver)."""
    from voxgate.engine.cluster import ray_internals

    for group in ray_internals.target_groups_blocking(APP_NAME):
        if ray_internals.serves(group, "GRPC"):
            for target in group.targets:
                if target.name.startswith("SERVE_REPLICA::"):
                    return f"127.0.0.1:{target.port}"
    raise SystemExit("the replica lists no gRPC port: direct ingress or the gRPC options did not engage")


async def ingress_compare(local: EngineClient, http_urls: dict, grpc_targets: dict, reps: int) -> dict:
    """Round trips (stats) and the first frame of one raw stream request over HTTP and gRPC,
    through the proxy and straight to the replica, rep by rep in rotating order."""
    import aiohttp
    import grpc

    metadata = (("application", APP_NAME),)
    channels = {name: grpc.aio.insecure_channel(target) for name, target in grpc_targets.items()}

    async def http_stats(base: str) -> None:
        async with http.get(base + STATS_PATH) as resp:
            await resp.read()

    async def grpc_stats(channel) -> None:
        await channel.unary_unary(f"/{GRPC_SERVICE}/Stats")(b"", metadata=metadata)

    async def http_first_frame(base: str, body: bytes) -> float:
        t0 = time.perf_counter()
        first = None
        async with http.post(base + STREAM_PATH, data=body) as resp:
            while True:
                n_head, n_pcm = frame_sizes(await resp.content.readexactly(FRAME_HEAD.size))
                head = await resp.content.readexactly(n_head + n_pcm)
                first = first or time.perf_counter() - t0
                if b'"end"' in head[:n_head] or b'"error"' in head[:n_head]:
                    return first

    async def grpc_first_frame(channel, body: bytes) -> float:
        t0 = time.perf_counter()
        first = None
        async for _ in channel.unary_stream(f"/{GRPC_SERVICE}/Stream")(body, metadata=metadata):
            first = first or time.perf_counter() - t0
        return first

    trips: dict = {"local_ping": [], **{f"{n}_http": [] for n in http_urls}, **{f"{n}_grpc": [] for n in channels}}
    frames: dict = {**{f"{n}_http": [] for n in http_urls}, **{f"{n}_grpc": [] for n in channels}}
    async with aiohttp.ClientSession() as http:
        calls = [("local_ping", local.worker_stats)]
        calls += [(f"{n}_http", (lambda b=b: http_stats(b))) for n, b in http_urls.items()]
        calls += [(f"{n}_grpc", (lambda c=c: grpc_stats(c))) for n, c in channels.items()]
        streams = [(f"{n}_http", (lambda body, b=b: http_first_frame(b, body))) for n, b in http_urls.items()]
        streams += [(f"{n}_grpc", (lambda body, c=c: grpc_first_frame(c, body))) for n, c in channels.items()]
        for _ in range(2):  # warm every route
            for _, call in calls:
                await call()
        for i in range(reps):
            for name, call in calls[i % len(calls):] + calls[:i % len(calls)]:
                t0 = time.perf_counter()
                await call()
                trips[name].append(time.perf_counter() - t0)
            body = StreamRequest({}, [[0, SENTENCES[i % len(SENTENCES)]]]).encode()
            for name, first_frame in streams[i % len(streams):] + streams[:i % len(streams)]:
                frames[name].append(await first_frame(body))
    for channel in channels.values():
        await channel.close()
    return {"round_trip": trips, "first_frame": frames}


def start_gateway(url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1",
         "--engine", "piper", "--engine-url", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    return proc, base


async def kill_outcome(pool_url: str) -> dict:
    import ray

    from voxgate.rtc_client import RtcClient

    gateways = [start_gateway(pool_url) for _ in range(2)]
    try:
        clients = [RtcClient(base) for _, base in gateways for _ in range(2)]
        for client in clients:
            await client.connect()
        long = "A long answer that is still being spoken when the replica dies. " * 4
        for i, client in enumerate(clients):
            client.send({"type": "text.delta", "text": long, "id": f"s{i}"})
        for i, client in enumerate(clients):
            await client.wait_for("audio.started", id=f"s{i}", timeout=60)
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::") and APP_NAME in a["name"]]
        killed_at = time.perf_counter()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        sessions = []
        for i, client in enumerate(clients):
            error = await client.wait_for("error", timeout=30)
            recovered = None
            for attempt in range(200):
                uid = f"n{i}-{attempt}"
                client.send({"type": "speak", "text": "Back again.", "id": uid})
                event = await client._next(lambda e: e.get("id") == uid and e["type"] in ("utterance.done", "error"), 120, uid)
                if event["type"] == "utterance.done":
                    recovered = time.perf_counter() - killed_at
                    break
                await asyncio.sleep(0.2)
            sessions.append({
                "gateway": i // 2, "error_code": error.get("code"), "connected": client.pc.connectionState == "connected",
                "next_utterance_done_after_kill_s": round(recovered, 2) if recovered else None,
            })
        for client in clients:
            await client.close()
        return {
            "sessions": sessions,
            "all_sessions_survived": all(s["connected"] and s["next_utterance_done_after_kill_s"] for s in sessions),
            "all_got_engine_crashed": all(s["error_code"] == "engine_crashed" for s in sessions),
            "gateways_alive": all(proc.poll() is None for proc, _ in gateways),
        }
    finally:
        for proc, _ in gateways:
            proc.terminate()
            proc.wait(20)


async def run(args) -> dict:
    reps = 10 if args.quick else 40
    rounds = 2 if args.quick else 9
    port = free_port()
    t0 = time.perf_counter()
    grpc_port = free_port()
    start_local(PoolConfig(engine="piper", num_cpus=2, parallel=2, threads=2), "127.0.0.1", port, num_cpus=2,
                grpc_port=grpc_port)
    pool_start_s = time.perf_counter() - t0
    url = f"http://127.0.0.1:{port}/"
    local = EngineClient(EngineConfig(engine="piper", parallel=2, threads=2))
    direct = RemoteEngineClient(url)
    proxy = RemoteEngineClient(url, direct=False)
    clients = {"local": local, "direct": direct, "proxy": proxy}
    for client in clients.values():
        await client.start()
    if len(direct.pool.replicas) != 1:
        raise SystemExit(f"expected the pool to list its one replica (direct ingress), got {direct.pool.replicas}")
    results: dict = {"settings": {"engine": "piper", "voice": local.info.get("voices", [None])[0], "parallel": 2,
                                  "threads": 2, "ray_cpus": 2, "replicas": 1, "direct_ingress": True},
                     "pool_start_s": round(pool_start_s, 1)}
    for client in clients.values():  # warm all: first runs load kernels
        for text in SENTENCES[:3]:
            await first_chunk_s(client, text)

    section("1. TTFA: remote pool (direct to the replica; through Serve's proxy) vs local worker "
            "(server side, engine client, before Opus)")
    names = list(clients)
    ttfa: dict = {name: [] for name in names}
    for i in range(reps):
        text = SENTENCES[i % len(SENTENCES)]
        for name in names[i % 3:] + names[:i % 3]:  # rotating order: drift hits all three alike
            ttfa[name].append(await first_chunk_s(clients[name], text))
    for name in ("direct", "proxy"):
        ttfa[f"overhead_{name}"] = [r - l for r, l in zip(ttfa[name], ttfa["local"])]
    results["ttfa_ms"] = {k: summary_ci_ms(v) for k, v in ttfa.items()}
    for name in ("direct", "proxy"):
        results["ttfa_ms"][f"ratio_p50_{name}"] = round(ratio(results["ttfa_ms"][name]["p50"], results["ttfa_ms"]["local"]["p50"]), 3)
    for k in ttfa:
        print(f"{k:16s} {fmt_ms(results['ttfa_ms'][k])}  p50 95% CI {results['ttfa_ms'][k].get('p50_ci95')}")
    print(f"routes: direct client {direct.requests_by_route}, proxy client {proxy.requests_by_route}")
    results["routes"] = {"direct_client": dict(direct.requests_by_route), "proxy_client": dict(proxy.requests_by_route)}

    section("2. HTTP and gRPC ingress, through Serve's proxy and straight to the replica (server side, raw requests)")
    compared = await ingress_compare(local, {"proxy": url.rstrip("/"), "direct": direct.pool.replicas[0]},
                                     {"proxy": f"127.0.0.1:{grpc_port}", "direct": grpc_replica_address()}, reps)
    results["round_trip_ms"] = {k: summary_ci_ms(v) for k, v in compared["round_trip"].items()}
    results["raw_first_frame_ms"] = {k: summary_ci_ms(v) for k, v in compared["first_frame"].items()}
    print("round trip, stats request:")
    for k, v in results["round_trip_ms"].items():
        print(f"  {k:12s} {fmt_ms(v)}")
    print("first frame of a one-sentence stream request:")
    for k, v in results["raw_first_frame_ms"].items():
        print(f"  {k:12s} {fmt_ms(v)}")

    section("3. Throughput at 8 streams: audio s per wall s (server side)")
    tput: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            tput[name].append(await throughput(clients[name], 8))
    med = {k: sorted(v)[len(v) // 2] for k, v in tput.items()}
    # Each round's three runs are neighbours in time: the median of the rounds' own
    # ratios is steadier on this shared machine than the ratio of the medians.
    paired = {name: statistics.median(r / l for r, l in zip(tput[name], tput["local"])) for name in ("direct", "proxy")}
    results["throughput_8"] = {"runs": {k: [round(x, 3) for x in v] for k, v in tput.items()},
                               "median": {k: round(v, 3) for k, v in med.items()},
                               "ratio_direct_over_local": round(ratio(med["direct"], med["local"]), 3),
                               "ratio_proxy_over_local": round(ratio(med["proxy"], med["local"]), 3),
                               "ratio_paired_median_direct": round(paired["direct"], 3),
                               "ratio_paired_median_proxy": round(paired["proxy"], 3)}
    print(f"medians {results['throughput_8']['median']}  direct/local {results['throughput_8']['ratio_direct_over_local']:.3f}"
          f"  proxy/local {results['throughput_8']['ratio_proxy_over_local']:.3f}; median of the rounds' ratios: "
          f"direct {paired['direct']:.3f}, proxy {paired['proxy']:.3f}")
    for client in clients.values():
        await client.close()

    section("4. Replica killed mid-speech: 2 gateways, 4 WebRTC sessions")
    results["replica_killed"] = await kill_outcome(url)
    print(results["replica_killed"])
    results["gpu"] = "not measured: no GPU on this machine (one replica on a GPU at 32 and 128 streams)"
    return results


def main() -> None:
    parser = arg_parser(__doc__)
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    try:
        results = asyncio.run(run(args))
    finally:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    results["machine"] = info
    results["args"] = vars(args)
    finish("pool", results, started, args.out)


if __name__ == "__main__":
    main()
