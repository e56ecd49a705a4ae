"""The HTTP server's connections: a deadline for a request's headers, and caps on how many.

aiohttp waits as long as a client likes for the first request's headers, and
takes every connection the kernel hands it: connections that send half a
header and stall (slowloris) piled up until the process ran out of
descriptors, locking every new client out. Here each connection is wrapped
(an asyncio protocol in front of aiohttp's own) before aiohttp sees a byte:

- a connection whose first request head (up to its blank line) has not
  arrived `--header-timeout-s` after it opened is closed; later requests on a
  kept-alive connection are bounded by aiohttp's keep-alive timeout
  (`KEEPALIVE_S`), which counts from the previous answer;
- past `--max-connections` open at once, or `--max-connections-per-ip`
  from one client address (loopback and `--trusted-proxy` networks exempt), a
  new connection gets a 503 and is closed at once. The total is kept under
  half the process's descriptor limit, so that sessions' UDP sockets and the
  engine always have descriptors left.

Running out of descriptors anyway (asyncio's "socket.accept() out of system
resource", or any other EMFILE/ENFILE reaching the loop) is logged at most
once a second, with a count of what was left out, instead of a traceback each.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import resource
import socket
import time
from typing import Callable

from aiohttp import web

log = logging.getLogger(__name__)

# Idle time allowed on a kept-alive connection, from one answer to the next request's head
# (aiohttp's keepalive_timeout; nginx's default is 75 s).
KEEPALIVE_S = 75.0
# The least often descriptor exhaustion, or a refused connection, is logged.
LOG_INTERVAL_S = 1.0
# How long a refused connection is kept, its input dropped, after its 503 (see connection_made).
REFUSAL_LINGER_S = 1.0
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
_REFUSAL = (
    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
    "Retry-After: 1\r\nConnection: close\r\nContent-Length: {length}\r\n\r\n{body}"
)


def _refusal(code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}})
    return _REFUSAL.format(length=len(body), body=body).encode()


REFUSED = {
    "max_connections": _refusal("too_many_connections", "the server has as many connections open as it takes; retry"),
    "max_connections_per_ip": _refusal(
        "too_many_connections", "this address has as many connections open as it may; close some, or retry"),
}


class RateLimitedLog:
    """One line per LOG_INTERVAL_S at most, saying how many were left out since the last."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.last = -interval_s
        self.left_out = 0

    def __call__(self, emit: Callable[[str], None], message: str) -> None:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.left_out += 1
            return
        self.last = now
        more = f" ({self.left_out} more since the last such line)" if self.left_out else ""
        self.left_out = 0
        emit(message + more)


def descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ConnectionGuard:
    """The server-wide state: connections open, in total and per address, and the settings."""

    def __init__(self, header_timeout_s: float, max_connections: int, max_per_address: int,
                 exempt: list | None = None, on_refused: Callable[[str], None] | None = None) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_connections = min(max_connections, descriptor_limit() // 2)
        if self.max_connections < max_connections:
            log.info("at most %d HTTP connections at once: half the %d descriptors this process may open "
                     "(--max-connections %d; raise ulimit -n for more)", self.max_connections, descriptor_limit(),
                     max_connections)
        self.max_per_address = max_per_address  # 0: no limit
        self.exempt = list(exempt or [])
        self.open = 0
        self.by_address: dict[str, int] = {}
        self.on_refused = on_refused or (lambda reason: None)
        self.late = 0  # connections closed for a head that did not arrive in time
        self._refusals_log = RateLimitedLog()

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for loop.create_server: aiohttp's, behind this guard."""
        return lambda: GuardedConnection(self, factory)

    def _exempt(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return ip.is_loopback or any(ip in net for net in self.exempt)

    def admit(self, address: str) -> str | None:
        """None, counting the connection in; or why it is refused."""
        if self.open >= self.max_connections:
            return "max_connections"
        if self.max_per_address and not self._exempt(address) and self.by_address.get(address, 0) >= self.max_per_address:
            return "max_connections_per_ip"
        self.open += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        left = self.by_address.get(address, 1) - 1
        if left > 0:
            self.by_address[address] = left
        else:
            self.by_address.pop(address, None)

    def refused(self, reason: str, address: str) -> None:
        self.on_refused(reason)
        limit = self.max_connections if reason == "max_connections" else self.max_per_address
        self._refusals_log(log.warning, f"refusing HTTP connections: {reason.replace('_', ' ')} ({limit}) reached, "
                                        f"latest from {address}")


class GuardedConnection(asyncio.Protocol):
    """One connection: counted against the caps, closed if its first request head is late,
    and otherwise aiohttp's, every callback passed straight on."""

    __slots__ = ("guard", "factory", "inner", "address", "timer", "tail", "transport")

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self.factory = factory
        self.inner: asyncio.Protocol | None = None
        self.address = ""
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = peer[0] if isinstance(peer, tuple) else str(peer or "")
        why = self.guard.admit(self.address)
        if why is not None:
            self.guard.refused(why, self.address)
            # Answered, then half-closed: what the client already sent is read and dropped for up
            # to REFUSAL_LINGER_S, since closing with it unread would reset the connection and
            # could lose the answer on the way.
            transport.write(REFUSED[why])
            if transport.can_write_eof():
                transport.write_eof()
            self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.abort)
            return
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._head_late)
        self.inner = self.factory()
        self.inner.connection_made(transport)

    def _head_late(self) -> None:
        self.timer = None
        if self.transport is not None:
            self.guard.late += 1
            self.transport.abort()  # connection_lost follows, and tells aiohttp

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.timer is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen:
                self.timer.cancel()
                self.timer = None
                self.tail = b""
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None  # None: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.inner is not None:
            self.guard.release(self.address)
            self.transport = None
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


def quiet_descriptor_exhaustion(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's EMFILE/ENFILE errors (asyncio's accept() among them) at most once a second,
    in one line each, instead of a traceback for every one; everything else as before."""
    previous = loop.get_exception_handler()
    limited = RateLimitedLog()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS:
            limited(log.error, f"out of file descriptors ({context.get('message') or exc}): new connections and "
                               "sessions fail until some close; raise ulimit -n, or lower --max-connections")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def start_servers(loop: asyncio.AbstractEventLoop, guard: ConnectionGuard,
                        factory: Callable[[], asyncio.Protocol], sockets: list[socket.socket]) -> list[asyncio.Server]:
    """Serve aiohttp's protocol factory on each listening socket, behind the guard."""
    servers = []
    for sock in sockets:
        servers.append(await loop.create_server(guard.wrap(factory), sock=sock))
    return servers


def client_address(request: web.Request, trusted: list) -> str:
    """The client's address: the peer's, or the one a trusted reverse proxy names in
    X-Forwarded-For (the right-most address the proxies did not add themselves)."""
    remote = request.remote or "unknown"
    if not trusted:
        return remote
    chain = [remote]
    for value in request.headers.getall("X-Forwarded-For", []):
        chain[:0] = [part.strip() for part in value.split(",") if part.strip()]
    for address in reversed(chain):
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return address[:64]
        if not any(ip in net for net in trusted):
            return address
    return chain[0]
