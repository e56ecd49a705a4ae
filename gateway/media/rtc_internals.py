"""The one module that reaches into aiortc's, aioice's and pylibsrtp's internals.

Voxgate's fast paths read state below aiortc's public API (`aiortc.__all__`):
the RTP sender loop it replaces (rtp_send.py), the SRTP datagrams it takes for
the microphone (mic.py), the RTCP reports it watches for FEC (fec.py), the ICE
connection it guards and the host addresses it offers (ice.py), the datagrams
it times for a peer's silence (webrtc/silence.py), and a
receiver's remote streams (voxgate/rtc_client.py). Every such name is here,
behind a small accessor; tests/gateway/test_rtc_internals.py fails when any
other product module names one, and when a fast path would not apply to the
versions pyproject.toml pins (aiortc 1.16, aioice 0.13, pylibsrtp 1.0).

`fast_paths()` checks each path against the installed versions, on objects
made without a network; the server logs the result at start (one line) and
exposes it as `voxgate_fast_path_active{path=...}`. Where a path does not
apply at run time as well, its caller falls back to aiortc's own path and
says so in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

import aioice
import aioice.ice
import aioice.stun
import pylibsrtp
from aiortc.rtcdtlstransport import State
from aiortc.rtcrtpsender import random_sequence_number
from aiortc.rtp import HeaderExtensions, RtcpRrPacket, RtcpSrPacket
from aiortc.sdp import SessionDescription, candidate_from_sdp

from .ssrcs import SsrcLimit

log = logging.getLogger(__name__)

__all__ = [
    "HeaderExtensions", "SessionDescription", "candidate_from_sdp", "random_sequence_number",
    "RtcpRrPacket", "RtcpSrPacket", "fast_paths", "versions",
]

MAX_SRTP_BYTES = 1500  # pylibsrtp's buffer: a longer SRTP or SRTCP datagram cannot be unprotected

# The sender state aiortc's RTCP loop and stop() read (name-mangled in RTCRtpSender).
_SENDER = "_RTCRtpSender__"
_SENDER_STATE = ("rtp_started", "rtp_exited", "rtp_header_extensions_map", "mid",
                 "ntp_timestamp", "rtp_timestamp", "octet_count", "packet_count")
_DTLS_TX = ("_state", "_tx_srtp", "_RTCDtlsTransport__tx_bytes", "_RTCDtlsTransport__tx_packets")
_DTLS_RX = ("_rx_srtp", "_RTCDtlsTransport__rx_bytes", "_RTCDtlsTransport__rx_packets", "_rtp_header_extensions_map")
_ICE_STATE = ("_remote_candidates", "_check_list", "_protocols")

# The fast paths, by the name they are exposed under.
FAST_PATHS = {
    "rtp_sender": "the speech track's RTP built from a header template (rtp_send.py) instead of aiortc's sender loop",
    "direct_wire": "SRTP and the ICE pair's socket in one call for each speech packet (rtp_send.py)",
    "mic_datagrams": "microphone SRTP datagrams taken from aioice and read in place (mic.py)",
    "mic_level": "the RFC 6464 audio level read from the header-extension block (mic.py)",
    "loss_reports": "RTCP receiver reports watched for in-band FEC (fec.py)",
    "ice_guard": "remote candidates, binding requests and checks bounded per ICE connection (ice.py)",
    "host_addresses": "only the configured host addresses offered as ICE candidates (ice.py)",
    "peer_datagrams": "each datagram from a peer timed, for --peer-silence-timeout-s (silence.py)",
}


def versions() -> dict[str, str]:
    """The installed versions of the three packages reached into."""
    out = {}
    for name in ("aiortc", "aioice", "pylibsrtp"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out


# -- the sender: rtp_send.py and fec.py ----------------------------------------------------------

def sender_supported(sender: Any) -> bool:
    """Whether `sender` keeps the state the direct RTP sender writes for aiortc's RTCP loop."""
    return all(hasattr(sender, _SENDER + name) for name in _SENDER_STATE) and hasattr(sender, "_ssrc")


def replace_rtp_loop(sender: Any, run: Callable[[Any], Awaitable[None]]) -> None:
    """Run `run(codec)` where RTCRtpSender.send() would start aiortc's `_run_rtp`."""
    # An instance attribute shadows the method.
    sender._run_rtp = run


def sender_ssrc(sender: Any) -> int:
    return sender._ssrc


