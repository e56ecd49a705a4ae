"""Any gateway answers about any session: routing through the session directory.

With `--redis-url`, a request about a session this gateway does not hold is
looked up in the directory (gateway/fleet/directory.py) and proxied to the gateway
that holds it (signaling/fleet_proxy.py): `GET`/`DELETE /v1/sessions/{id}`, its ICE candidates, an offer
that joins it, its TURN credentials (`GET /v1/ice-servers` with its client
token), and the backend WebSocket (frame by frame, both ways). Proxied,
never redirected: browsers' fetch and WebRTC offers, and most WebSocket
clients, do not follow a redirect to another origin with the Authorization
header still on (docs/scaling.md).

The holder checks keys and tokens exactly as for a request it got itself: the
proxy forwards the caller's own credentials and adds nothing that grants
access. Before it costs a lookup, a request must authenticate here too: a
valid API key (the session's owner is checked against the record before the
key goes anywhere), or a client token for the session it names (gateways
share --token-secret). A record is followed only when its signature holds and
it names a gateway of the fleet (gateway/fleet/directory.py), so nobody who can
write to Redis alone can send a caller's key elsewhere. The target is the
holder's URL and the request's path and query (never the raw request line,
which may be absolute). It adds one hop header, which can only take routing away: a request
that carries it is answered locally, so a stale record never bounces requests
between gateways.

Placement (signaling/fleet_placement.py): each gateway publishes its load (its speech budget and demand,
gateway/load/admission.py) in the directory. `POST /v1/sessions` on any gateway
makes the session on the gateway with the most headroom: here, unless another
one of the fleet has room for a session (--talk-share) and more headroom than
this one; then the request is sent there (once: the hop header) and its answer,
whose URLs name that gateway's --advertise-url, is returned. If that gateway
refuses or does not answer, the session is made here, or refused here. A
session or offer refused here for capacity names a gateway with room in its
503 (`error.gateway`).

An unknown or expired id gets the same 404 `unknown_session` the local handler
gives; Redis down and the session not here gets 503 `directory_unavailable`;
a holder that does not answer gets 502 `owner_unreachable`.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import cast

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Gauge

from ..gateway.fleet.directory import Directory
from ..gateway.fleet.directory_records import key_id
from ..gateway.errors import GatewayError
from .errors import MAX_CANDIDATE_BYTES, MAX_OFFER_BYTES, READ_AHEAD, error_response, read_body
from .fleet_placement import place, settle_new_session
from .fleet_proxy import HOP_HEADER, proxy_http, proxy_ws
from .sessions_api import SIGNER, bearer_of, check_api_key

log = logging.getLogger(__name__)


# (method, route) -> label; the routes whose requests are about one session.
ROUTES = {
    ("POST", "/v1/sessions"): "create",
    ("GET", "/v1/sessions/{session_id}"): "get",
    ("DELETE", "/v1/sessions/{session_id}"): "delete",
    ("GET", "/v1/sessions/{session_id}/ws"): "ws",
    ("POST", "/v1/sessions/{session_id}/candidates"): "candidates",
    ("POST", "/v1/offer"): "offer",
    ("GET", "/v1/ice-servers"): "ice_servers",  # with a client token: that session's TURN credentials
}
# Routes whose local handler checks the API key first: the proxy checks it too,
# so a request without a valid key never costs a lookup or a hop.
KEYED = ("get", "delete", "ws")

FLEET = web.AppKey("fleet", object)  # a Fleet: the class comes below


class Fleet:
    """The directory, the HTTP client to the other gateways, and the fleet's metrics."""

    def __init__(self, app: web.Application) -> None:
        gw = app["gateway"]
        s = gw.settings
        registry = gw.metrics.registry
        self.proxied = Counter(
            "voxgate_fleet_proxied_total", "Requests about sessions held by another gateway, by route and outcome",
            ["route", "outcome"], registry=registry,
        )
        self.directory_up = Gauge("voxgate_directory_up", "1 while the session directory (Redis) answers", registry=registry)
        self.forged = Counter(
            "voxgate_directory_records_refused_total",
            "Directory records ignored: unreadable, or not signed with the fleet's --token-secret", ["why"],
            registry=registry,
        )
        self.directory = Directory(
            s.redis_url, s.advertise_url, s.directory_ttl_s, s.token_secret,
            on_up=lambda up: self.directory_up.set(int(up)), on_forged=lambda why: self.forged.labels(why).inc(),
            password=s.redis_password,
        )
        self.placed = Counter(
            "voxgate_fleet_placed_total", "Sessions of POST /v1/sessions sent to another gateway with more headroom, "
            "by outcome (placed; refused or unreachable: made or refused here instead)", ["outcome"], registry=registry,
        )
        self.room = Gauge("voxgate_fleet_gateways_with_room",
                          "Other gateways of the fleet whose last published load has room for a session", registry=registry)
        self.room.set_function(lambda: len(self.directory._with_room(s.talk_share)))
        self.directory.load_source = self._load
        gw.admission.elsewhere = lambda: self.directory.room_elsewhere(s.talk_share)
        self.gateway = gw
        self.max_ws_message = max(4 * s.max_message_bytes, 1 << 20)  # as the local handler
        self._client: aiohttp.ClientSession | None = None
        self.sockets: set[web.WebSocketResponse] = set()

    def _load(self) -> tuple[float, float, int]:
        budget, demand = self.gateway.admission.fleet_load()
        return budget, demand, self.gateway.session_count

    async def start(self) -> None:
        # No connection limit: proxied WebSockets hold theirs for the session's
        # life, and the gateways' own --max-sessions bound them.
        self._client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        await self.directory.start()

    @property
    def client(self) -> aiohttp.ClientSession:
        """The HTTP client to the other gateways, from `start` on."""
        assert self._client is not None, "the fleet has not started"
        return self._client

    async def shutdown(self) -> None:
        for ws in list(self.sockets):
            await ws.close(code=1001, message=b"server shutting down")

    async def stop(self) -> None:
        await self.directory.close()
        if self._client is not None:
            await self._client.close()


