"""Whose work made the frames late: the tenant that late-frame admission refuses, and throttles, first.

Admission refuses new sessions once more than MAX_LATE_SHARE of the frames went late over the last
LAG_WINDOW_S (gateway/load/admission.py). Before issue 53 it refused every tenant for it, so any attack that
made frames late (250 watchers on one session, four aac encodes at once) locked everyone out. Now the
work a tenant's own input or jobs cost this process is measured where it is done, and charged to it:

- the caller's audio sent to a session's backends (gateway/backends/backend_link.py): the event loop's CPU time
  for each frame queued and sent, charged to the session's tenant;
- a speech request's encoding (gateway/peerless/http_audio.py FormatRun, for signaling/tts_http.py): its formatter thread's CPU time, charged to its caller;
- a session's inbound datagrams, read or dropped by the microphone's bounds (gateway/load/mic_charge.py,
  around gateway/media/rtc_internals.py's datagram handler): the event loop's CPU time, sampled, charged to
  the session's tenant; shedding it closes the session, its peer's UDP socket with it.

A tenant is the API key that made the session or request, else the client address of one made
without a key, else the session itself. The charges decay with a time constant of LAG_WINDOW_S, as
the late-frame share is taken over that window. The rule: while frames are late, a tenant whose
charges over the window come to at least BLAME_SHARE of this process's CPU time over it, and at
least BLAME_MIN_CORES of a core, is to blame (the one with most, if several are). Then only that
tenant's new sessions and requests are refused `late_frames`; the others are admitted as the budget
allows; and each second its costliest sources (backend links, speech requests, flooding sessions), half of what its sources
cost, are shed: disconnected, so their work stops. With nobody to blame (the node is simply full) every tenant is
refused as before.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

log = logging.getLogger(__name__)

# A tenant whose work is at least this share of the process's CPU over the window is to blame ...
BLAME_SHARE = 1.0 / 3.0
# ... and at least this many cores of it (below that no one tenant's work explains late frames). 250
# watchers on one session were charged 0.08 cores of the 0.2 the process spent (bench/bench_watchers.py
# --lift-limits; the loop's task switches between their sends are not charged), two watchers 0.002.
BLAME_MIN_CORES = 0.05


class Source(Protocol):
    """Something a tenant's work runs for, that can be stopped: a backend link, a speech request, a session's datagrams."""

    def shed(self, why: str) -> None: ...


class LateBlame:
    """Charges per tenant and per source, decayed over `window_s`; who is to blame, and shedding them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._tenants: dict[str, float] = {}  # tenant -> decayed seconds
        self._sources: dict[Source, tuple[str, float]] = {}  # source -> (its tenant, decayed seconds)
        self._own = 0.0  # this process's CPU seconds, decayed alike
        self.culprit: str | None = None  # set by tick while frames are late

    def charge(self, tenant: str, seconds: float, source: Source | None = None) -> None:
        """`seconds` of this process's CPU spent on `tenant`'s work (for `source`, which can be shed)."""
        self._tenants[tenant] = self._tenants.get(tenant, 0.0) + seconds
        if source is not None:
            _, had = self._sources.get(source, (tenant, 0.0))
            self._sources[source] = (tenant, had + seconds)

    def forget(self, source: Source) -> None:
        """The source ended (its link detached, its request done): nothing left to shed."""
        self._sources.pop(source, None)

    def load(self, tenant: str) -> float:
        """The tenant's work over the window, in cores."""
        return self._tenants.get(tenant, 0.0) / self.window_s

    def tick(self, span: float, own_cpu_s: float, late: bool) -> None:
        """Once a second: decay by `span` seconds, count the process's `own_cpu_s` since the last
        tick, and, while frames are `late`, find the tenant to blame and shed its costliest source."""
        keep = math.exp(-span / self.window_s)
        self._own = self._own * keep + own_cpu_s
        self._tenants = {t: s * keep for t, s in self._tenants.items() if s * keep > 1e-6}
        self._sources = {k: (t, s * keep) for k, (t, s) in self._sources.items()}
        culprit = self._to_blame() if late else None
        if late and culprit != self.culprit:
            top = max(self._tenants.items(), key=lambda kv: kv[1], default=("nobody", 0.0))
            log.info("frames are late: %s to blame (most: %s, %.2f of %.2f cores of this process's work)",
                     _short(culprit) if culprit else "nobody", _short(top[0]), top[1] / self.window_s, self._own / self.window_s)
        self.culprit = culprit
        if self.culprit is not None:
            self._shed(self.culprit)

    def _to_blame(self) -> str | None:
        if not self._tenants:
            return None
        tenant, seconds = max(self._tenants.items(), key=lambda kv: kv[1])
        if seconds >= BLAME_SHARE * self._own and seconds / self.window_s >= BLAME_MIN_CORES:
            return tenant
        return None

    def _shed(self, tenant: str) -> None:
        """Stop the tenant's costliest sources, as many as make up half of what its sources cost: one
        heavy encode, or half of many small watchers (250 of them are gone within seconds, not minutes)."""
        theirs = sorted(((s, i, source) for i, (source, (t, s)) in enumerate(self._sources.items()) if t == tenant),
                        reverse=True)
        if not theirs:
            return
        total, shed = sum(s for s, _, _ in theirs), 0.0
        log.warning("frames are late and %s's work costs %.2f cores of this process: shedding its costliest parts",
                    _short(tenant), self.load(tenant))
        for seconds, _, source in theirs:
            if shed >= total / 2:
                break
            shed += seconds
            self._sources.pop(source, None)
            source.shed("its work made the server's frames late")


def key_tenant(key: str) -> str:
    return "key:" + key


def address_tenant(address: str) -> str:
    return "address:" + address


def _short(tenant: str) -> str:
    # An API key is a secret: the log names only its first characters.
    if tenant.startswith("key:"):
        return "key " + tenant[4:8] + "…"
    return tenant