def sender_header(sender: Any) -> tuple[Any, str | None]:
    """The sender's negotiated header-extension map and mid."""
    return getattr(sender, _SENDER + "rtp_header_extensions_map"), getattr(sender, _SENDER + "mid")


def sender_started(sender: Any) -> None:
    getattr(sender, _SENDER + "rtp_started").set()


def sender_exited(sender: Any) -> None:
    getattr(sender, _SENDER + "rtp_exited").set()


_NTP, _RTP, _PACKETS, _OCTETS = (_SENDER + name for name in ("ntp_timestamp", "rtp_timestamp", "packet_count", "octet_count"))


def record_sent(sender: Any, ntp: int, rtp_time: int, packets: int, octets: int) -> None:
    """What aiortc's RTCP loop puts in its sender reports, under their private names."""
    setattr(sender, _NTP, ntp)
    setattr(sender, _RTP, rtp_time)
    setattr(sender, _PACKETS, packets)
    setattr(sender, _OCTETS, octets)


def aiortc_send_rtp(dtls: Any) -> Callable[[bytes], Awaitable[None]]:
    """The DTLS transport's own RTP send: SRTP protect, then the ICE pair's socket."""
    return dtls._send_rtp


def watch_rtcp(sender: Any, on_packet: Callable[[Any], None]) -> bool:
    """Call on_packet(packet) for each RTCP packet `sender` handles, after aiortc has read it.
    False where this aiortc offers no place to watch."""
    handle = getattr(sender, "_handle_rtcp_packet", None)
    if handle is None or not hasattr(sender, "_ssrc"):
        return False

    async def handle_and_watch(packet: Any) -> None:
        await handle(packet)
        on_packet(packet)

    sender._handle_rtcp_packet = handle_and_watch
    return True


def direct_wire(dtls: Any) -> Callable[[bytes], bool] | None:
    """SRTP and the socket for `dtls`'s RTP in one plain call, or None where this aiortc or
    aioice lacks what it reads.

    aiortc's `_send_rtp` hands each packet down through four coroutines (its ICE
    transport, aioice's `send`, `sendto` and the protocol's `send_data`) that end
    in the datagram transport's `sendto`. This does what they do (the state
    check, SRTP, the counters, the nominated pair's socket) in one call. It
    returns False, having sent nothing, whenever that path would not be the
    same: not connected (aiortc raises), no pair, a protocol of another kind, or
    a packet aiortc would protect as RTCP; the caller then awaits aiortc's path.
    """
    connection = ice_connection(dtls)
    if not hasattr(connection, "_nominated") or not all(hasattr(dtls, name) for name in _DTLS_TX):
        return None
    stun_protocol = aioice.ice.StunProtocol

    def send(data: bytes) -> bool:
        pair = connection._nominated.get(1)
        if (dtls._state is not State.CONNECTED or pair is None or type(pair.protocol) is not stun_protocol
                or 192 <= data[1] <= 208):  # what aiortc would take for RTCP (payload types 64-80 with the marker)
            return False
        data = dtls._tx_srtp.protect(data)
        pair.protocol.transport.sendto(data, pair.remote_addr)  # what StunProtocol.send_data does
        dtls._RTCDtlsTransport__tx_bytes += len(data)
        dtls._RTCDtlsTransport__tx_packets += 1
        return True

    return send


# -- the receiver: mic.py ------------------------------------------------------------------------

def replace_rtp_handler(receiver: Any, handler: Callable[..., Awaitable[None]]) -> None:
    """Give the receiver's parsed RTP packets to `handler(packet, arrival_time_ms)` instead of aiortc's decoder."""
    receiver._handle_rtp_packet = handler


def receiver_dtls(receiver: Any) -> Any:
    return getattr(receiver, "transport", None)


def header_extensions_map(dtls: Any) -> Any:
    """The DTLS transport's negotiated header-extension map (None where this aiortc keeps it elsewhere)."""
    return getattr(dtls, "_rtp_header_extensions_map", None)


def extension_ids(extensions_map: Any) -> Any:
    """The map's negotiated ids (`.audio_level`, read per packet: the map is configured once the
    connection is up), or None where this aiortc keeps them elsewhere."""
    ids = getattr(extensions_map, "_HeaderExtensionsMap__ids", None)
    return ids if ids is not None and hasattr(ids, "audio_level") else None


