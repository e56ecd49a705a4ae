"""Helpers for the security tests: raw HTTP, a loop-responsiveness probe, log checks."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.parse

import aiohttp


def host_port(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlparse(url)
    return parsed.hostname, parsed.port


async def http_json(method: str, url: str, *, body=None, headers: dict | None = None, raw: bytes | None = None):
    """(status, parsed JSON body or None, headers) of one request."""
    async with aiohttp.ClientSession() as http:
        kwargs = {"headers": headers or {}}
        if raw is not None:
            kwargs["data"] = raw
        elif body is not None:
            kwargs["json"] = body
        async with http.request(method, url, **kwargs) as resp:
            data = await resp.read()
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            return resp.status, parsed, resp.headers


def raw_request(url: str, head: bytes, parts: list[bytes], pause_s: float = 0.3, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send a request over a raw socket, its body in several TCP writes with a pause between
    them (the way offers arrive over real networks); returns (status, body)."""
    host, port = host_port(url)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head)
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause_s)  # the pause is the point: the body is split in time
            sock.sendall(part)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head_end = data.index(b"\r\n\r\n")
    status = int(data.split(b" ", 2)[1])
    return status, data[head_end + 4 :]


class LoopProbe:
    """Measures how long the server takes to answer GET /healthz, over and over.

    Every session's audio is paced on the same event loop that answers
    /healthz, so its latency is the stall every session would hear.
    """

    def __init__(self, base_url: str) -> None:
        self.url = base_url + "/healthz"
        self.latencies: list[float] = []
        self._stop = asyncio.Event()
        self._after = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "LoopProbe":
        self._task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as http:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                async with http.get(self.url) as resp:
                    await resp.read()
                self.latencies.append(time.perf_counter() - t0)
                if self._after is not None:
                    self._after -= 1
                    if self._after <= 0:
                        self._stop.set()

    async def finish(self, more_probes: int = 5) -> float:
        """Take a few more probes (so work queued behind the last one is seen), then the worst latency."""
        self._after = more_probes
        await asyncio.wait_for(self._task, 120)
        return max(self.latencies)

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()


def log_text(server) -> str:
    server.log.flush()
    with open(server.log_path, encoding="utf-8", errors="replace") as f:
        return f.read()
