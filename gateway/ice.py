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
from dataclasses import dataclass, field

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

from .turn import turn_credentials

log = logging.getLogger(__name__)

_original_get_host_addresses = aioice.ice.get_host_addresses
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
    aioice.ice.get_host_addresses = _host_addresses_hook


def _host_addresses_hook(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    if _host_addresses is None:
        return _original_get_host_addresses(use_ipv4, use_ipv6)
    out = []
    for addr in _host_addresses:
        version = ipaddress.ip_address(addr).version
        if (version == 4 and use_ipv4) or (version == 6 and use_ipv6):
            out.append(addr)
    return out


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
        """Drop candidate lines from disallowed networks; returns (sdp, dropped count)."""
        kept, dropped = [], 0
        for line in sdp.splitlines():
            if line.startswith("a=candidate:"):
                parts = line.split()
                if len(parts) < 5 or not self.allows(parts[4]):
                    dropped += 1
                    continue
            kept.append(line)
        return "\r\n".join(kept) + "\r\n", dropped


def parse_networks(values: list[str]) -> list[ipaddress._BaseNetwork]:
    nets = []
    for value in values:
        try:
            nets.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not a network; use CIDR such as 127.0.0.0/8 or 203.0.113.0/24") from None
    return nets


def contain_datagram_errors(pc) -> int:
    """Keep a malformed datagram's exception inside the session it was sent to.

    aioice parses each datagram on a session's ports as STUN first and expects
    only ValueError from that; a crafted one (an attribute of the wrong length)
    raises struct.error out of asyncio's datagram callback, and the event loop
    logs a traceback for every such datagram, which anyone who can reach a
    port may send as fast as they like. Here each of the peer connection's
    ICE protocols drops what raises, counts it, and logs once per connection.
    Called once gathering is over (setLocalDescription): aioice makes no
    protocols after it. Returns how many protocols it wrapped.
    """
    wrapped = 0
    for connection in _ice_connections(pc):
        dropped = [0]
        for protocol in getattr(connection, "_protocols", ()):
            if hasattr(protocol, "datagram_received"):
                protocol.datagram_received = _contained(protocol.datagram_received, dropped)
                wrapped += 1
    return wrapped


def _ice_connections(pc) -> list:
    """The aioice connections under a peer connection's DTLS transports (one with BUNDLE)."""
    dtls = [t.sender.transport for t in pc.getTransceivers()]
    if pc.sctp is not None:
        dtls.append(pc.sctp.transport)
    found: dict[int, object] = {}
    for transport in dtls:
        connection = getattr(getattr(transport, "transport", None), "_connection", None)
        if connection is not None:
            found[id(connection)] = connection
    return list(found.values())


def _contained(datagram_received, dropped: list[int]):
    def contained(data: bytes, addr) -> None:
        try:
            datagram_received(data, addr)
        except Exception as exc:
            dropped[0] += 1
            if dropped[0] == 1:
                log.warning("dropped a datagram aioice could not handle (%s: %s); logged once per session",
                            type(exc).__name__, exc)

    return contained