def take_srtp_datagrams(dtls: Any, on_rtp: Callable[[bytes], None] | None, ssrcs: SsrcLimit,
                        timed: Callable[[Callable[[bytes, int], None]], Callable[[bytes, int], None]] | None = None) -> bool:
    """Hand each SRTP datagram for `dtls` to `on_rtp(plain RTP)`, unprotected, as aioice receives it;
    everything else (DTLS, the data channel, SRTCP, anything before the keys) still goes to aiortc.
    `on_rtp` None: nothing here receives RTP (no microphone), and every RTP datagram is dropped unread.
    False, with nothing changed, where this aiortc or aioice lacks what that reads.

    aiortc would queue each datagram on an asyncio.Queue, wake its receive task, read the clock
    through `datetime` and parse the whole packet into objects first. `on_rtp` runs inside
    asyncio's datagram callback: it must not raise.

    Only SSRCs `ssrcs` admits reach libsrtp, RTP and SRTCP alike (ssrcs.py): any other is
    dropped on its clear header. An SSRC is learnt once a packet from it authenticates: an RTP
    one here, and the first SRTCP one from each SSRC too (unprotected here, then handed to
    aiortc's RTCP handling as its receive loop would), so that nobody without the keys can
    fill the session's SSRCs.

    `timed`, given, wraps the handler of every datagram this takes, read or dropped, to charge
    its CPU time to the session's tenant (mic_charge.py).
    """
    connection = ice_connection(dtls)
    if (connection is None or not hasattr(connection, "data_received") or not all(hasattr(dtls, n) for n in _DTLS_RX)
            or not callable(getattr(dtls, "_handle_rtcp_data", None))):
        return False
    to_aiortc = connection.data_received
    known = ssrcs.known  # the set itself: its membership is the per-packet check

    def receive(data: bytes, component: int) -> None:
        # Nothing a peer sends may raise out of here (the loop would log a traceback per
        # datagram for every session to pay for).
        if not data or (127 < data[0] < 192 and len(data) > MAX_SRTP_BYTES):
            return  # aiortc fails on these (an index error, pylibsrtp's buffer) and closes the transport
        srtp = dtls._rx_srtp
        # SRTP and SRTCP (RFC 5761 demultiplexing, as aiortc's), once the keys exist.
        if srtp is None or len(data) < 12 or not 127 < data[0] < 192:
            to_aiortc(data, component)
            return
        if 192 <= data[1] <= 208:  # SRTCP
            ssrc = int.from_bytes(data[4:8], "big")
            if ssrc in known:
                to_aiortc(data, component)
            elif ssrcs.admits(ssrc):
                _first_rtcp(dtls, srtp, data, ssrcs, ssrc)
            return
        if on_rtp is None:
            return  # no receiver: aiortc would decrypt it for nobody
        ssrc = int.from_bytes(data[8:12], "big")
        if ssrc not in known and not ssrcs.admits(ssrc):
            return
        try:
            plain = srtp.unprotect(data)
        except (pylibsrtp.Error, ValueError):
            return  # aiortc drops these too
        if ssrc not in known:
            ssrcs.learn(ssrc)
        dtls._RTCDtlsTransport__rx_bytes += len(data)
        dtls._RTCDtlsTransport__rx_packets += 1
        on_rtp(plain)

    data_received = receive if timed is None else timed(receive)
    # aioice's protocol looks this up on the connection for every datagram.
    connection.data_received = data_received
    protocols = getattr(connection, "_protocols", None)
    if protocols is None:
        _log_once("protocols", "this aioice's connection keeps its protocols elsewhere: microphone datagrams go "
                               "through aioice's STUN parse first")
    for protocol in protocols or ():
        if not _demultiplex(protocol, data_received):
            _log_once("demultiplex", "an aioice protocol without a local candidate or datagram_received: "
                                     "its microphone datagrams go through aioice's STUN parse first")
    return True


def _demultiplex(protocol: Any, data_received: Callable[[bytes, int], None]) -> bool:
    """Hand `protocol`'s RTP and RTCP datagrams straight to `data_received`.

    aioice tries to parse every datagram as STUN and passes it on when that
    raises: an exception per microphone packet. By their first byte (RFC 7983),
    128-191 is RTP or RTCP and never STUN, whose first byte is 0-3; everything
    else still goes through aioice.
    """
    candidate = getattr(protocol, "local_candidate", None)
    if candidate is None or not hasattr(protocol, "datagram_received"):
        return False
    component = candidate.component
    to_aioice = protocol.datagram_received

    def datagram_received(data: bytes, addr: Any) -> None:
        if data and 127 < data[0] < 192:
            data_received(data, component)
        else:
            to_aioice(data, addr)

    # asyncio's datagram transport looks this up on the protocol for every datagram.
    protocol.datagram_received = datagram_received
    return True


