"""A connected peer's STUN and trickle floods, against the other sessions' frames.

    python bench/bench_stun_flood.py [--quick] [--out bench/results/stun-flood.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, ICE on
127.0.0.1). `--listeners` sessions (aiortc peers in this process) speak tone
audio all the time. An attacker process connects a session of its own and
reads its ICE credentials from the answer. Then `--rounds` rounds of three
windows each (a shared machine's noise falls on all three alike):

1. baseline: nothing;
2. stun: the attacker signs binding requests with its session's ICE password
   and sends them at `--rate` a second, each from a new source address (a
   socket bound to a random 127.x.y.z, closed after one datagram: tens of
   thousands of sources, as a spoofing attacker would have). In the first
   round, `--probes` sockets that stay open send one request each first, and
   count the checks the gateway sends back to them for the rest of the run:
   the checks per unverified source;
3. trickle: a second session, offered without end-of-candidates, gets
   candidates (`POST /v1/sessions/{id}/candidates`) at `--trickle-rate` a second.

Per kind of window, summed over the rounds, measured at the server: late
frames (the pacer's, over 5 ms after their deadline) and frames of every
session (the attacker's idle one included: one of listeners + 1), the server
process's CPU, its RSS, `voxgate_ice_dropped_total`; at the client socket:
`/healthz` answer times (one request every 50 ms). The listeners and the
attacker stand for other machines: they run at nice 19, so they take no core
the gateway wants (on 2 cores they otherwise make its frames late by
themselves). Ratios are against the
baseline windows of the same run. `--before-python` runs the same against a
server with older code, for comparison.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    arg_parser, finish, free_port, machine, print_machine, proc_cpu_s, proc_mem_mb, ratio, section, summary_ms,
    stop_server, wait_ready,
)

SPEECH = ("Listener {i} keeps talking, sentence after sentence, so that every frame of its audio "
          "has a deadline the pacer must meet while the attack goes on. ") * 3


WINDOWS = ("baseline", "stun", "trickle")


def add_rows(a: dict, b: dict) -> dict:
    """Two windows' figures as one (RSS: the first's start, the second's end)."""
    return {"window_s": a["window_s"] + b["window_s"], "frames": a["frames"] + b["frames"],
            "late_frames": a["late_frames"] + b["late_frames"], "healthz_s": a["healthz_s"] + b["healthz_s"],
            "cpu_s": a["cpu_s"] + b["cpu_s"], "server_rss_mb_start": a["server_rss_mb_start"],
            "server_rss_mb_end": b["server_rss_mb_end"],
            "ice_dropped": {k: a["ice_dropped"][k] + b["ice_dropped"][k] for k in a["ice_dropped"]}}


