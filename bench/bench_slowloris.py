"""Slowloris against the gateway's HTTP server: half-sent request heads, held open.

    python bench/bench_slowloris.py [--conns 2000] [--out bench/results/slowloris.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, default
settings) with `ulimit -n` 1024 (the attack in issue 39 needed ~20,000
connections at the usual 20,000; this scales it down), listening on every
interface. The attacker opens `--conns` connections from this machine's own
non-loopback address (so per-address limits apply to it; nothing leaves the
machine), sends half a request head on each, and holds them. A client on
loopback asks /healthz every 50 ms on a fresh connection (measured at the
client socket: connect to the last byte of the answer; a failure is no answer
within 2 s). Before the attack: the same-run baseline. Also measured: how many
of the attacker's connections are open 5 s and 15 s in, the server's log bytes.
`--before-python` runs the same against a server with older code.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    arg_parser, finish, free_port, machine, percentile, print_machine, stop_server, this_code_and_before, wait_ready,
)

HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
PROBE = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def own_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # a UDP connect sends nothing
        return probe.getsockname()[0]


def _server_limits() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


async def probe_once(port: int) -> float | None:
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2.0)
        writer.write(PROBE)
        data = await asyncio.wait_for(reader.read(), 2.0)
        writer.close()
    except (OSError, asyncio.TimeoutError):
        return None
    return time.perf_counter() - started if data.startswith(b"HTTP/1.1 200") else None


async def probe_for(port: int, seconds: float) -> list[float | None]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(await probe_once(port))
        await asyncio.sleep(0.05)
    return out


def summary(samples: list[float | None]) -> dict:
    ok = [s * 1000 for s in samples if s is not None]
    return {"probes": len(samples), "failed": len(samples) - len(ok),
            "p50_ms": round(percentile(ok, 50), 2) if ok else None, "p99_ms": round(percentile(ok, 99), 2) if ok else None}


async def measure(args, python: str) -> dict:
    port = free_port()
    log_path = os.path.join("/tmp", f"bench-slowloris-{os.getpid()}-{port}.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [python, "-m", "voxgate.cli", "serve", "--host", "0.0.0.0", "--port", str(port), "--ice-host", "127.0.0.1",
             "--engine", "tone", "--no-web"],
            stdout=log, stderr=subprocess.STDOUT, cwd="/", preexec_fn=_server_limits,
            env={**os.environ, "VOXGATE_API_KEY": "bench-slowloris-key"})
    address = own_address()
    held: list[socket.socket] = []
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, f"http://127.0.0.1:{port}")
        baseline = await probe_for(port, args.baseline_s)
        log_before = os.path.getsize(log_path)
        opened = failed = 0
        for _ in range(args.conns):  # one after another, as fast as the handshakes go
            if failed >= 10:
                break  # the server takes no more: its backlog is full
            sock = socket.socket()
            sock.settimeout(0.5)
            try:
                sock.connect((address, port))
                sock.sendall(HALF_HEAD)
            except OSError:
                sock.close()
                failed += 1
                continue
            sock.setblocking(False)
            held.append(sock)
            opened += 1
        attack_at = time.monotonic()
        open_at: dict[str, int] = {}
        samples: list[float | None] = []
        for mark in (5.0, 15.0):
            samples += await probe_for(port, attack_at + mark - time.monotonic())
            open_at[f"{mark:g}s"] = sum(_still_open(s) for s in held)
        out = {"baseline": summary(baseline), "attack": summary(samples), "attacker_connections": opened,
               "attacker_open": open_at, "log_bytes_during_attack": os.path.getsize(log_path) - log_before}
        print(f"/healthz baseline {out['baseline']}, under attack {out['attack']}; attacker's connections open "
              f"{open_at} of {opened}; log +{out['log_bytes_during_attack']} bytes", flush=True)
        return out
    finally:
        for sock in held:
            sock.close()
        stop_server(server)
        os.unlink(log_path)


def _still_open(sock: socket.socket) -> bool:
    """Held by the server: neither answered (a 503) nor closed."""
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--conns", type=int, default=2000)
    parser.add_argument("--baseline-s", type=float, default=3.0)
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = {"what": f"/healthz (client socket, loopback) while {args.conns} connections from one non-loopback "
                       "address hold half-sent request heads; server ulimit -n 1024, default settings; tone engine, "
                       "priority normal"}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("slowloris", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
