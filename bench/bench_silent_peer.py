"""A peer that never acknowledges its data channel, against the gateway's memory.

    python bench/bench_silent_peer.py [--seconds 60] [--out bench/results/silent-peer.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, default
settings: `--max-channel-buffer-kb 1024`). One aiortc peer in this process
connects, then drops every DATA chunk the gateway sends (so its SCTP never
acknowledges one) and sends `--rate` pings a second, as the attack in issue 39
did. Measured at the server, once a second: the gateway process's RSS; and
when (if) the session closed. The first seconds before the flood are the
same-run baseline. `--before-python` runs the same against a server with
older code. The peer runs at nice 19: it stands for another machine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    arg_parser, finish, free_port, machine, print_machine, proc_mem_mb, stop_server, this_code_and_before, wait_ready,
)


async def _never_acknowledge(chunk) -> None:
    return None


def _normal_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        pass


async def measure(args, python: str) -> dict:
    from voxgate.rtc_client import RtcClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [python, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1", "--engine", "tone",
         "--log-level", "WARNING", "--no-web"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", preexec_fn=_normal_priority)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, url)
        client = RtcClient(url)
        await client.connect()
        closed_at = None

        rss = []
        start = time.monotonic()
        await asyncio.sleep(3.0)
        baseline = proc_mem_mb(server.pid)["rss_mb"]
        client.pc.sctp._receive_data_chunk = _never_acknowledge
        flood_at = time.monotonic()
        sent, next_sample = 0, flood_at
        while time.monotonic() - flood_at < args.seconds:
            due = int((time.monotonic() - flood_at) * args.rate)
            while sent < due and client.pc.sctp.state == "connected":
                client.send({"type": "ping", "t": sent})
                sent += 1
            if closed_at is None and (client.pc.connectionState in ("closed", "failed")
                                      or client.pc.sctp.state != "connected"):
                closed_at = time.monotonic() - flood_at
            if time.monotonic() >= next_sample:
                rss.append(round(proc_mem_mb(server.pid)["rss_mb"], 1))
                next_sample += 1.0
            await asyncio.sleep(0.01)
        await client.close()
        out = {"baseline_rss_mb": baseline, "rss_mb_each_second": rss, "pings_sent": sent,
               "rss_growth_mb": round(max(rss) - baseline, 1), "rss_end_minus_baseline_mb": round(rss[-1] - baseline, 1),
               "session_closed_after_s": None if closed_at is None else round(closed_at, 2),
               "elapsed_s": round(time.monotonic() - start, 1)}
        print(f"RSS {baseline} MB before, {max(rss)} MB at most ({out['rss_growth_mb']:+.1f}), {rss[-1]} at the end; "
              f"session closed after {out['session_closed_after_s']} s; {sent} pings", flush=True)
        return out
    finally:
        stop_server(server)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=3000.0, help="pings a second")
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 15.0
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = {"what": "gateway RSS (server) while one connected peer never acknowledges its data channel and sends "
                       f"{args.rate:g} pings/s; tone engine, priority normal, loopback", "seconds": args.seconds}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("silent-peer", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