def metric(text: str, name: str, labels: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if labels is None or labels in head:
                if head == name or head.startswith(name + "{"):
                    total += float(value)
    return total


# The attacker, in its own process -------------------------------------------------------------


def _sdp_value(sdp: str, name: str) -> str:
    return re.search(rf"a={name}:(\S+)", sdp).group(1)


def binding_request(gateway_sdp: str, client_sdp: str) -> bytes:
    """A check as the peer would send it: signed with the session's own ICE password."""
    from aioice import stun

    message = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
    message.attributes["USERNAME"] = f"{_sdp_value(gateway_sdp, 'ice-ufrag')}:{_sdp_value(client_sdp, 'ice-ufrag')}"
    message.attributes["PRIORITY"] = 1853824767
    message.attributes["ICE-CONTROLLING"] = 1
    message.add_message_integrity(_sdp_value(gateway_sdp, "ice-pwd").encode("utf8"))
    message.add_fingerprint()
    return bytes(message)


def _checks_received(sock: socket.socket) -> tuple[int, int]:
    """(binding requests, binding responses) that reached this socket."""
    from aioice import stun

    requests = responses = 0
    while True:
        try:
            data = sock.recv(2048)
        except BlockingIOError:
            return requests, responses
        try:
            cls = stun.parse_message(data).message_class
        except ValueError:
            continue
        requests += cls == stun.Class.REQUEST
        responses += cls == stun.Class.RESPONSE


class Attacker:
    """One connected peer of its own, flooding on command (`stun`, `trickle`, `report`, `quit` on stdin)."""

    def __init__(self, url: str, rate: float, seconds: float, probes: int, trickle_rate: float) -> None:
        self.url, self.rate, self.seconds, self.trickle_rate = url, rate, seconds, trickle_rate
        self.probe_count = probes
        self.probes: list[socket.socket] = []
        self.checks = [0] * probes
        self.responses = 0
        self.flood_sent = 0
        self.rng = random.Random(1)
        self.trickle_statuses: dict[int, int] = {}
        self.trickle_session: tuple[str, str] | None = None
        self.started = 0.0

    async def connect(self) -> None:
        from voxgate.rtc_client import RtcClient

        self.client = RtcClient(self.url)
        await self.client.connect()
        gateway_sdp = self.client.pc.remoteDescription.sdp
        self.request = binding_request(gateway_sdp, self.client.pc.localDescription.sdp)
        targets = [(m.group(1), int(m.group(2)))
                   for m in re.finditer(r"a=candidate:\S+ \d+ udp \d+ (\S+) (\d+) typ host", gateway_sdp)]
        self.targets = list(dict.fromkeys(targets))

    def _count_probes(self) -> None:
        for i, sock in enumerate(self.probes):
            requests, responses = _checks_received(sock)
            self.checks[i] += requests
            self.responses += responses

    async def stun(self) -> None:
        if not self.probes:
            # Sources that stay open: each sends one signed request, then counts what comes back.
            self.started = time.monotonic()
            for _ in range(self.probe_count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind(("127.0.0.1", 0))
                sock.setblocking(False)
                self.probes.append(sock)
                for target in self.targets:
                    sock.sendto(self.request, target)
        started, sent = time.monotonic(), 0
        while time.monotonic() - started < self.seconds:
            due = int((time.monotonic() - started) * self.rate)
            while sent < due:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    # A new source for each datagram: all of 127.0.0.0/8 is loopback on Linux.
                    sock.bind((f"127.{self.rng.randint(1, 254)}.{self.rng.randint(0, 255)}.{self.rng.randint(1, 254)}", 0))
                    sock.sendto(self.request, self.targets[sent % len(self.targets)])
                sent += 1
            self._count_probes()
            await asyncio.sleep(0.005)
        self.flood_sent += sent

    async def trickle(self, http) -> None:
        if self.trickle_session is None:
            # A second session, offered the way browsers do: candidates to follow (no end-of-candidates).
            from aiortc import RTCConfiguration, RTCPeerConnection

            self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            self.pc.addTransceiver("audio", direction="recvonly")
            self.pc.createDataChannel("control")
            await self.pc.setLocalDescription(await self.pc.createOffer())
            sdp = "".join(line for line in self.pc.localDescription.sdp.splitlines(keepends=True)
                          if not line.startswith("a=end-of-candidates"))
            async with http.post(self.url + "/v1/offer", json={"sdp": sdp, "type": "offer"}) as resp:
                answer = await resp.json()
            self.trickle_session = (answer["session_id"], answer["token"])
            self.posted = 0
        sid, token = self.trickle_session
        started, posted = time.monotonic(), 0
        while time.monotonic() - started < self.seconds:
            due = int((time.monotonic() - started) * self.trickle_rate)
            while posted < due:
                n = self.posted
                async with http.post(f"{self.url}/v1/sessions/{sid}/candidates", json={
                        "candidate": f"candidate:{n} 1 udp 2130706431 127.{n // 60000 % 250 + 1}.0.1 {1024 + n % 60000} typ host",
                        "sdpMid": "0", "sdpMLineIndex": 0, "token": token}) as resp:
                    await resp.read()
                    self.trickle_statuses[resp.status] = self.trickle_statuses.get(resp.status, 0) + 1
                posted += 1
                self.posted += 1
            self._count_probes()
            await asyncio.sleep(0.005)

    def report(self) -> dict:
        self._count_probes()
        checked = [c for c in self.checks if c]
        return {
            "stun_datagrams_sent": self.flood_sent + len(self.probes) * len(self.targets),
            "stun_sources": self.flood_sent + len(self.probes),
            "probe_sources": len(self.probes), "probe_sources_checked": len(checked),
            "probe_counting_s": round(time.monotonic() - self.started, 1),
            "checks_per_probe_source_max": max(self.checks, default=0),
            "checks_per_checked_probe_source_mean": round(sum(checked) / len(checked), 2) if checked else 0,
            "checks_to_probe_sources_total": sum(self.checks),
            "responses_to_probe_sources_total": self.responses,
            "trickle_posted": sum(self.trickle_statuses.values()), "trickle_statuses": self.trickle_statuses,
        }


async def attacker(url: str, rate: float, seconds: float, probes: int, trickle_rate: float) -> None:
    import aiohttp

    me = Attacker(url, rate, seconds, probes, trickle_rate)
    await me.connect()
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        while True:
            command = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if command == "stun":
                await me.stun()
            elif command == "trickle":
                await me.trickle(http)
            elif command == "report":
                print("REPORT " + json.dumps(me.report()), flush=True)
                continue
            else:
                break
            print("DONE", flush=True)
    for sock in me.probes:
        sock.close()
    await me.client.close()


# The listeners and the measurement, in this process --------------------------------------------


class Probe:
    """GET /healthz every 50 ms; answer times with when they were taken."""

    def __init__(self, url: str) -> None:
        self.url = url + "/healthz"
        self.samples: list[tuple[float, float]] = []
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            while True:
                t0 = time.perf_counter()
                async with http.get(self.url) as resp:
                    await resp.read()
                self.samples.append((t0, time.perf_counter() - t0))
                await asyncio.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))

    def between(self, a: float, b: float) -> list[float]:
        return [d for t, d in self.samples if a <= t < b]


