"""A bad network on loopback: a userspace UDP relay that impairs server-to-browser RTP.

The kernel here has no netem qdisc, so the impairments live in a relay between
a real chromium and the gateway. It holds two sockets on 127.0.0.1: the
browser is told (in the answer) that the server is at the relay's
`browser_side`, and the server is told (in the offer) that the browser is at
its `server_side`. Every packet from one peer leaves the relay's other socket
towards the other peer, so each side sees one consistent address and ICE pairs
them through the relay. `rewrite_offer` and `rewrite_answer` make those two
edits to the SDP (a Playwright route on `/v1/offer` applies them).

Only RTP from the server to the browser is impaired (RFC 7983: first byte
128-191, second byte outside RTCP's 192-223): STUN, DTLS (and the data channel
inside it), RTCP and everything the browser sends pass clean and at once.

The impairments, all drawn from one seeded RNG so a run can be repeated:
- loss, random (Bernoulli) or in bursts (a Gilbert chain: every packet in the
  bad state is lost; mean burst length `burst`, long-run share `loss`);
- jitter: each packet's extra delay uniform in [0, jitter_ms], or Lomax
  (Pareto II) with mean jitter_ms, so packets reorder;
- duplication (the copy gets its own delay);
- a bandwidth cap: packets are serialised at `rate_kbps` and dropped at the
  tail past `queue_ms` of backlog.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

# Packets in flight in the relay at once: delayed packets wait as timers, so
# their number is capped (a flood from a peer only loses the excess).
MAX_IN_FLIGHT = 4096
# The Lomax shape: a heavy tail with a finite variance; its scale is set from the mean.
PARETO_SHAPE = 3.0
# No packet is held longer than this many times the mean jitter.
JITTER_CAP = 10.0


@dataclass(frozen=True)
class Impairment:
    """What the relay does to server-to-browser RTP."""

    loss: float = 0.0  # long-run share of packets lost, 0..1
    burst: float = 1.0  # mean length of a run of lost packets (1: each lost independently)
    jitter_ms: float = 0.0  # uniform in [0, jitter_ms], or the Lomax mean with pareto
    pareto: bool = False
    duplicate: float = 0.0  # share of packets sent twice
    rate_kbps: float = 0.0  # bandwidth cap, 0: none
    queue_ms: float = 200.0  # backlog at the cap past which packets are dropped
    # >0: first hold each packet until its RTP timestamp is due plus this much, so the line starts from a
    # steady source and the server's own pacing (late frames on a busy machine) is taken out of the figures.
    retime_ms: float = 0.0
    seed: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss < 1.0 or not 0.0 <= self.duplicate <= 1.0:
            raise ValueError("loss and duplicate are shares: 0 <= loss < 1, 0 <= duplicate <= 1")
        if self.burst < 1.0 or self.jitter_ms < 0 or self.rate_kbps < 0 or self.queue_ms <= 0 or self.retime_ms < 0:
            raise ValueError("burst >= 1, jitter_ms >= 0, rate_kbps >= 0, queue_ms > 0, retime_ms >= 0")

    def label(self) -> str:
        parts = []
        if self.loss:
            parts.append(f"{self.loss:.0%} loss" + (f" in bursts of {self.burst:g}" if self.burst > 1 else " random"))
        if self.jitter_ms:
            parts.append(f"{self.jitter_ms:g} ms {'Pareto' if self.pareto else 'uniform'} jitter")
        if self.duplicate:
            parts.append(f"{self.duplicate:.0%} duplicated")
        if self.rate_kbps:
            parts.append(f"{self.rate_kbps:g} kbit/s cap")
        if self.retime_ms:
            parts.append(f"re-timed {self.retime_ms:g} ms")
        return ", ".join(parts) or "clean"


class Impairer:
    """Decides, packet by packet, whether it is lost and when each copy leaves (seconds from now)."""

    def __init__(self, imp: Impairment) -> None:
        self.imp = imp
        self._rng = random.Random(imp.seed)
        self._bad = False
        # Gilbert chain with every bad-state packet lost: mean burst 1/p_bg, stationary loss p_gb/(p_gb+p_bg).
        self._p_bg = 1.0 / imp.burst
        self._p_gb = imp.loss * self._p_bg / (1.0 - imp.loss) if imp.loss else 0.0
        self._link_free = 0.0  # when the capped link has sent its backlog (monotonic seconds)

    def lost(self) -> bool:
        imp, rng = self.imp, self._rng
        if not imp.loss:
            return False
        if imp.burst <= 1.0:
            return rng.random() < imp.loss
        self._bad = rng.random() >= self._p_bg if self._bad else rng.random() < self._p_gb
        return self._bad

    def jitter(self) -> float:
        imp, rng = self.imp, self._rng
        if not imp.jitter_ms:
            return 0.0
        if imp.pareto:
            scale = imp.jitter_ms * (PARETO_SHAPE - 1.0)  # Lomax mean = scale / (shape - 1)
            ms = scale * ((1.0 - rng.random()) ** (-1.0 / PARETO_SHAPE) - 1.0)
        else:
            ms = rng.uniform(0.0, imp.jitter_ms)
        return min(ms, JITTER_CAP * imp.jitter_ms) / 1000.0

    def schedule(self, size: int, now: float) -> list[float] | None:
        """The delays of the copies to send, or None when the packet is dropped at the cap."""
        imp = self.imp
        queued = 0.0
        if imp.rate_kbps:
            start = max(now, self._link_free)
            if (start - now) * 1000.0 > imp.queue_ms:
                return None
            self._link_free = start + size * 8 / (imp.rate_kbps * 1000.0)
            queued = self._link_free - now
        copies = 2 if imp.duplicate and self._rng.random() < imp.duplicate else 1
        return [queued + self.jitter() for _ in range(copies)]


class Retimer:
    """When each packet would leave a perfectly steady sender: its RTP timestamp (48 kHz) after the
    first packet's, plus `slack_s`. A packet later than that re-anchors the clock (never earlier)."""

    def __init__(self, slack_s: float, clock_hz: int = 48000) -> None:
        self.slack_s, self.clock_hz = slack_s, clock_hz
        self._anchor: tuple[int, float] | None = None  # (RTP timestamp, its due time)

    def hold(self, timestamp: int, now: float) -> float:
        """Seconds to hold the packet from `now`."""
        if self._anchor is None:
            self._anchor = (timestamp, now + self.slack_s)
        ts0, t0 = self._anchor
        elapsed = ((timestamp - ts0) % 2**32) / self.clock_hz
        if elapsed > 2**31 / self.clock_hz:  # an older timestamp (reordered at the source): at once
            return 0.0
        due = t0 + elapsed
        if due < now:  # later than the slack covers: the steady clock starts again from here
            self._anchor = (timestamp, now)
            return 0.0
        return due - now


