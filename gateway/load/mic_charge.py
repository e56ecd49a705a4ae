"""A caller's own datagrams charged to its tenant, and its session closed when they are to blame.

The microphone's bounds (mic.py, ssrcs.py) drop a flood's packets before they are decrypted or
decoded, but receiving and dropping each datagram still runs on the event loop: 4,000 a second
of a caller's own SRTP (new SSRCs, more packets than real time, RTP-time jumps) made other
sessions' frames late at 2-3x the baseline (issue 53). So the CPU time of every datagram the
session's SRTP path takes from aioice (rtc_internals.take_srtp_datagrams: RTP and RTCP, read or
dropped) is charged to the session's tenant (late_blame.py), with this as the Source. When
late-frame admission sheds it, the session is closed: its peer connection, and with it the UDP
socket, so the kernel drops the rest of the flood instead of this process.

`time.thread_time()` is a system call (about 0.6 us here, against 1-3 us for a datagram the
bounds drop), so not every datagram is timed: one in SAMPLE_GAP on average, at random gaps a
sender cannot line its packets up with, each charged for the datagrams since the last one timed.
What asyncio does for a datagram before it reaches aioice's protocol (the selector's wake-up,
`recvfrom`, the callback's dispatch) is not in the charge: it runs outside any handler this code
can wrap without asyncio's private names. It is most of what a dropped datagram costs: on the
2-core machine of issue 53, under load, about 30 us of the loop's CPU a datagram at 4,000 a second
with a handler that only counts, against 0.2-1 us for the handler that drops a foreign SSRC and a
few us for one that unprotects and drops. So a flood is charged a small part of its cost, and
late_blame.py's rule (a third of the process's CPU) blames it only where that part is enough.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable

from .late_blame import LateBlame
from ..sessions.session import Session

log = logging.getLogger(__name__)

# Datagrams per timed one, on average (gaps drawn from 1 to 2 * SAMPLE_GAP - 1). At 4,000 a second
# that is 500 timings a second, about 0.6 ms of a core.
SAMPLE_GAP = 8

DatagramHandler = Callable[[bytes, int], None]


class MicCharge:
    """Times `session`'s inbound datagram handlers (`timed`) for `blame`, as `tenant`'s; `shed` closes the session."""

    def __init__(self, blame: LateBlame, tenant: str, session: Session) -> None:
        self.blame = blame
        self.tenant = tenant
        self.session = session
        self.charged_s = 0.0  # everything charged, undecayed: for tests and the bench
        self.shed_at: float | None = None  # time.monotonic() when it was shed
        self.ended = False  # the session closed: its last datagrams are not charged
        self._rng = random.Random()
        session.on_close.append(self._forget)

    def timed(self, handler: DatagramHandler) -> DatagramHandler:
        """`handler`, with its CPU time charged, sampled."""
        thread_time, draw, charge = time.thread_time, self._rng.randrange, self.blame.charge
        tenant, top = self.tenant, 2 * SAMPLE_GAP
        countdown = gap = draw(1, top)

        def data_received(data: bytes, component: int) -> None:
            nonlocal countdown, gap
            countdown -= 1
            if countdown:
                handler(data, component)
                return
            started = thread_time()
            try:
                handler(data, component)
            finally:
                spent = (thread_time() - started) * gap
                countdown = gap = draw(1, top)
                if not self.ended:  # charged after `forget`, it would be held until the process ends
                    self.charged_s += spent
                    charge(tenant, spent, self)

        return data_received

    def shed(self, why: str) -> None:
        """Late-frame admission blames the caller's datagrams (late_blame.py): close its session."""
        session = self.session
        if session.closed or self.shed_at is not None:
            return
        self.shed_at = time.monotonic()
        log.warning("session %s: %s (the caller's own datagrams); closing it", session.id, why,
                    extra={"session_id": session.id})
        session.emit({"type": "error", "code": "late_frames",
                      "message": "this session's inbound packets made the server's frames late; it is closed"})
        asyncio.ensure_future(session.close("late_frames"))

    def _forget(self, session: Session) -> None:
        self.ended = True
        self.blame.forget(self)
