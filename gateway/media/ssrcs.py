"""Which SSRCs a session's peer may send SRTP from: the ones it negotiated, then a few it is learnt from.

libsrtp keeps one stream per SSRC it has authenticated a packet from and
searches them one by one for every later packet (pylibsrtp's session is made
with `SSRC_ANY_INBOUND`), so a connected peer that protects each packet with
its own keys under a new SSRC makes every later packet of its session dearer,
without end: issue 53 measured 4.5 µs an unprotect with no extra streams and
1.36 ms with 100,000, and the memory stayed until the session ended.

A browser sends its audio from one SSRC, named in its offer (`a=ssrc:`), and
its RTCP from that one or one more. So a session accepts the SSRCs its offer
names and learns, once each, the first others whose packets authenticate, up
to `limit` in all (--max-ssrcs). Past that, a datagram from any other SSRC is
dropped on its clear header, before decryption, and libsrtp never sees it:
the streams, the search and the memory stay as small as the limit.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

_SSRC_LINE = re.compile(r"^a=ssrc:(\d+)[ \r]", re.MULTILINE)


def offered_ssrcs(sdp: str) -> list[int]:
    """The SSRCs an offer names (`a=ssrc:N ...` lines), in order, each once."""
    return list(dict.fromkeys(int(m.group(1)) & 0xFFFFFFFF for m in _SSRC_LINE.finditer(sdp)))


def rtp_ssrc(data: bytes) -> int:
    """An RTP or SRTP packet's SSRC, from its clear header (at least 12 bytes)."""
    return int.from_bytes(data[8:12], "big")


def rtcp_ssrc(data: bytes) -> int:
    """An RTCP or SRTCP compound packet's first sender SSRC, the one libsrtp looks its stream up by."""
    return int.from_bytes(data[4:8], "big")


class SsrcLimit:
    """The SSRCs one session accepts: `admits(ssrc)` before decryption, `learn(ssrc)` after a
    packet from it authenticated. `on_drop()` hears of each datagram refused."""

    def __init__(self, limit: int, negotiated: Iterable[int] = (), on_drop: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.known: set[int] = set(list(negotiated)[:limit])
        self.dropped = 0
        self.on_drop = on_drop

    def admits(self, ssrc: int) -> bool:
        if ssrc in self.known or len(self.known) < self.limit:
            return True
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop()
        return False

    def learn(self, ssrc: int) -> None:
        if len(self.known) < self.limit:
            self.known.add(ssrc)
