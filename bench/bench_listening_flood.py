"""A connected caller's own SRTP floods (issue 53, findings 1 and 4), against the other sessions' frames.

    python bench/bench_listening_flood.py [--quick] [--out bench/results/listening-flood.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, ICE on
127.0.0.1), with bench/bench_stun_flood.py's harness: `--listeners` sessions
(aiortc peers in this process) speak tone audio all the time, and an attacker
process connects a caller session of its own whose microphone track never
sends, so that its RTP is the attacker's alone (tests/security/rtp_flood.py:
protected with the session's own keys, sent on its nominated ICE pair). Then
`--rounds` rounds of five windows of `--window` seconds each:

1. baseline: nothing;
2. ssrc: `--rate` packets a second of 20 ms Opus, each from a new random SSRC
   (finding 1: libsrtp's stream per SSRC, searched one by one);
3. after: nothing again, right after the SSRC flood (the issue measured 82 %
   late frames here, at the baseline's packet rate, before the fix);
4. packets: `--rate` packets a second of 20 ms Opus from the caller's own SSRC,
   RTP time 20 ms apart (finding 4: each one decoded);
5. jumps: `--jump-rate` one-byte Opus packets a second, each 1 s ahead of the
   last in RTP time (finding 4: 50 frames of silence each).

During every window, another key's new session is made (`POST /v1/sessions`,
then deleted) every 2 s: refused ones are counted. The attacker's session is
made with a key of its own (the listeners' are anonymous), so late-frame
admission can tell them apart: when it blames the attacker's datagrams
(gateway/load/mic_charge.py) it closes the attacker's session, and the JSON's
`attacker_closed` says in which window and how far into it (null: never; the
rule acts only while more than 5 % of frames are late). Per kind of window, summed over the
rounds, measured at the server: late frames (the pacer's, over 5 ms after their
deadline) and frames of every session, the server process's CPU and RSS, and
`voxgate_mic_dropped_total` by reason. The listeners and the attacker stand
for other machines: they run at nice 19. Ratios are against the baseline
windows of the same run. `--before-python` runs the same against a server with
older code.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    arg_parser, finish, free_port, machine, print_machine, proc_cpu_s, proc_mem_mb, ratio, section, stop_server,
    wait_ready,
)
from bench_stun_flood import _normal_priority, metric, speak_forever  # noqa: E402

WINDOWS = ("baseline", "ssrc", "after", "packets", "jumps")
DROP_REASONS = ("ssrc", "packet_rate", "media_rate")
TINY = b"\xf8"
ATTACKER, OTHER = "bench-attacker", "bench-other"  # API keys: the attacker's tenant, and another's  # an Opus packet of its TOC byte alone: 20 ms (CELT, fullband), no data


# The attacker, in its own process -------------------------------------------------------------


async def attacker(url: str, rate: float, jump_rate: float, seconds: float) -> None:
    import numpy as np

    from voxgate.gateway.media import opus
    from tests.security.rtp_flood import RtpFlood, silent_caller

    import aiohttp

    for _ in range(30):  # a shared machine's admission may refuse it for a while (late frames)
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/sessions", json={},
                                                               headers={"X-API-Key": ATTACKER}) as resp:
            made = await resp.json(content_type=None)
            if resp.status != 503:
                break
        await asyncio.sleep(1.0)
    assert resp.status == 201, made
    client = await silent_caller(url, tries=30, session_id=made["session_id"], token=made["client_token"])
    flood = RtpFlood(client)
    rng = np.random.default_rng(53)
    noise = (rng.normal(0, 8000, 960)).clip(-32767, 32767).astype(np.int16)
    payload = opus.Encoder(48000, 32000, 5, False, 0, False).encode(noise)[0]
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    sent = {"ssrc": 0, "packets": 0, "jumps": 0}
    closed = None  # when the gateway closed the attacker's session: its window, seconds into it
    while True:
        command = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if command not in sent:
            break
        per_s = jump_rate if command == "jumps" else rate
        started, window_at, n = time.monotonic(), time.perf_counter(), 0
        while time.monotonic() - started < seconds:
            due = int((time.monotonic() - started) * per_s)
            if due > n:
                if command == "ssrc":
                    flood.ssrc_flood(due - n, payload)
                elif command == "packets":
                    flood.packets(due - n, payload)
                else:
                    flood.packets(due - n, TINY, step=48000)
                n = due
            await asyncio.sleep(0.002)
        sent[command] += n
        if closed is None:
            at = next((t for t, e in client.event_log
                       if e.get("type") == "session.closed" or e.get("code") == "late_frames"), None)
            if at is not None:
                closed = {"window": command, "after_s": round(at - window_at, 2),
                          "events": [e for _, e in client.event_log
                                     if e.get("type") == "session.closed" or e.get("code") == "late_frames"]}
        print("DONE " + json.dumps({**sent, "unsent_connection_gone": flood.lost, "closed": closed}), flush=True)
    await client.close()


# The listeners and the measurement, in this process --------------------------------------------


def _code(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("code") if isinstance(error, dict) else (body or {}).get("code", "?"))


async def measure(args, python: str = sys.executable) -> dict:
    import aiohttp

    from voxgate.rtc_client import RtcClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [python, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1",
         "--engine", "tone", "--log-level", "WARNING", "--no-web", "--connect-timeout-s", "3600",
         "--api-key", ATTACKER, "--api-key", OTHER],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", preexec_fn=_normal_priority)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    results: dict = {"what": "other sessions' late frames, new sessions refused and server RSS while one connected "
                             "caller floods its own session's SRTP (new SSRCs, packets, RTP-time jumps); tone engine, "
                             "priority normal, loopback",
                     "listeners": args.listeners, "window_s": args.window, "rounds": args.rounds, "rate": args.rate,
                     "jump_rate": args.jump_rate}
    attack = None
    clients: list = []
    tasks: list = []
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, url)
        # The attacker's session first: on a shared machine, admission may refuse newcomers once the
        # listeners speak (late frames), and the attack is what is measured, not its admission.
        attack = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), "--attacker", url, "--rate", str(args.rate),
            "--jump-rate", str(args.jump_rate), "--window", str(args.window),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = await asyncio.wait_for(attack.stdout.readline(), 60)
        assert line.strip() == b"READY", line
        for _ in range(args.listeners):
            client = RtcClient(url)
            await client.connect()
            clients.append(client)
        tasks = [asyncio.ensure_future(speak_forever(c, i)) for i, c in enumerate(clients)]
        await asyncio.sleep(3.0)
        async with aiohttp.ClientSession() as http:

            async def snapshot() -> dict:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                return {"t": time.perf_counter(), "cpu_s": proc_cpu_s(server.pid), **proc_mem_mb(server.pid),
                        "late": metric(text, "voxgate_pacer_late_frames_total"),
                        "frames": metric(text, "voxgate_pacer_departure_jitter_seconds_count"),
                        "dropped": {r: metric(text, "voxgate_mic_dropped_total", f'reason="{r}"') for r in DROP_REASONS}}

            async def new_sessions(statuses: dict) -> None:
                """POST /v1/sessions every 2 s (then DELETE): what another tenant would get."""
                while True:
                    async with http.post(url + "/v1/sessions", json={}, headers={"X-API-Key": OTHER}) as resp:
                        body = await resp.json(content_type=None)
                        why = str(resp.status) if resp.status < 300 else f"{resp.status} {_code(body)}"
                        statuses[why] = statuses.get(why, 0) + 1
                    if resp.status < 300 and isinstance(body, dict) and body.get("session_id"):
                        async with http.delete(f"{url}/v1/sessions/{body['session_id']}", headers={"X-API-Key": OTHER}) as gone:
                            await gone.read()
                            if gone.status >= 300:  # left open, it would count against the key's limit
                                statuses[f"delete {gone.status}"] = statuses.get(f"delete {gone.status}", 0) + 1
                    await asyncio.sleep(2.0)

            sums: dict = {name: None for name in WINDOWS}
            for n in range(args.rounds):
                section(f"round {n + 1} of {args.rounds}")
                for name in WINDOWS:
                    statuses: dict = {}
                    prober = asyncio.ensure_future(new_sessions(statuses))
                    a = await snapshot()
                    if name in ("baseline", "after"):
                        await asyncio.sleep(args.window)
                    else:
                        attack.stdin.write(name.encode() + b"\n")
                        await attack.stdin.drain()
                        done = await asyncio.wait_for(attack.stdout.readline(), args.window + 60)
                        assert done.startswith(b"DONE"), done
                        results["attacker_sent"] = json.loads(done.split(b" ", 1)[1])
                        closed = results["attacker_sent"].pop("closed")
                        if closed is not None and results.get("attacker_closed") is None:
                            results["attacker_closed"] = closed
                            print(f"the gateway closed the attacker's session {closed['after_s']} s into the "
                                  f"{closed['window']} window: {closed['events']}", flush=True)
                    b = await snapshot()
                    prober.cancel()
                    span = b["t"] - a["t"]
                    row = {"window_s": span, "frames": int(b["frames"] - a["frames"]),
                           "late_frames": int(b["late"] - a["late"]), "cpu_s": b["cpu_s"] - a["cpu_s"],
                           "rss_mb_start": a["rss_mb"], "rss_mb_end": b["rss_mb"],
                           "new_sessions": sum(statuses.values()),
                           "new_sessions_refused": sum(v for k, v in statuses.items() if not k.startswith("2")),
                           "new_session_statuses": statuses,
                           "mic_dropped": {r: int(b["dropped"][r] - a["dropped"][r]) for r in DROP_REASONS}}
                    print(f"{name:9s} late {row['late_frames']:5d}/{row['frames']} frames  cpu "
                          f"{100 * row['cpu_s'] / span:.1f} %  rss {b['rss_mb']} MB  refused "
                          f"{row['new_sessions_refused']}/{row['new_sessions']}  dropped {row['mic_dropped']}", flush=True)
                    s = sums[name]
                    if s is None:
                        sums[name] = row
                    else:
                        for k in ("window_s", "frames", "late_frames", "cpu_s", "new_sessions", "new_sessions_refused"):
                            s[k] += row[k]
                        s["rss_mb_end"] = row["rss_mb_end"]
                        s["mic_dropped"] = {r: s["mic_dropped"][r] + row["mic_dropped"][r] for r in DROP_REASONS}
            attack.stdin.write(b"quit\n")
            await attack.stdin.drain()

            section(f"all {args.rounds} rounds")
            base = sums["baseline"]
            base_late = base["late_frames"] / max(1, base["frames"])
            for name in WINDOWS:
                r = results[name] = sums[name]
                r["late_fraction"] = r["late_frames"] / max(1, r["frames"])
                r["server_cpu_pct"] = round(100 * r.pop("cpu_s") / r["window_s"], 1)
                r["rss_growth_mb"] = round(r["rss_mb_end"] - r["rss_mb_start"], 1)
                if name != "baseline":
                    r["late_fraction_vs_baseline"] = ratio(r["late_fraction"], base_late)
                print(f"{name:9s} late {r['late_frames']:5d}/{r['frames']} ({100 * r['late_fraction']:.3f} %"
                      + (f", x{r['late_fraction_vs_baseline']:.2f} of baseline" if name != "baseline" else "")
                      + f")  cpu {r['server_cpu_pct']} %  RSS {r['rss_growth_mb']:+.1f} MB  refused "
                      f"{r['new_sessions_refused']}/{r['new_sessions']}  dropped {r['mic_dropped']}", flush=True)
            results.setdefault("attacker_closed", None)
            if results["attacker_closed"] is None:
                print("the attacker's session was not closed", flush=True)
            results["server_rss_mb_first_to_last"] = round(sums[WINDOWS[-1]]["rss_mb_end"] - base["rss_mb_start"], 1)
    finally:
        for task in tasks:
            task.cancel()
        for client in clients:
            await client.close()
        if attack is not None and attack.returncode is None:
            attack.kill()
            await attack.wait()
        stop_server(server)
    return results


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--listeners", type=int, default=8)
    parser.add_argument("--window", type=float, default=30.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the five windows")
    parser.add_argument("--rate", type=float, default=4000.0, help="packets a second, SSRC and packet floods")
    parser.add_argument("--jump-rate", type=float, default=2000.0, help="packets a second, each 1 s ahead")
    parser.add_argument("--before-python", metavar="PYTHON",
                        help="then run the same against a server started with this interpreter (the code before "
                        "the fix), as before_fix in the JSON")
    parser.add_argument("--attacker", metavar="URL", help=__import__("argparse").SUPPRESS)
    args = parser.parse_args()
    if args.attacker:
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # it stands for another machine
        asyncio.run(attacker(args.attacker, args.rate, args.jump_rate, args.window))
        return 0
    if args.quick:
        args.window, args.listeners = 8.0, 4
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = asyncio.run(measure(args))
    if args.before_python:
        section(f"the same, against the code before the fix ({args.before_python})")
        before = asyncio.run(measure(args, args.before_python))
        results["before_fix"] = {k: before[k] for k in (*WINDOWS, "attacker_sent", "attacker_closed")}
    results["machine"] = info
    finish("listening-flood", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