def setup(app: web.Application) -> None:
    """Turn a gateway into a fleet member (create_app calls this with --redis-url)."""
    fleet = Fleet(app)
    app[FLEET] = fleet
    app["gateway"].on_session_created.append(fleet.directory.track)
    app.middlewares.append(route)

    async def on_startup(app: web.Application) -> None:
        await fleet.start()

    async def on_shutdown(app: web.Application) -> None:
        await fleet.shutdown()

    async def on_cleanup(app: web.Application) -> None:
        await fleet.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)


def _token_session(token: object) -> str | None:
    """The session id in a client token's payload, read without checking the
    signature: it only picks the gateway, which then verifies the token."""
    if not isinstance(token, str) or len(token) > 1024 or token.count(".") != 1:
        return None
    body = token.split(".")[0]
    try:
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        sid = data["sid"]
    except (ValueError, KeyError, TypeError):
        return None
    return sid if isinstance(sid, str) else None


def _offer_session(raw: bytes) -> str | None:
    """The session a joining offer names (its `session_id`, else its token's); None for a new session."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # the local handler reports the bad body
    if not isinstance(body, dict):
        return None
    sid = body.get("session_id")
    if isinstance(sid, str) and 0 < len(sid) <= 64:
        return sid
    return _token_session(body.get("token"))


def _body_token(raw: bytes) -> object:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body.get("token") if isinstance(body, dict) else None


def _token_for(request: web.Request, token: object, sid: str) -> bool:
    """Whether `token` (else the bearer token) is a valid client token for session `sid`."""
    token = token if token is not None else bearer_of(request)
    try:
        return request.app[SIGNER].verify(token) == sid
    except GatewayError:
        return False


@web.middleware
async def route(request: web.Request, handler):
    resource = request.match_info.route.resource
    label = ROUTES.get((request.method, resource.canonical if resource is not None else ""))
    if label is None:
        return await handler(request)
    fleet = cast(Fleet, request.app[FLEET])
    body = b""
    key = None
    try:
        if label == "offer":
            body = request[READ_AHEAD] = await read_body(request, MAX_OFFER_BYTES)
            sid = _offer_session(body)
        elif label == "create":
            sid = None
        elif label == "ice_servers":
            sid = _token_session(request.query.get("token") or bearer_of(request))
        else:
            sid = request.match_info["session_id"]
            if label in KEYED:
                key = check_api_key(request)
            elif label == "candidates":
                body = request[READ_AHEAD] = await read_body(request, MAX_CANDIDATE_BYTES)
    except GatewayError as exc:
        return error_response(exc)
    if label == "create" and not request.headers.get(HOP_HEADER):
        placed = await place(request, fleet)
        if placed is not None:
            return placed
    if sid is None:
        response = await handler(request)
        return await settle_new_session(fleet, response) if label in ("create", "offer") else response
    if sid in fleet.gateway.sessions or request.headers.get(HOP_HEADER):
        # Ours, or already proxied once: answered here, never sent on again.
        return await handler(request)
    if label in ("offer", "candidates", "ice_servers"):
        token = request.query.get("token") if label == "ice_servers" else _body_token(body)
        if not _token_for(request, token, sid):
            # No lookup for a request that does not hold the session's token: the local
            # handler gives the same error it would for a session held here.
            return await handler(request)
    try:
        record = await fleet.directory.find(sid)
    except GatewayError as exc:  # the directory cannot say (its codes are the outcomes counted)
        fleet.proxied.labels(label, exc.code).inc()
        return error_response(exc)
    if record is None or (label in KEYED and record.owner != key_id(key)):
        # Unknown, or another key's session (whose key the caller's is not): the local
        # answer, 404 unknown_session after the same key checks; the key goes nowhere.
        fleet.proxied.labels(label, "unknown").inc()
        return await handler(request)
    if label == "ws":
        return await proxy_ws(request, fleet, record.gateway)
    return await proxy_http(request, fleet, record.gateway, label, body)
