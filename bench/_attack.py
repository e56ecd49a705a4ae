"""What the issue-53 attack benches share: a gateway in its own process, innocent sessions speaking, the
late-frame share over a window from the gateway's own counters, and HTTP as another tenant sees it.

The gateway is `voxgate serve --engine tone` at normal priority; this process (the attacker and the
innocent listeners) runs at nice 19, as another machine would. "Late" is the gateway's own count of
frames sent more than 5 ms after their deadline (voxgate_pacer_late_frames_total) over the frames it
paced (voxgate_pacer_departure_jitter_seconds_count), as in bench/bench_capacity.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import subprocess
import time

import aiohttp

from _common import free_port, proc_cpu_s, stop_server_async, wait_ready

LATE = "voxgate_pacer_late_frames_total"
PACED = "voxgate_pacer_departure_jitter_seconds_count"
TONE_S_PER_CHAR = 0.04  # the tone engine speaks 40 ms a character


def _priority(nice: int, realtime: bool) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if realtime:  # what `ulimit -r 10` gives a service (docs/operations.md): root may raise it
            resource.setrlimit(resource.RLIMIT_RTPRIO, (10, 10))
    except (PermissionError, ValueError):
        pass


class Gateway:
    """`voxgate serve --engine tone` with `extra` flags, as its own process at nice `nice` (0: normal), or with
    `--media-priority realtime` (on a machine other work shares, so that the same run's baseline is not
    other processes' late frames); its log in /tmp."""

    def __init__(self, python: str, extra: list[str], env: dict | None = None, nice: int = 0,
                 realtime: bool = False) -> None:
        if realtime:
            extra = [*extra, "--media-priority", "realtime"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/bench-attack-{os.getpid()}-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, "-m", "voxgate.cli", "serve", "--port", str(self.port), "--ice-host", "127.0.0.1",
             "--engine", "tone", "--log-level", "WARNING", "--no-web", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, cwd="/", preexec_fn=lambda: _priority(nice, realtime),
            env={**os.environ, **(env or {})})
        os.setpriority(os.PRIO_PROCESS, 0, 19)

    async def ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, self.url)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid)

    async def stop(self) -> None:
        await stop_server_async(self.proc)
        self._log.close()
        if os.environ.get("BENCH_KEEP_LOG"):
            print("gateway log kept:", self.log_path)
        else:
            os.unlink(self.log_path)


async def counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(late frames, frames paced) so far, from the gateway's /metrics."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    values = []
    for name in (LATE, PACED):
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        if match is None:
            raise KeyError(f"the gateway's /metrics has no {name}; bench/_attack.py reads it")
        values.append(float(match.group(1)))
    return values[0], values[1]


class Window:
    """Late frames and the gateway's CPU over one stretch of time."""

    def __init__(self, http: aiohttp.ClientSession, gateway: Gateway) -> None:
        self.http, self.gateway = http, gateway

    async def __aenter__(self) -> "Window":
        self.t0, self.cpu0 = time.monotonic(), self.gateway.cpu_s()
        self.late0, self.paced0 = await counters(self.http, self.gateway.url)
        return self

    async def __aexit__(self, *exc) -> None:
        late, paced = await counters(self.http, self.gateway.url)
        span = time.monotonic() - self.t0
        self.figures = {
            "seconds": round(span, 1), "frames": int(paced - self.paced0), "late": int(late - self.late0),
            "late_pct": round(100.0 * (late - self.late0) / max(1.0, paced - self.paced0), 3),
            "server_cpu_pct": round(100.0 * (self.gateway.cpu_s() - self.cpu0) / span, 1),
        }


async def innocent_speakers(url: str, n: int, seconds: float, key: str | None = None) -> list:
    """`n` sessions (made with `key` through POST /v1/sessions, or by plain offers) that each speak
    one utterance of about `seconds` and listen to it over WebRTC."""
    from voxgate.rtc_client import RtcClient

    clients = []
    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            if key is None:
                client = RtcClient(url)
            else:
                async with http.post(url + "/v1/sessions", headers={"X-API-Key": key}) as resp:
                    made = json.loads(await resp.text())
                    assert resp.status == 201, made
                client = RtcClient(url, session_id=made["session_id"], token=made["client_token"])
            await client.connect()
            client.send({"type": "speak", "text": "a" * int(seconds / TONE_S_PER_CHAR), "id": "long"})
            clients.append(client)
    for client in clients:
        await client.wait_for("audio.started", id="long")
    return clients


async def close_all(clients: list) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def status_of(http: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[int, dict | None]:
    async with http.request(method, url, **kwargs) as resp:
        data = await resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, None


def ratio_line(baseline: dict, attack: dict) -> dict:
    """The attack window's late share against the same run's baseline (a floor of one late frame in
    the baseline, so that a clean baseline does not make any late frame an infinite ratio)."""
    base = max(baseline["late"], 1) / max(1, baseline["frames"])
    during = attack["late"] / max(1, attack["frames"])
    return {"baseline_late_pct": baseline["late_pct"], "attack_late_pct": attack["late_pct"],
            "ratio": round(during / base, 2)}
