"""ICE policy: which local addresses we offer, and which remote candidates we accept.

aioice offers every interface except 127.0.0.1, and aiortc defaults to a public
STUN server. Voxgate offers only the configured host addresses (loopback in
tests), uses only configured STUN/TURN servers (none by default), and drops
remote candidates outside an allow-list of networks, so a peer cannot make
the gateway probe internal networks.

The allow-list governs where the gateway *sends* connectivity checks. A peer
that itself sends checks from another address still connects (aioice learns
it as a peer-reflexive candidate and answers on the path the peer opened);
that reaches no host the peer could not already reach, and it is how browsers
that hide their addresses behind mDNS names connect at all.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from aiortc import RTCConfiguration, RTCIceServer

from ..media import rtc_internals
from .turn import turn_credentials

log = logging.getLogger(__name__)

# A peer's remote candidates: those its offer and trickle signal, and those learned from its
# checks (peer-reflexive). A browser has a few; one per address and transport it can be reached
# on (host, server-reflexive, relayed), each over IPv4 and IPv6, stays well under this.
MAX_REMOTE_CANDIDATES = 32
# Binding requests a connection passes to aioice each second (and in one burst): a browser
# checks each candidate pair every 50 ms or so while connecting, then asks for consent every 5 s.
MAX_STUN_REQUESTS_PER_S = 200
# Checks the gateway sends to an address that has never answered one, then one per
# CHECK_REFILL_S: a lost check or two is retried, a spoofed source gets no amplification.
MAX_CHECKS_PER_SOURCE = 3
CHECK_REFILL_S = 10.0

_host_addresses: list[str] | None = None


# Prefixes that embed or tunnel to IPv4 addresses: Python calls some of them
# global, but a candidate there reaches whatever IPv4 host the bits name,
# private ones included. Refused unless listed with --ice-allow.
TRANSLATED_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "64:ff9b::/96",  # NAT64, well-known prefix
        "64:ff9b:1::/48",  # NAT64, local-use prefix
        "2002::/16",  # 6to4
        "2001::/32",  # Teredo
        "::ffff:0:0/96",  # IPv4-mapped
        "::/96",  # IPv4-compatible (deprecated)
    )
)


def restrict_host_addresses(addresses: list[str] | None) -> None:
    """Offer only these local addresses as host candidates (None: every interface).

    aioice reads host addresses through one module-level function, so this is
    process-wide; the gateway sets it once at start-up.
    """
    global _host_addresses
    _host_addresses = list(addresses) if addresses else None
    rtc_internals.set_host_addresses(_host_addresses_hook)


def _host_addresses_hook(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    if _host_addresses is None:
        return rtc_internals.original_host_addresses(use_ipv4, use_ipv6)
    out = []
    for addr in _host_addresses:
        version = ipaddress.ip_address(addr).version
        if (version == 4 and use_ipv4) or (version == 6 and use_ipv6):
            out.append(addr)
    return out


def offered_host_addresses() -> list[str]:
    """The local addresses peers are offered as host candidates, as aioice will gather them now."""
    return rtc_internals.host_addresses()


def parse_ice_server(url: str) -> RTCIceServer:
    """`turn:user:pass@host:3478?transport=udp` style URLs; credentials optional."""
    username = credential = None
    scheme, _, rest = url.partition(":")
    if scheme not in ("stun", "turn", "turns"):
        raise ValueError(f"ICE server URL {url!r} must start with stun:, turn: or turns:")
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        username, _, credential = userinfo.partition(":")
    return RTCIceServer(urls=f"{scheme}:{rest}", username=username or None, credential=credential or None)


@dataclass
class IcePolicy:
    servers: list[RTCIceServer] = field(default_factory=list)
    # Remote candidates must come from these networks, or be public addresses
    # when allow_public is set; private ranges are refused unless listed.
    allowed_networks: list[ipaddress._BaseNetwork] = field(default_factory=list)
    allow_public: bool = True
    # coturn REST-auth shared secret: TURN servers without static credentials
    # get short-lived ones, minted per peer.
    turn_secret: str | None = None
    turn_ttl_s: int = 3600

    def servers_for(self, user: str) -> list[RTCIceServer]:
        out = []
        for server in self.servers:
            url = server.urls if isinstance(server.urls, str) else server.urls[0]
            if self.turn_secret and url.startswith("turn") and not server.username:
                creds = turn_credentials(self.turn_secret, self.turn_ttl_s, user, url)
                server = RTCIceServer(urls=url, username=creds["username"], credential=creds["credential"])
            out.append(server)
        return out

    def rtc_configuration(self, user: str = "voxgate") -> RTCConfiguration:
        # An explicit list, even empty: aiortc would otherwise use a public STUN server.
        # A TURN server we hold no credentials for is for clients only.
        servers = [
            s for s in self.servers_for(user)
            if s.username or not (s.urls if isinstance(s.urls, str) else s.urls[0]).startswith("turn")
        ]
        return RTCConfiguration(iceServers=servers)

    def allows(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False  # mDNS (.local) names and junk: not resolvable to a checked network
        if any(ip in net for net in self.allowed_networks):
            return True
        if ip.version == 6 and any(ip in net for net in TRANSLATED_NETWORKS):
            return False
        return self.allow_public and ip.is_global

    def filter_sdp(self, sdp: str) -> tuple[str, int]:
        """Drop candidate lines from disallowed networks, and those past MAX_REMOTE_CANDIDATES
        addresses (bundled sections may list the same ones); returns (sdp, dropped count)."""
        kept, dropped = [], 0
        addresses: set[tuple[str, str]] = set()
        for line in sdp.splitlines():
            if line.startswith("a=candidate:"):
                parts = line.split()
                if len(parts) < 6 or not self.allows(parts[4]):
                    dropped += 1
                    continue
                address = (parts[4], parts[5])
                if address not in addresses and len(addresses) >= MAX_REMOTE_CANDIDATES:
                    dropped += 1
                    continue
                addresses.add(address)
            kept.append(line)
        return "\r\n".join(kept) + "\r\n", dropped


def parse_networks(values: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for value in values:
        try:
            nets.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not a network; use CIDR such as 127.0.0.0/8 or 203.0.113.0/24") from None
    return nets


def guard_ice(pc, on_drop: Callable[[str], None] | None = None) -> list["IceGuard"]:
    """Put an `IceGuard` in front of each of the peer connection's ICE connections.

    Called once gathering is over (setLocalDescription): aioice makes no
    protocols after it. `on_drop(reason)` hears about each datagram or check
    the guard drops ("candidate_limit", "stun_rate", "check_budget").
    """
    guards = []
    for connection in rtc_internals.ice_connections(pc):
        if not rtc_internals.ice_guardable(connection):
            global _warned_unguarded
            if not _warned_unguarded:
                _warned_unguarded = True
                log.warning("this aioice (%s) lacks what the ICE flood guard reads; remote candidates and checks "
                            "are not bounded (pyproject.toml pins the versions it was tested with)",
                            rtc_internals.versions()["aioice"])
            continue
        guards.append(IceGuard(connection, on_drop))
    return guards


_warned_unguarded = False


def remote_candidate_count(pc) -> int:
    """How many remote candidates the peer connection's ICE holds (signalled and learned)."""
    return max((len(rtc_internals.remote_candidates(c)) for c in rtc_internals.ice_connections(pc)), default=0)