def _first_rtcp(dtls: Any, srtp: Any, data: bytes, ssrcs: SsrcLimit, ssrc: int) -> None:
    """The first SRTCP packet from an SSRC not yet learnt: unprotected here, so that the SSRC is
    learnt only once it authenticates, then read by aiortc as its receive loop would."""
    try:
        plain = srtp.unprotect_rtcp(data)
    except (pylibsrtp.Error, ValueError):
        return
    ssrcs.learn(ssrc)
    dtls._RTCDtlsTransport__rx_bytes += len(data)
    dtls._RTCDtlsTransport__rx_packets += 1
    task = asyncio.ensure_future(dtls._handle_rtcp_data(plain))
    task.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("RTCP handling failed: %s", task.exception())


# -- ICE: ice.py ---------------------------------------------------------------------------------

def ice_connection(dtls: Any) -> Any:
    """The aioice connection under a DTLS transport, or None."""
    return getattr(getattr(dtls, "transport", None), "_connection", None)


def peer_dtls_transports(pc: Any) -> list:
    """A peer connection's DTLS transports, each once (one with BUNDLE)."""
    dtls = [t.sender.transport for t in pc.getTransceivers()]
    if pc.sctp is not None:
        dtls.append(pc.sctp.transport)
    return list({id(t): t for t in dtls if t is not None}.values())


def ice_connections(pc: Any) -> list:
    """The aioice connections under a peer connection's DTLS transports (one with BUNDLE)."""
    dtls = [t.sender.transport for t in pc.getTransceivers()]
    if pc.sctp is not None:
        dtls.append(pc.sctp.transport)
    found: dict[int, object] = {}
    for transport in dtls:
        connection = ice_connection(transport)
        if connection is not None:
            found[id(connection)] = connection
    return list(found.values())


def ice_guardable(connection: Any) -> bool:
    return all(hasattr(connection, name) for name in _ICE_STATE)


def remote_candidates(connection: Any) -> list:
    """The connection's remote candidates, signalled and learned: aioice's own list, which it only appends to."""
    return connection._remote_candidates


def candidate_key(candidate: Any) -> tuple[str, int]:
    """A remote candidate's (address, port) as aioice matches datagrams against it."""
    return candidate._network_host, candidate.port


def has_succeeded(connection: Any, addr: tuple[str, int]) -> bool:
    """Whether a check to `addr` has succeeded on this connection."""
    succeeded = aioice.ice.CandidatePair.State.SUCCEEDED
    return any(p.remote_addr == addr and p.state == succeeded for p in connection._check_list)


def is_binding_request(message: Any) -> bool:
    return message.message_class == aioice.stun.Class.REQUEST


def wrap_protocols(connection: Any, receive: Callable[[Callable], Callable], send: Callable[[Callable], Callable]) -> None:
    """Wrap each of the connection's protocols' `datagram_received` in `receive(...)` and
    `send_stun` in `send(...)`."""
    for protocol in connection._protocols:
        if hasattr(protocol, "datagram_received"):
            protocol.datagram_received = receive(protocol.datagram_received)
        if hasattr(protocol, "send_stun"):
            protocol.send_stun = send(protocol.send_stun)


def watch_datagrams(pc: Any, heard: Callable[[], None]) -> bool:
    """Call heard() for every datagram any of the peer connection's ICE connections receive (STUN,
    DTLS, SRTP, SRTCP, through a TURN relay too), before anything else reads it. Installed last, so
    that it wraps the microphone's and the ICE guard's handlers. False, with nothing changed, where
    this aioice keeps its protocols elsewhere."""
    connections = ice_connections(pc)
    if not connections or not all(hasattr(c, "_protocols") for c in connections):
        return False
    for connection in connections:
        for protocol in connection._protocols:
            if hasattr(protocol, "datagram_received"):
                protocol.datagram_received = _heard_first(protocol.datagram_received, heard)
    return True