def is_rtp(data: bytes) -> bool:
    """RTP, not RTCP (RFC 7983 and RFC 5761); SRTP keeps the header in the clear."""
    return len(data) >= 12 and 128 <= data[0] <= 191 and not 192 <= data[1] <= 223


@dataclass
class RelayStats:
    rtp_in: int = 0  # server-to-browser RTP packets the relay received
    rtp_bytes: int = 0  # their size, SRTP headers and tags included
    rtp_lost: int = 0  # dropped as lost
    rtp_capped: int = 0  # dropped at the bandwidth cap
    rtp_duplicated: int = 0
    rtp_out: int = 0  # copies handed on
    reordered: int = 0  # packets sent after one with a higher sequence number
    lost_seqs: list[int] = field(default_factory=list)
    other: Counter = field(default_factory=Counter)  # clean packets by direction and kind


def _kind(data: bytes) -> str:
    first = data[0] if data else -1
    if 0 <= first <= 3:
        return "stun"
    if 20 <= first <= 63:
        return "dtls"
    if 128 <= first <= 191:
        return "rtp" if is_rtp(data) else "rtcp"
    return "other"


class _Side(asyncio.DatagramProtocol):
    def __init__(self, relay: Relay, name: str) -> None:
        self.relay, self.name = relay, name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.relay._received(self.name, data, addr)


