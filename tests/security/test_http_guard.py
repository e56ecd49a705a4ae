"""Issue 39, finding 5: slowloris. Connections that send half a request head are closed at
--header-timeout-s, connections past --max-connections (or past
--max-connections-per-ip from one address) get a 503 at once, and running out of
descriptors is logged at most once a second, not as a traceback each time.

The first test runs `voxgate serve` (the tone engine) as users do; the per-address test
needs a client address that is not loopback (loopback is exempt), so it serves the app
in-process on this machine's own non-loopback address; no traffic leaves the machine.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
import urllib.request

from tests.security.sec_helpers import host_port
from voxgate.signaling import http_guard

HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def _stall(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(HALF_HEAD)
    return sock


def _answer(host: str, port: int, timeout: float = 5.0) -> bytes:
    """What the server says to one full request, up to its close."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True  # reset: closed as well


async def test_half_sent_heads_are_closed_and_connections_capped(server_factory):
    server = server_factory("tone", ["--header-timeout-s", "1", "--max-connections", "16"])
    host, port = host_port(server.url)
    stalled = [_stall(host, port) for _ in range(16)]
    try:
        # The cap is reached: the next connection is refused at once with a JSON 503, not left waiting.
        started = time.monotonic()
        refused = await asyncio.to_thread(_answer, host, port)
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        assert b"too_many_connections" in refused
        assert time.monotonic() - started < 3.0
        # Every half-sent head is closed about --header-timeout-s after it opened (never, before).
        closed = await asyncio.gather(*(asyncio.to_thread(_closed_by_server, s, 10.0) for s in stalled))
        assert all(closed), f"{closed.count(False)} of {len(stalled)} half-sent heads still open after 10 s"
        assert (await asyncio.to_thread(_answer, host, port)).startswith(b"HTTP/1.1 200")
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        assert 'voxgate_http_connections_refused_total{reason="max_connections"} 1.0' in metrics
    finally:
        for sock in stalled:
            sock.close()


def _own_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    assert not address.startswith("127."), "no address besides loopback to test the per-address cap from"
    return address


async def test_one_address_cannot_take_every_connection():
    from aiohttp import web

    from voxgate.config import Settings
    from voxgate.signaling.server import create_app

    address = _own_address()
    app = create_app(Settings(engine="tone", host="127.0.0.1", ice_host=["127.0.0.1"], web=False))
    runner = web.AppRunner(app)
    await runner.setup()
    guard = http_guard.ConnectionGuard(header_timeout_s=30, max_connections=64, max_per_address=4)
    outside = socket.socket()
    outside.bind((address, 0))
    outside.listen(64)
    inside = socket.socket()
    inside.bind(("127.0.0.1", 0))
    inside.listen(64)
    servers = await http_guard.start_servers(asyncio.get_running_loop(), guard, runner.server, [outside, inside])
    port_out, port_in = outside.getsockname()[1], inside.getsockname()[1]
    stalled = [await asyncio.to_thread(_stall, address, port_out) for _ in range(4)]
    try:
        refused = await asyncio.to_thread(_answer, address, port_out)
        assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused, refused[:200]
        # Loopback (a proxy on this host) is not held to it, nor is anyone else.
        stalled += [await asyncio.to_thread(_stall, "127.0.0.1", port_in) for _ in range(8)]
        assert (await asyncio.to_thread(_answer, "127.0.0.1", port_in)).startswith(b"HTTP/1.1 200")
        stalled[0].close()
        await _until(lambda: guard.by_address.get(address) == 3)
        assert (await asyncio.to_thread(_answer, address, port_out)).startswith(b"HTTP/1.1 200")
    finally:
        for sock in stalled:
            sock.close()
        for srv in servers:
            srv.close()
        await runner.cleanup()


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.02)


async def test_running_out_of_descriptors_is_logged_once_a_second(caplog):
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    http_guard.quiet_descriptor_exhaustion(loop)
    try:
        caplog.set_level(logging.DEBUG)
        for _ in range(1000):  # what asyncio's accept and a session's sockets report when none are left
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1, len(lines)
        assert lines[0].exc_info is None  # one line, no traceback
    finally:
        loop.set_exception_handler(previous)
