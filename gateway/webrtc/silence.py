"""A connected peer that has gone silent: its path is cut, and its session should end.

aiortc has no ICE restart, and aioice notices a lost peer only through ICE consent freshness: six
unanswered consent checks five seconds apart, about 30 s in which the session stays open and sends
into nothing. A connected peer is never silent that long while its path holds: a browser sends
consent checks every few seconds and RTCP receiver reports while it receives audio, and the gateway
sends audio (speech or keepalives) all along. So the time since the last datagram from the peer, of
any kind, says when the path is gone, well before consent fails (docs/networks.md).

Stamping is one clock read per datagram (rtc_internals.watch_datagrams); the check is one timer
per peer, which fires about once per timeout while the peer is heard. Every datagram counts, before
any check of its source or keys: reading them would cost more per packet, and a stranger who keeps
sending to the session's port only delays the close to where aioice's consent check ends it anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class PeerSilence:
    """Calls `on_silent(seconds)` once nothing has been heard from the peer for `timeout_s`, counted
    from `start()` (the peer connected: before it, the connect timeout applies)."""

    __slots__ = ("timeout_s", "last", "_on_silent", "_timer")

    def __init__(self, timeout_s: float, on_silent: Callable[[float], None]) -> None:
        self.timeout_s = timeout_s
        self.last = time.monotonic()
        self._on_silent = on_silent
        self._timer: asyncio.TimerHandle | None = None

    def heard(self) -> None:
        """A datagram from the peer: called for each, so only the clock's read."""
        self.last = time.monotonic()

    def start(self) -> None:
        if self._timer is None:
            self.last = time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        silent = time.monotonic() - self.last
        if silent < self.timeout_s:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s - silent, self._check)
            return
        self._timer = None
        self._on_silent(silent)
