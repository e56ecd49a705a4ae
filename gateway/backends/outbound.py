"""The one guard on every connection Voxgate opens on an application's say: the relay's
WebSocket (gateway/backends/relay.py), the audio a relay's `play` fetches (gateway/backends/relay_play.py) and
its status callback (gateway/backends/relay_status.py). Recognizer and engine URLs are the operator's
own and are not guarded.

Loopback, private, link-local, multicast and reserved addresses are reached only when the
operator allows them (--relay-allow-private). A name is checked on every address it resolves
to, and aiohttp connects to exactly the addresses the resolver returned, so a name that
resolves to a public address when checked and a private one a moment later (DNS rebinding)
cannot slip through: there is no second lookup. An IP literal never reaches the resolver,
so `refuse_private_host` checks it before the request.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

ALLOW_FLAG = "--relay-allow-private"


class PrivateAddress(OSError):
    """A URL's host is, or resolves to, an address allowed only with --relay-allow-private."""


def private_address(host: str) -> bool:
    """Whether an IP address is one reached only with --relay-allow-private (a name is not an address: False)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


def refuse_private_host(host: str, allow_private: bool) -> None:
    """An IP-literal host outside the public Internet, refused unless allowed (names: GuardedResolver)."""
    if private_address(host) and not allow_private:
        raise PrivateAddress(f"{host} is a private address (allowed only with {ALLOW_FLAG})")


class GuardedResolver(AbstractResolver):
    """The default resolver, refusing a name with any address outside the public Internet
    unless private addresses are allowed: the check is on the addresses connected to."""

    def __init__(self, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if not self._allow_private and any(private_address(r["host"]) for r in results):
            raise PrivateAddress(f"{host} resolves to a private address (allowed only with {ALLOW_FLAG})")
        return results

    async def close(self) -> None:
        await self._inner.close()


def guarded_http(allow_private: bool, *, timeout: aiohttp.ClientTimeout | None = None) -> aiohttp.ClientSession:
    """A client session whose every connection passes the guard: one connection at a time, no DNS
    cache shared with anything else, no cookies kept, no proxy from the environment."""
    connector = aiohttp.TCPConnector(resolver=GuardedResolver(allow_private), limit=1)
    return aiohttp.ClientSession(connector=connector, timeout=timeout or aiohttp.ClientTimeout(),
                                 cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)


def private_refusal(exc: BaseException) -> PrivateAddress | None:
    """The guard's refusal inside an aiohttp connection error, if that is what it was."""
    if isinstance(exc, PrivateAddress):
        return exc
    inner = getattr(exc, "os_error", None)
    return inner if isinstance(inner, PrivateAddress) else None


def shown_url(url: str) -> str:
    """A URL for a log line or an `error`: scheme, host and path, never its query or credentials (secrets)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}"[:200]
