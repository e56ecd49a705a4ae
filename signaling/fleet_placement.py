"""Placement: a new session (`POST /v1/sessions`) made on the gateway of the fleet with the
most headroom, from the loads the gateways publish in the directory (gateway/fleet/directory.py),
and a new session's id given out only once the directory has it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Protocol, cast

import aiohttp
from aiohttp import web
from prometheus_client import Counter

from ..gateway.fleet.directory import Directory
from ..gateway.errors import GatewayError
from ..gateway.gateway import Gateway
from .errors import READ_AHEAD, error_response, read_body
from .fleet_proxy import MAX_PROXIED_RESPONSE_BYTES, PROXY_TIMEOUT_S, forward_headers, read_capped
from .sessions_api import CREATE_BODY_LIMIT, check_api_key, session_urls

log = logging.getLogger(__name__)


class PlacementHost(Protocol):
    """What placement uses of the fleet (signaling/fleet.py's Fleet, which calls it): this gateway,
    the directory, the HTTP client to the other gateways and the placement counter."""

    gateway: Gateway
    directory: Directory
    placed: Counter

    @property
    def client(self) -> aiohttp.ClientSession: ...


async def place(request: web.Request, fleet: PlacementHost) -> web.Response | None:
    """Make a new session on the gateway of the fleet with the most headroom, if that is not
    this one: that gateway's answer, with its URLs; None to make it here."""
    gw = fleet.gateway
    need = gw.settings.talk_share
    budget, demand = gw.admission.fleet_load()
    target = fleet.directory.placement(need, budget - demand)
    if target is None:
        return None
    try:
        check_api_key(request)  # a request the local handler refuses goes nowhere
        body = request[READ_AHEAD] = await read_body(request, CREATE_BODY_LIMIT)
    except GatewayError:
        return None  # the local handler gives the error
    try:
        async with fleet.client.post(
            target + "/v1/sessions", data=body or None, headers=forward_headers(request), allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT_S),
        ) as resp:
            payload = await read_capped(resp.content, MAX_PROXIED_RESPONSE_BYTES)
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        log.warning("placing a session on %s failed (%s); making it here", target, type(exc).__name__)
        fleet.placed.labels("unreachable").inc()
        fleet.directory.placed(target, math.inf)  # not again until it publishes its load
        return None
    try:
        made = json.loads(payload) if status == 201 else None
    except ValueError:
        made = None
    if not isinstance(made, dict) or not isinstance(made.get("session_id"), str):
        # Full meanwhile (another gateway placed there too), or not answering as a gateway does.
        log.info("gateway %s did not take a placed session (%s); making it here", target, status)
        fleet.placed.labels("refused").inc()
        fleet.directory.placed(target, math.inf)
        return None
    fleet.directory.placed(target, need)
    fleet.placed.labels("placed").inc()
    made.update(session_urls(target, made["session_id"]))
    log.info("session %s placed on %s, the gateway with the most headroom", made["session_id"], target,
             extra={"session_id": made["session_id"]})
    return web.json_response(made, status=201)


async def settle_new_session(fleet: PlacementHost, response: web.StreamResponse) -> web.StreamResponse:
    """A new session's id reaches the caller only once the directory has it, so that
    the caller's next request may go to any gateway."""
    if response.status not in (200, 201) or not isinstance(response, web.Response) or not response.body:
        return response
    try:
        sid = json.loads(cast(bytes, response.body)).get("session_id")
    except (ValueError, TypeError, AttributeError):
        return response
    if isinstance(sid, str) and not await fleet.directory.claimed(sid):
        return error_response(GatewayError("session_id_taken", "the new session's id was already in use in the fleet; retry", 503))
    return response