class IceGuard:
    """What one aioice connection takes from the network, bounded before aioice sees it.

    aioice keeps a peer's remote candidates in a list it scans for every
    incoming check and re-sorts with every addition, learns a new
    peer-reflexive candidate from every authenticated check that comes from a
    new source address, never forgets one, and sends up to 7 checks of its
    own to each (a reflection with amplification, when the source is
    spoofed). A peer holding its own session's ICE password could so grow
    that list without end and slow every session on the event loop. Here:

    - the list holds at most `MAX_REMOTE_CANDIDATES`: a binding request from
      a source outside it is dropped once it is full;
    - binding requests reach aioice at most `MAX_STUN_REQUESTS_PER_S` a second
      per connection (bursts of as many);
    - aioice sends at most `MAX_CHECKS_PER_SOURCE` checks to an address that
      has not yet answered one, then one every `CHECK_REFILL_S`.

    Every datagram also has its exceptions kept here: aioice expects only
    ValueError from its STUN parser, and a crafted datagram (an attribute of
    the wrong length) raises struct.error out of asyncio's datagram callback,
    a traceback in the log per datagram. Those are dropped, counted, and
    logged once per connection.
    """

    def __init__(self, connection, on_drop: Callable[[str], None] | None = None) -> None:
        self.connection = connection
        self._remote = rtc_internals.remote_candidates(connection)  # aioice only appends to this list
        self._known: set[tuple[str, int]] = set()
        self._known_len = -1
        self._on_drop = on_drop or (lambda reason: None)
        self.dropped: dict[str, int] = {"candidate_limit": 0, "stun_rate": 0, "check_budget": 0, "error": 0}
        self._requests = TokenBucket(MAX_STUN_REQUESTS_PER_S, MAX_STUN_REQUESTS_PER_S)
        self._check_budgets: dict[tuple[str, int], TokenBucket] = {}
        self._answered: set[tuple[str, int]] = set()
        rtc_internals.wrap_protocols(connection, self._receiver, self._sender)

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] == 1 and reason != "error":
            log.info("ICE: dropped %s (%s); logged once per connection", _DROP_WHY[reason], reason)
        self._on_drop(reason)

    def admit(self, data: bytes, addr) -> bool:
        """Whether a datagram may reach aioice: anything but a STUN binding request does."""
        if len(data) < 20 or data[0] != 0 or data[1] != 1:
            return True
        remote = self._remote
        if len(remote) != self._known_len:
            self._known = {rtc_internals.candidate_key(c) for c in remote}
            self._known_len = len(remote)
        if len(remote) >= MAX_REMOTE_CANDIDATES and (addr[0], addr[1]) not in self._known:
            self._drop("candidate_limit")
            return False
        if not self._requests.take():
            self._drop("stun_rate")
            return False
        return True

    def may_check(self, addr) -> bool:
        """Whether aioice may send a check (a binding request) to `addr` now."""
        key = (addr[0], addr[1])
        if key in self._answered:
            return True
        budget = self._check_budgets.get(key)
        if budget is None:
            # One per remote candidate: bounded like the candidates themselves.
            budget = self._check_budgets[key] = TokenBucket(MAX_CHECKS_PER_SOURCE, 1 / CHECK_REFILL_S)
        if budget.take():
            return True
        if rtc_internals.has_succeeded(self.connection, key):
            self._answered.add(key)
            self._check_budgets.pop(key, None)
            return True
        self._drop("check_budget")
        return False

    def _receiver(self, datagram_received):
        def guarded(data: bytes, addr) -> None:
            try:
                if self.admit(data, addr):
                    datagram_received(data, addr)
            except Exception as exc:
                self._drop("error")
                if self.dropped["error"] == 1:
                    log.warning("dropped a datagram aioice could not handle (%s: %s); logged once per session",
                                type(exc).__name__, exc)

        return guarded

    def _sender(self, send_stun):
        def guarded(message, addr) -> None:
            if rtc_internals.is_binding_request(message) and not self.may_check(addr):
                return  # as if lost: aioice's transaction retransmits or times out as it would
            send_stun(message, addr)

        return guarded


_DROP_WHY = {
    "candidate_limit": f"a binding request from a new address: the peer already has {MAX_REMOTE_CANDIDATES} remote candidates",
    "stun_rate": f"binding requests beyond {MAX_STUN_REQUESTS_PER_S} a second",
    "check_budget": f"a check to an address that has not answered {MAX_CHECKS_PER_SOURCE} before it",
}


class TokenBucket:
    """`capacity` at once, refilled at `rate` a second."""

    __slots__ = ("capacity", "rate", "tokens", "at")

    def __init__(self, capacity: float, rate: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.tokens = float(capacity)
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