class Relay:
    """The two sockets and the impairer; runs on one event loop."""

    def __init__(self, imp: Impairment, host: str = "127.0.0.1") -> None:
        self.host = host
        self.impairer = Impairer(imp)
        self.stats = RelayStats()
        self.browser: tuple[str, int] | None = None  # the browser's real address
        self.server: tuple[str, int] | None = None  # the gateway's real address
        self._sides: dict[str, _Side] = {}
        self._in_flight = 0
        self._last_seq_sent: int | None = None
        self._retimer = Retimer(imp.retime_ms / 1000.0) if imp.retime_ms else None
        self.cut = False  # True: every packet, both ways, is dropped
        self.moved_at: float | None = None  # loop time of the last move()
        self.resumed_at: float | None = None  # the first RTP from the server after it, on the new socket
        # The longest wait between two browser-to-server datagrams since quiet_reset(): how quiet a
        # live browser gets, against the gateway's --peer-silence-timeout-s.
        self.up_last: float | None = None
        self.up_gap_max = 0.0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for name in ("browser_side", "server_side"):
            _, protocol = await loop.create_datagram_endpoint(lambda n=name: _Side(self, n), local_addr=(self.host, 0))
            self._sides[name] = protocol

    async def move(self) -> int:
        """The browser's address changes (a phone from Wi-Fi to LTE): the server side moves to a new
        socket and the old one closes; returns the new port."""
        old = self._sides["server_side"]
        _, protocol = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Side(self, "server_side"), local_addr=(self.host, 0))
        self._sides["server_side"] = protocol
        if old.transport:
            old.transport.close()
        self.moved_at, self.resumed_at = asyncio.get_running_loop().time(), None
        return self.port("server_side")

    def quiet_reset(self) -> None:
        self.up_last, self.up_gap_max = None, 0.0

    def port(self, side: str) -> int:
        transport = self._sides[side].transport
        assert transport is not None
        return transport.get_extra_info("sockname")[1]

    def close(self) -> None:
        for side in self._sides.values():
            if side.transport:
                side.transport.close()

    def _received(self, side: str, data: bytes, addr) -> None:
        if self.cut:  # the path is gone both ways (a phone off Wi-Fi before LTE comes up)
            self.stats.other["cut"] += 1
            return
        if side == "browser_side":
            self.browser = self.browser or addr  # chromium checks from the address its offer named
            now = asyncio.get_running_loop().time()
            if self.up_last is not None:
                self.up_gap_max = max(self.up_gap_max, now - self.up_last)
            self.up_last = now
            if self.server:
                self._send("server_side", data, self.server)
                self.stats.other["up " + _kind(data)] += 1
            return
        if self.browser is None:
            return
        if not is_rtp(data):
            self.stats.other["down " + _kind(data)] += 1
            self._send("browser_side", data, self.browser)
            return
        st = self.stats
        if self.moved_at is not None and self.resumed_at is None:
            self.resumed_at = asyncio.get_running_loop().time()
        st.rtp_in += 1
        st.rtp_bytes += len(data)
        seq = int.from_bytes(data[2:4], "big")
        if self.impairer.lost():
            st.rtp_lost += 1
            st.lost_seqs.append(seq)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        hold = self._retimer.hold(int.from_bytes(data[4:8], "big"), now) if self._retimer else 0.0
        delays = self.impairer.schedule(len(data), now + hold)
        if delays is None:
            st.rtp_capped += 1
            st.lost_seqs.append(seq)
            return
        st.rtp_duplicated += len(delays) - 1
        for delay in delays:
            if self._in_flight >= MAX_IN_FLIGHT:
                st.rtp_capped += 1
                continue
            self._in_flight += 1
            loop.call_later(hold + delay, self._deliver, data, seq)

    def _deliver(self, data: bytes, seq: int) -> None:
        self._in_flight -= 1
        last = self._last_seq_sent
        if last is not None and 0 < (last - seq) % 65536 < 32768:
            self.stats.reordered += 1
        else:
            self._last_seq_sent = seq
        self.stats.rtp_out += 1
        assert self.browser is not None
        self._send("browser_side", data, self.browser)

    def _send(self, side: str, data: bytes, addr) -> None:
        transport = self._sides[side].transport
        if transport is not None and not transport.is_closing():
            transport.sendto(data, addr)


class RelayThread:
    """A Relay on its own event loop in a thread, for a caller that blocks (Playwright's sync API)."""

    def __init__(self, imp: Impairment, host: str = "127.0.0.1") -> None:
        self.relay = Relay(imp, host)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netem-relay", daemon=True)

    def __enter__(self) -> RelayThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.relay.start(), self._loop).result(5)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self.relay.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def move(self) -> int:
        """Relay.move, from the caller's thread."""
        return asyncio.run_coroutine_threadsafe(self.relay.move(), self._loop).result(5)

    def rewrite_offer(self, sdp: str) -> str:
        """The browser's offer with one candidate, its UDP one on the relay's host, moved to
        the relay's server side; the browser's real address is kept for the relay."""
        kept, lines = None, []
        for line in sdp.splitlines():
            m = _CANDIDATE.match(line)
            if m:
                if kept is None and m["transport"].lower() == "udp" and m["ip"] == self.relay.host:
                    kept = (m["ip"], int(m["port"]))
                    lines.append(_moved(line, m, self.relay.port("server_side")))
                continue  # every other candidate (TCP, other interfaces, mDNS) goes
            lines.append(line)
        if kept is None:
            raise ValueError(f"the offer has no UDP candidate on {self.relay.host}: {sdp}")
        self.relay.browser = kept
        return "\r\n".join(lines) + "\r\n"

    def rewrite_answer(self, sdp: str) -> str:
        """The gateway's answer with its candidate moved to the relay's browser side."""
        lines, found = [], False
        for line in sdp.splitlines():
            m = _CANDIDATE.match(line)
            if m and m["transport"].lower() == "udp" and not found:
                self.relay.server = (m["ip"], int(m["port"]))
                lines.append(_moved(line, m, self.relay.port("browser_side")))
                found = True
            elif not m:
                lines.append(line)
        if not found:
            raise ValueError(f"the answer has no UDP candidate: {sdp}")
        return "\r\n".join(lines) + "\r\n"


_CANDIDATE = re.compile(
    r"^a=candidate:(?P<foundation>\S+) (?P<component>\d+) (?P<transport>\S+) (?P<priority>\d+) "
    r"(?P<ip>\S+) (?P<port>\d+) typ (?P<type>\S+)(?P<rest>.*)$"
)


def _moved(line: str, m: re.Match, port: int) -> str:
    return line[: m.start("port")] + str(port) + line[m.end("port"):]
