"""Caller-audio watchers on one session, against other sessions' late frames (issue 53, finding 5).

    python bench/bench_watchers.py [--watchers 250] [--innocents 4] [--baseline-s 10] [--attack-s 20]
                                   [--out bench/results/watchers.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, keys `attacker` and `victim`, default
limits). `--innocents` sessions of the `victim` key speak throughout, each heard by a WebRTC peer in this
process. The `attacker` key makes a session and joins it with a peer whose microphone sends 20 ms frames
(silence), so the session has caller audio; then it opens `--watchers` backend WebSockets on that session
with `?audio=pcm16&role=watcher`, each read as fast as this process (nice 19) can. Measured: how many
were accepted and refused, the gateway's late frames over the baseline window before them and over
`--attack-s` with them (the same run's ratio), the gateway's CPU, and the status of another key's
POST /v1/sessions during the attack.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from _attack import Gateway, Window, close_all, innocent_speakers, ratio_line, status_of  # noqa: E402
from _common import arg_parser, finish, machine, print_machine, this_code_and_before  # noqa: E402


async def _read(ws) -> None:
    async for _ in ws:
        pass


async def measure(args, python: str) -> dict:
    from voxgate.rtc_client import RtcClient

    flags = ["--api-key", "attacker", "--api-key", "victim"]
    if args.lift_limits:  # the late-frame rule alone (gateway/load/late_blame.py): the watcher limits out of the way
        flags += ["--max-watchers-per-session", "10000", "--max-watchers-per-key", "10000"]
    gateway = Gateway(python, [*flags, "--log-level", "INFO"] if os.environ.get("BENCH_KEEP_LOG") else flags,
                      realtime=args.realtime)
    clients: list = []
    sockets: list = []
    readers: list = []
    try:
        await gateway.ready()
        speak_s = args.baseline_s + args.attack_s + 30
        clients = await innocent_speakers(gateway.url, args.innocents, speak_s, key="victim")
        async with aiohttp.ClientSession() as http, aiohttp.ClientSession(
                headers={"X-API-Key": "attacker"}, connector=aiohttp.TCPConnector(limit=0)) as attacker:
            status, made = await status_of(attacker, "POST", gateway.url + "/v1/sessions")
            target = RtcClient(gateway.url, mic=True, session_id=made["session_id"], token=made["client_token"])
            await target.connect()
            clients.append(target)
            async with Window(http, gateway) as baseline:
                await asyncio.sleep(args.baseline_s)
            accepted = refused = other = 0
            ws_url = gateway.url.replace("http", "ws") + f"/v1/sessions/{made['session_id']}/ws?role=watcher&audio=pcm16"
            async with Window(http, gateway) as attack:
                t0 = time.monotonic()
                for _ in range(args.watchers):
                    try:
                        ws = await attacker.ws_connect(ws_url)
                    except aiohttp.WSServerHandshakeError as exc:
                        refused += exc.status == 429
                        other += exc.status != 429
                        continue
                    sockets.append(ws)
                    readers.append(asyncio.ensure_future(_read(ws)))
                    accepted += 1
                opened_s = time.monotonic() - t0
                await asyncio.sleep(max(0.0, args.attack_s / 2 - opened_s))
                victim_status, victim = await status_of(http, "POST", gateway.url + "/v1/sessions",
                                                        headers={"X-API-Key": "victim"})
                await asyncio.sleep(max(0.0, args.attack_s - (time.monotonic() - t0)))
            still_open = sum(not ws.closed for ws in sockets)
            out = {"watchers_accepted": accepted, "watchers_refused_429": refused, "watchers_other_failures": other,
                   "baseline": baseline.figures, "attack": attack.figures,
                   "late_vs_baseline": ratio_line(baseline.figures, attack.figures),
                   "watchers_open_at_end": still_open, "victim_create_status": victim_status,
                   "victim_error": None if victim_status == 201 else (victim or {}).get("error")}
        print(f"watchers {accepted} accepted, {refused} refused, {still_open} open at the end; late {baseline.figures['late_pct']} % before, "
              f"{attack.figures['late_pct']} % during (x{out['late_vs_baseline']['ratio']}); server CPU "
              f"{baseline.figures['server_cpu_pct']} -> {attack.figures['server_cpu_pct']} %; victim POST {victim_status}",
              flush=True)
        return out
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
        await close_all(clients)
        await gateway.stop()


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--watchers", type=int, default=250)
    parser.add_argument("--innocents", type=int, default=4)
    parser.add_argument("--baseline-s", type=float, default=10.0)
    parser.add_argument("--attack-s", type=float, default=20.0)
    parser.add_argument("--realtime", action="store_true",
                        help="the gateway at --media-priority realtime (on a shared machine, so its baseline is its own)")
    parser.add_argument("--lift-limits", action="store_true",
                        help="the watcher limits out of the way: the late-frame rule alone")
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    if args.quick:
        args.baseline_s, args.attack_s = 5.0, 8.0
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = {"what": f"gateway late frames (its own counters) of {args.innocents} speaking sessions while another key opens "
                       f"{args.watchers} ?audio=pcm16 watchers on one session with caller audio; tone engine, "
                       f"{'watcher limits lifted' if args.lift_limits else 'default limits'}, server at media priority "
                       f"{'realtime' if args.realtime else 'normal'}, clients at nice 19, loopback",
               "args": {k: v for k, v in vars(args).items() if k != "out"}}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("watchers-lifted" if args.lift_limits else "watchers", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
