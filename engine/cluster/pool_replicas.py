"""The replicas' own addresses (Serve's direct ingress) for `GET /v1/replicas`,
read from Serve's controller through Ray's private API (engine/cluster/ray_internals.py)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time

from . import ray_internals
from .pool_protocol import MAX_REPLICAS_LISTED, replica_url

log = logging.getLogger(__name__)

# How long a replica reuses its listing of the replicas: gateways ask every few
# seconds, and anyone on the pool's network may ask, so the controller is asked
# at most once per this.
REPLICAS_CACHE_S = 2.0
LISTING_TIMEOUT_S = 2.0

class ReplicaListing:
    """The addresses of the pool's replicas where they listen themselves (Serve's
    direct ingress), read from Serve's controller and cached for REPLICAS_CACHE_S.

    Serve has no public call for these addresses, so this reads the controller's
    target groups (engine/cluster/ray_internals.py); if a Ray upgrade changes them, the listing
    is empty, the log says why, and gateways keep using the proxy. The controller is
    looked up once, off the event loop, and each read is bounded by LISTING_TIMEOUT_S."""

    def __init__(self) -> None:
        self._at = -math.inf
        self._value: dict = {"replicas": []}
        self._lock: asyncio.Lock | None = None
        self._controller = None

    async def get(self) -> dict:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._at >= REPLICAS_CACHE_S:
                try:
                    self._value = await asyncio.wait_for(self._read(), LISTING_TIMEOUT_S)
                except Exception as exc:  # Ray's private API moved, or the controller is slow: the proxy still works
                    log.warning("cannot list the replicas' own addresses (%s: %s); gateways use Serve's proxy",
                                type(exc).__name__, exc)
                    self._value = {"replicas": [], "reason": type(exc).__name__}
                self._at = time.monotonic()
        return self._value

    async def _read(self) -> dict:
        from ray import serve

        if self._controller is None:
            self._controller = await ray_internals.serve_controller()
        app = serve.get_replica_context().app_name
        groups, http = await ray_internals.target_groups(self._controller, app)
        bind = _literal_ip(http.host)
        replicas = []
        for group in groups:
            if not ray_internals.serves(group, "HTTP") or group.app_name != app:
                continue
            for target in group.targets:
                # Without direct ingress (or before a replica runs) Serve lists its proxies here instead.
                if not target.name.startswith("SERVE_REPLICA::"):
                    continue
                # A replica listens where Serve's HTTP options say; the node's address only when that is every address.
                host = target.ip if bind is None or bind.is_unspecified else str(bind)
                replicas.append({"url": replica_url(host, target.port, group.route_prefix), "id": target.name})
        return {"replicas": replicas[:MAX_REPLICAS_LISTED]}


def _literal_ip(host: str | None):
    try:
        return ipaddress.ip_address(host or "")
    except ValueError:
        return None