async def speak_forever(client, i: int) -> None:
    n = 0
    while True:
        uid = f"u{n}"
        client.send({"type": "speak", "text": SPEECH.format(i=i), "id": uid})
        await client.wait_for("utterance.done", id=uid, timeout=120)
        n += 1


def _normal_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # the gateway, at the priority it would have (root may lower nice)
    except PermissionError:
        pass


async def measure(args, python: str = sys.executable) -> dict:
    import aiohttp

    from voxgate.rtc_client import RtcClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [python, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1",
         "--engine", "tone", "--log-level", "WARNING", "--no-web", "--connect-timeout-s", "3600"],
        # cwd: the interpreter's own installed voxgate, not this checkout's folder.
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", preexec_fn=_normal_priority)
    # The listeners stand for other machines too: from here on this process yields to the gateway.
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    results: dict = {"what": "other sessions' frames and /healthz while one connected peer floods STUN or trickles "
                             "candidates; tone engine, priority normal, loopback",
                     "listeners": args.listeners, "window_s": args.window, "rounds": args.rounds, "rate": args.rate,
                     "trickle_rate": args.trickle_rate, "probes": args.probes}
    attack = None
    clients = []
    tasks = []
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, url)
        for _ in range(args.listeners):
            client = RtcClient(url)
            await client.connect()
            clients.append(client)
        tasks = [asyncio.ensure_future(speak_forever(c, i)) for i, c in enumerate(clients)]
        probe = Probe(url)
        probe.task = asyncio.ensure_future(probe.run())
        attack = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), "--attacker", url, "--rate", str(args.rate),
            "--window", str(args.window), "--probes", str(args.probes), "--trickle-rate", str(args.trickle_rate),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(attack.stdout.readline(), 60)
        assert line.strip() == b"READY", line
        await asyncio.sleep(3.0)  # every listener speaking, the probe running
        async with aiohttp.ClientSession() as http:

            async def snapshot() -> dict:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                return {"t": time.perf_counter(), "cpu_s": proc_cpu_s(server.pid), **proc_mem_mb(server.pid),
                        "late": metric(text, "voxgate_pacer_late_frames_total"),
                        "frames": metric(text, "voxgate_pacer_departure_jitter_seconds_count"),
                        "ice_dropped": {r: metric(text, "voxgate_ice_dropped_total", f'reason="{r}"')
                                        for r in ("candidate_limit", "stun_rate", "check_budget", "error")}}

            def row(name: str, a: dict, b: dict) -> dict:
                span = b["t"] - a["t"]
                late, frames = int(b["late"] - a["late"]), int(b["frames"] - a["frames"])
                healthz = probe.between(a["t"], b["t"])
                print(f"{name:9s} late {late:5d}/{frames} frames  healthz p50 {summary_ms(healthz).get('p50')} ms  "
                      f"cpu {100 * (b['cpu_s'] - a['cpu_s']) / span:.1f} %  rss {b['rss_mb']} MB", flush=True)
                return {"window_s": span, "frames": frames, "late_frames": late, "healthz_s": healthz,
                        "cpu_s": b["cpu_s"] - a["cpu_s"], "server_rss_mb_start": a["rss_mb"],
                        "server_rss_mb_end": b["rss_mb"],
                        "ice_dropped": {k: int(b["ice_dropped"][k] - a["ice_dropped"][k]) for k in b["ice_dropped"]}}

            async def command(what: str) -> bytes:
                attack.stdin.write(what.encode() + b"\n")
                await attack.stdin.drain()
                return await asyncio.wait_for(attack.stdout.readline(), args.window + 60)

            # Rounds of baseline, STUN flood, trickle: a shared machine's noise falls on all three alike.
            sums = {name: None for name in WINDOWS}
            for n in range(args.rounds):
                section(f"round {n + 1} of {args.rounds}")
                for name in WINDOWS:
                    a = await snapshot()
                    if name == "baseline":
                        await asyncio.sleep(args.window)
                    else:
                        assert (await command(name)).strip() == b"DONE"
                    b = await snapshot()
                    r = row(name, a, b)
                    sums[name] = r if sums[name] is None else add_rows(sums[name], r)
            report = json.loads((await command("report")).split(b" ", 1)[1])
            await command("quit")

            section(f"all {args.rounds} rounds")
            base = sums["baseline"]
            base_late = base["late_frames"] / max(1, base["frames"])
            for name in WINDOWS:
                r = results[name] = sums[name]
                r["late_fraction"] = r["late_frames"] / max(1, r["frames"])
                r["healthz_ms"] = summary_ms(r.pop("healthz_s"))
                r["rss_growth_mb"] = round(r["server_rss_mb_end"] - sums["baseline"]["server_rss_mb_start"], 1)
                r["server_cpu_pct"] = round(100 * r.pop("cpu_s") / r["window_s"], 1)
                if name != "baseline":
                    r["late_fraction_vs_baseline"] = ratio(r["late_fraction"], base_late)
                    r["healthz_p50_vs_baseline"] = ratio(r["healthz_ms"]["p50"], base["healthz_ms"]["p50"])
                print(f"{name:9s} late {r['late_frames']:5d}/{r['frames']} frames ({100 * r['late_fraction']:.3f} %"
                      + (f", x{r['late_fraction_vs_baseline']:.2f} of baseline" if name != "baseline" else "")
                      + f")  healthz p50 {r['healthz_ms']['p50']} ms  cpu {r['server_cpu_pct']} %  "
                      f"RSS {r['rss_growth_mb']:+.1f} MB  dropped {r['ice_dropped']}", flush=True)
            results["attacker"] = report
            print(f"attacker: {report}")
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
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of baseline, STUN flood and trickle windows")
    parser.add_argument("--rate", type=float, default=1000.0, help="STUN requests per second, each from a new source")
    parser.add_argument("--probes", type=int, default=200, help="sources that stay open and count the checks they get")
    parser.add_argument("--trickle-rate", type=float, default=200.0, help="trickled candidates per second")
    parser.add_argument("--before-python", metavar="PYTHON",
                        help="then run the same against a server started with this interpreter (one whose voxgate "
                        "is the code before the fix), as before_fix in the JSON")
    parser.add_argument("--attacker", metavar="URL", help=argparse_hidden())
    args = parser.parse_args()
    if args.attacker:
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # it stands for another machine: it takes no core the gateway wants
        asyncio.run(attacker(args.attacker, args.rate, args.window, args.probes, args.trickle_rate))
        return 0
    if args.quick:
        args.window, args.listeners, args.rounds = 5.0, 4, 2
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = asyncio.run(measure(args))
    if args.before_python:
        section(f"the same, against the code before the guard ({args.before_python})")
        before = asyncio.run(measure(args, args.before_python))
        results["before_fix"] = {k: before[k] for k in (*WINDOWS, "attacker")}
    results["machine"] = info
    finish("stun-flood", results, started, args.out)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
