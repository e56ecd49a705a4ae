"""Oversized Twilio media frames against the gateway's CPU.

    python bench/bench_twilio_frames.py [--seconds 10] [--out bench/results/twilio-frames.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, default
settings). `--streams` Media Streams connections each start a call (a new
session) and send `media` frames for `--seconds`: first Twilio's own (160 bytes
of μ-law, 50 a second: the same-run baseline), then the attack of issue 39
(48 KiB of base64 a frame, 190 a second, under the 200/s rate limit). Measured
at the server: its CPU (user + system, /proc) over each phase, as a share of one
core. The sender runs at nice 19: it stands for another machine.
`--before-python` runs the same against a server with older code.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from _common import (  # noqa: E402
    arg_parser, finish, free_port, machine, print_machine, proc_cpu_s, stop_server, this_code_and_before, wait_ready,
)

PATH = "/v1/telephony/twilio"


def _normal_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        pass


async def send_frames(ws, payload: str, per_s: float, seconds: float) -> int:
    frame = json.dumps({"event": "media", "media": {"track": "inbound", "payload": payload}})
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < seconds:
        due = int((time.monotonic() - start) * per_s)
        while sent < due:
            await ws.send_str(frame)
            sent += 1
        await asyncio.sleep(0.005)
    return sent


async def _drain(ws) -> None:
    async for _ in ws:
        pass


async def phase(pid: int, streams: list, payload: str, per_s: float, seconds: float) -> dict:
    cpu0, t0 = proc_cpu_s(pid), time.monotonic()
    sent = await asyncio.gather(*(send_frames(ws, payload, per_s, seconds) for ws in streams))
    cpu = (proc_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
    return {"server_cpu_share": round(cpu, 3), "frames_sent": sum(sent), "frame_b64_bytes": len(payload)}


async def measure(args, python: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [python, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1", "--engine", "tone",
         "--log-level", "ERROR", "--no-web", "--max-anonymous-sessions", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", preexec_fn=_normal_priority)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, url)
        async with aiohttp.ClientSession() as http:
            streams = [await http.ws_connect(url.replace("http", "ws") + PATH, max_msg_size=0) for _ in range(args.streams)]
            for i, ws in enumerate(streams):
                await ws.send_str(json.dumps({"event": "start", "start": {"streamSid": f"MZ{i}", "callSid": f"CA{i}"}}))
            drains = [asyncio.ensure_future(_drain(ws)) for ws in streams]  # errors are read, as Twilio would
            await asyncio.sleep(1.0)
            twilio = await phase(server.pid, streams, base64.b64encode(bytes(160)).decode(), 50, args.seconds)
            oversized = await phase(server.pid, streams, base64.b64encode(bytes(36 * 1024)).decode(), 190, args.seconds)
            for ws in streams:
                await ws.close()
            for task in drains:
                task.cancel()
        out = {"twilio_frames": twilio, "oversized_frames": oversized,
               "cpu_ratio": round(oversized["server_cpu_share"] / max(twilio["server_cpu_share"], 1e-3), 2)}
        print(f"server CPU: {twilio['server_cpu_share']:.1%} with Twilio's frames, {oversized['server_cpu_share']:.1%} "
              f"with 48 KiB frames (x{out['cpu_ratio']})", flush=True)
        return out
    finally:
        stop_server(server)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = {"what": f"gateway CPU (server) while {args.streams} Twilio streams send 48 KiB media frames at 190/s, "
                       "against Twilio's 160-byte frames at 50/s in the same run; tone engine, priority normal, loopback"}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("twilio-frames", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
