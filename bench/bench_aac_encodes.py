"""Compressed speech encodes at once, against other sessions' late frames (issue 53, finding 7).

    python bench/bench_aac_encodes.py [--encodes 4] [--format aac] [--innocents 4] [--baseline-s 10] [--attack-s 30]
                                      [--out bench/results/aac-encodes.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, keys `a1`, `a2` and `victim`, default
limits: 4 speech slots, 2 per key). `--innocents` sessions of the `victim` key speak throughout, each heard
by a WebRTC peer in this process. Then `--encodes` workers (two per attacking key) each ask
POST /v1/audio/speech for 300 s of audio as `--format` (the default --tts-max-audio-s) and read it all, over
and over for `--attack-s`, retrying at once when refused, so the server encodes as many at once as it
admits. Measured: the gateway's late frames over the baseline window and the attack window (the same
run's ratio), its CPU, how many requests were served and refused, and the in-process CPU cost of each
format per second of tone audio (the price gateway/peerless/http_audio.py charges for).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from _attack import Gateway, Window, close_all, innocent_speakers, ratio_line  # noqa: E402
from _common import arg_parser, finish, machine, print_machine, this_code_and_before  # noqa: E402

FLAGS = ["--api-key", "a1", "--api-key", "a2", "--api-key", "victim"]


def format_costs(seconds: float = 30.0) -> dict:
    """CPU milliseconds per second of tone-like audio (a 440 Hz tone at 16 kHz, the tone engine's rate, with gaps)
    for each OpenAI format, in this process."""
    import numpy as np

    from voxgate.gateway.peerless.http_audio import OPENAI_FORMATTERS as FORMATTERS

    rate = 16000
    t = np.arange(int(rate * seconds)) / rate
    pcm = (np.sin(2 * np.pi * 440 * t) * 8000 * (t % 1.0 < 0.6)).astype(np.int16)
    out = {}
    for name, make in FORMATTERS.items():
        started = time.thread_time()
        formatter = make(rate)
        formatter.start()
        for i in range(0, len(pcm), rate // 5):
            formatter.feed(pcm[i:i + rate // 5])
        formatter.finish()
        out[name] = round((time.thread_time() - started) / seconds * 1000.0, 2)
    return out


async def encoder(http: aiohttp.ClientSession, url: str, key: str, fmt: str, until: float, tally: dict) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": "a" * 8000, "response_format": fmt}
    while time.monotonic() < until:
        try:
            async with http.post(url + "/v1/audio/speech", json=body, headers={"X-API-Key": key}) as resp:
                if resp.status != 200:
                    tally[str(resp.status)] = tally.get(str(resp.status), 0) + 1
                    await resp.read()
                    await asyncio.sleep(0.2)
                    continue
                tally["admitted"] = tally.get("admitted", 0) + 1
                async for _ in resp.content.iter_chunked(1 << 16):
                    if time.monotonic() >= until:
                        return
                tally["finished"] = tally.get("finished", 0) + 1
        except aiohttp.ClientError:
            tally["cut"] = tally.get("cut", 0) + 1


async def measure(args, python: str) -> dict:
    gateway = Gateway(python, FLAGS, realtime=args.realtime)
    clients: list = []
    try:
        await gateway.ready()
        clients = await innocent_speakers(gateway.url, args.innocents, args.baseline_s + args.attack_s + 30, key="victim")
        async with aiohttp.ClientSession() as http:
            async with Window(http, gateway) as baseline:
                await asyncio.sleep(args.baseline_s)
            tally: dict = {}
            async with Window(http, gateway) as attack, aiohttp.ClientSession() as attacker:
                until = time.monotonic() + args.attack_s
                keys = [("a1", "a2")[i % 2] for i in range(args.encodes)]
                await asyncio.gather(*(encoder(attacker, gateway.url, key, args.format, until, tally) for key in keys))
        out = {"baseline": baseline.figures, "attack": attack.figures, "requests": tally,
               "late_vs_baseline": ratio_line(baseline.figures, attack.figures)}
        print(f"{args.encodes} x {args.format}: late {baseline.figures['late_pct']} % before, {attack.figures['late_pct']} % "
              f"during (x{out['late_vs_baseline']['ratio']}); server CPU {baseline.figures['server_cpu_pct']} -> "
              f"{attack.figures['server_cpu_pct']} %; requests {tally}", flush=True)
        return out
    finally:
        await close_all(clients)
        await gateway.stop()


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--encodes", type=int, default=4)
    parser.add_argument("--format", default="aac")
    parser.add_argument("--innocents", type=int, default=4)
    parser.add_argument("--baseline-s", type=float, default=10.0)
    parser.add_argument("--attack-s", type=float, default=30.0)
    parser.add_argument("--realtime", action="store_true",
                        help="the gateway at --media-priority realtime (on a shared machine, so its baseline is its own)")
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    if args.quick:
        args.baseline_s, args.attack_s = 5.0, 10.0
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    costs = format_costs()
    print("CPU ms per second of tone audio:", costs, flush=True)
    results = {"what": f"gateway late frames (its own counters) of {args.innocents} speaking sessions while another tenant keeps "
                       f"{args.encodes} POST /v1/audio/speech {args.format} requests of 300 s going; tone engine, default "
                       f"limits, server at media priority {'realtime' if args.realtime else 'normal'}, clients at nice 19, loopback",
               "args": {k: v for k, v in vars(args).items() if k != "out"},
               "format_cpu_ms_per_audio_s": costs}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("aac-encodes", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