def _heard_first(datagram_received: Callable[[bytes, Any], None], heard: Callable[[], None]) -> Callable[[bytes, Any], None]:
    def received(data: bytes, addr: Any) -> None:
        heard()
        datagram_received(data, addr)

    received.__wrapped__ = datagram_received  # type: ignore[attr-defined]  # inspect.unwrap finds the handler within
    return received


_original_get_host_addresses = aioice.ice.get_host_addresses


def original_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    """Every interface's address, as aioice gathers them by itself."""
    return _original_get_host_addresses(use_ipv4, use_ipv6)


def set_host_addresses(hook: Callable[[bool, bool], list[str]]) -> None:
    """aioice reads host addresses through one module-level function: process-wide."""
    aioice.ice.get_host_addresses = hook  # type: ignore[assignment]  # a function of the same signature


def host_addresses() -> list[str]:
    """The local addresses aioice will gather now."""
    return list(aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=True))


# -- the client: voxgate/rtc_client.py -----------------------------------------------------------

def receiver_remote_streams(receiver: Any) -> dict[int, Any] | None:
    """A receiver's statistics per remote SSRC (`.packets_received`), which aiortc keeps private."""
    return getattr(receiver, "_RTCRtpReceiver__remote_streams", None)


# -- the check at start --------------------------------------------------------------------------

_logged: set[str] = set()


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


def fast_paths() -> dict[str, bool]:
    """Which fast paths the installed aiortc, aioice and pylibsrtp allow, checked on a sender,
    a receiver and their transports made without a network (a few ms), in the running event loop."""
    from aiortc import RTCCertificate, RTCDtlsTransport, RTCIceGatherer, RTCIceTransport, RTCRtpReceiver, RTCRtpSender

    dtls = RTCDtlsTransport(RTCIceTransport(RTCIceGatherer()), [RTCCertificate.generateCertificate()])
    sender, receiver = RTCRtpSender("audio", dtls), RTCRtpReceiver("audio", dtls)
    connection = ice_connection(dtls)
    stun = aioice.ice.StunProtocol
    return {
        "rtp_sender": sender_supported(sender) and callable(getattr(sender, "_run_rtp", None))
        and callable(getattr(dtls, "_send_rtp", None)),
        "direct_wire": direct_wire(dtls) is not None and all(hasattr(stun, n) for n in ("send_data", "datagram_received")),
        "mic_datagrams": callable(getattr(receiver, "_handle_rtp_packet", None)) and connection is not None
        and hasattr(connection, "data_received") and all(hasattr(dtls, n) for n in _DTLS_RX)
        and hasattr(connection, "_protocols") and hasattr(pylibsrtp, "Error")
        and callable(getattr(dtls, "_handle_rtcp_data", None)),
        "mic_level": extension_ids(header_extensions_map(dtls)) is not None,
        "loss_reports": callable(getattr(sender, "_handle_rtcp_packet", None)) and hasattr(sender, "_ssrc"),
        "ice_guard": connection is not None and ice_guardable(connection)
        and all(hasattr(stun, n) for n in ("datagram_received", "send_stun")),
        "host_addresses": callable(getattr(aioice.ice, "get_host_addresses", None)),
        "peer_datagrams": connection is not None and hasattr(connection, "_protocols")
        and hasattr(stun, "datagram_received"),
    }


def check_fast_paths() -> dict[str, bool]:
    """`fast_paths()`, logged in one line: a warning naming those that do not apply, debug when all do."""
    try:
        paths = fast_paths()
    except Exception as exc:  # a release whose constructors changed: nothing can be assumed
        log.warning("could not check aiortc's fast paths (%s: %s)", type(exc).__name__, exc)
        paths = dict.fromkeys(FAST_PATHS, False)
    found = ", ".join(f"{name} {version}" for name, version in versions().items())
    off = [name for name, on in paths.items() if not on]
    if off:
        log.warning("fast paths off with %s: %s (each falls back to aiortc's own path; pyproject.toml pins the "
                    "versions they were tested with)", found, ", ".join(off))
    else:
        # At debug: the server's one start-up "fast paths:" line says it (summary()).
        log.debug("fast paths active with %s: %s", found, ", ".join(paths))
    return paths


def summary(paths: dict[str, bool]) -> str:
    """The start-up line's words for `check_fast_paths()`'s result."""
    found = ", ".join(f"{name} {version}" for name, version in versions().items())
    on = sum(paths.values())
    return f"{on} of {len(paths)} aiortc fast paths active ({found})"
