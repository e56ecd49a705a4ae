"""Speech slots held for free, against another key's speech request (issue 53, finding 6).

    python bench/bench_speech_slots.py [--wait-s 60] [--flush-every-s 5] [--out bench/results/speech-slots.json]
                                       [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, keys `a1`, `a2` and `victim`, default
limits: 4 speech requests at once, 2 per key, --write-stall-s 10, --tts-ws-context-idle-s 20). Two arms,
each on a fresh server:

- http: four POST /v1/audio/speech requests (two per attacking key) of 300 s of pcm whose bodies are never
  read (a 4 KB receive buffer; the server's writes wait);
- ws: four /v1/tts/ws contexts (two per key), each one word, then a `flush` every `--flush-every-s`.

Meanwhile the `victim` key asks POST /v1/audio/speech (wav, "Hi.") every 0.5 s, for up to `--wait-s`:
measured are how many times it was refused and how long after the attack began it was first served.
The server's CPU over the attack says that holding cost it nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from _attack import Gateway, status_of  # noqa: E402
from _common import arg_parser, finish, machine, print_machine, this_code_and_before  # noqa: E402

FLAGS = ["--api-key", "a1", "--api-key", "a2", "--api-key", "victim"]
ATTACKERS = ("a1", "a1", "a2", "a2")


async def never_read(url: str, key: str):
    """A POST /v1/audio/speech of 300 s of pcm whose body is never read; returns its stream writer."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = json.dumps({"model": "tts-1", "voice": "alloy", "input": "a" * 8000, "response_format": "pcm"}).encode()
    writer.write((f"POST /v1/audio/speech HTTP/1.1\r\nHost: {parts.netloc}\r\nX-API-Key: {key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    status = await asyncio.wait_for(reader.readline(), 30)
    return writer, status.split()[1:2] == [b"200"]


async def flusher(http: aiohttp.ClientSession, url: str, key: str, cid: str, every_s: float, events: list) -> None:
    ws = await http.ws_connect(url.replace("http", "ws") + f"/v1/tts/ws?key={key}")
    try:
        await ws.send_json({"type": "text", "context_id": cid, "text": "word"})
        while not ws.closed:
            await ws.send_json({"type": "flush", "context_id": cid})
            deadline = time.monotonic() + every_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    message = await ws.receive(timeout=left)
                except asyncio.TimeoutError:
                    break
                if message.type != aiohttp.WSMsgType.TEXT:
                    return
                data = json.loads(message.data)
                if data["type"] == "error":
                    events.append({"context": cid, "code": data["code"], "at": time.monotonic()})
    finally:
        await ws.close()


async def victim(http: aiohttp.ClientSession, url: str, t0: float, wait_s: float) -> dict:
    refused: dict[str, int] = {}
    while time.monotonic() - t0 < wait_s:
        status, body = await status_of(http, "POST", url + "/v1/audio/speech", headers={"X-API-Key": "victim"},
                                       json={"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "wav"})
        if status == 200:
            return {"served_after_s": round(time.monotonic() - t0, 1), "refused": refused}
        reason = f"{status} {((body or {}).get('error') or {}).get('reason')}"
        refused[reason] = refused.get(reason, 0) + 1
        await asyncio.sleep(0.5)
    return {"served_after_s": None, "refused": refused}


async def http_arm(args, python: str) -> dict:
    gateway = Gateway(python, FLAGS)
    writers = []
    try:
        await gateway.ready()
        async with aiohttp.ClientSession() as http:
            t0, cpu0 = time.monotonic(), gateway.cpu_s()
            held = [await never_read(gateway.url, key) for key in ATTACKERS]
            writers = [w for w, _ in held]
            out = await victim(http, gateway.url, t0, args.wait_s)
            out["attackers_admitted"] = sum(ok for _, ok in held)
            out["server_cpu_pct"] = round(100 * (gateway.cpu_s() - cpu0) / (time.monotonic() - t0), 1)
        return out
    finally:
        for w in writers:
            w.transport.abort()
        await gateway.stop()


async def ws_arm(args, python: str) -> dict:
    gateway = Gateway(python, FLAGS)
    tasks = []
    try:
        await gateway.ready()
        events: list = []
        async with aiohttp.ClientSession() as http:
            t0, cpu0 = time.monotonic(), gateway.cpu_s()
            tasks = [asyncio.ensure_future(flusher(http, gateway.url, key, f"c{i}", args.flush_every_s, events))
                     for i, key in enumerate(ATTACKERS)]
            await asyncio.sleep(1.0)  # the contexts open
            out = await victim(http, gateway.url, t0, args.wait_s)
            out["server_cpu_pct"] = round(100 * (gateway.cpu_s() - cpu0) / (time.monotonic() - t0), 1)
            out["attacker_errors"] = [{"code": e["code"], "after_s": round(e["at"] - t0, 1)} for e in events]
            for task in tasks:
                task.cancel()
        return out
    finally:
        await gateway.stop()


async def measure(args, python: str) -> dict:
    out = {"http": await http_arm(args, python), "ws": await ws_arm(args, python)}
    for arm, row in out.items():
        print(f"{arm}: victim served after {row['served_after_s']} s, refused {row['refused']}; server CPU "
              f"{row['server_cpu_pct']} %", flush=True)
    return out


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--wait-s", type=float, default=60.0)
    parser.add_argument("--flush-every-s", type=float, default=5.0)
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    if args.quick:
        args.wait_s = 30.0
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = {"what": "another key's POST /v1/audio/speech while four never-reading speech requests, or four /v1/tts/ws "
                       f"contexts of one word and a flush every {args.flush_every_s:g} s, hold the 4 slots; tone engine, "
                       "default limits, server at priority normal, clients at nice 19, loopback",
               "args": {k: v for k, v in vars(args).items() if k != "out"}}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("speech-slots", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
