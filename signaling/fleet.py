"""Any gateway answers about any session: routing through the session directory.

With `--redis-url`, a request about a session this gateway does not hold is
looked up in the directory (gateway/directory.py) and proxied to the gateway
that holds it: `GET`/`DELETE /v1/sessions/{id}`, its ICE candidates, an offer
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
it names a gateway of the fleet (gateway/directory.py), so nobody who can
write to Redis alone can send a caller's key elsewhere. The target is the
holder's URL and the request's path and query (never the raw request line,
which may be absolute). It adds one hop header, which can only take routing away: a request
that carries it is answered locally, so a stale record never bounces requests
between gateways.

Placement: each gateway publishes its load (its speech budget and demand,
gateway/admission.py) in the directory. `POST /v1/sessions` on any gateway
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

import asyncio
import base64
import json
import logging
import math
from typing import cast

import aiohttp
from aiohttp import WSMsgType, web
from prometheus_client import Counter, Gauge

from ..gateway.directory import Directory, DirectoryUnavailable, RecordRefused, key_id
from ..gateway.session import Session
from ..gateway.errors import GatewayError
from .errors import MAX_CANDIDATE_BYTES, MAX_OFFER_BYTES, READ_AHEAD, error_response, read_body
from .sessions_api import CREATE_BODY_LIMIT, SIGNER, TRACK_HOOKS, bearer_of, check_api_key, session_urls

log = logging.getLogger(__name__)

HOP_HEADER = "X-Voxgate-Hop"
# Request headers the holder needs to answer as if it had been asked itself.
FORWARDED_HEADERS = ("Authorization", "X-API-Key", "Content-Type", "Origin", "User-Agent")
# The holder's response headers that mean something to the caller.
RETURNED_HEADERS = ("Content-Type", "Retry-After", "Allow")
MAX_PROXIED_RESPONSE_BYTES = 1 << 20
# Holders answer on the same network; an offer's answer waits for ICE gathering.
PROXY_TIMEOUT_S = 20.0
WS_HEARTBEAT_S = 20.0
WS_CLOSE_CODES_NOT_SENDABLE = (None, 1005, 1006, 1015)

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
        return budget, demand, len(self.gateway.sessions)

    def track(self, session: Session, owner: str | None) -> None:
        def taken() -> None:
            asyncio.ensure_future(session.close("session id taken by another gateway"))

        self.directory.hold(session.id, owner, taken)
        session.on_close.append(lambda s: self.directory.release(s.id))

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
    app.setdefault(TRACK_HOOKS, []).append(fleet.track)
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
        placed = await _place(request, fleet)
        if placed is not None:
            return placed
    if sid is None:
        response = await handler(request)
        return await _settle_new_session(fleet, response) if label in ("create", "offer") else response
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
        record = await fleet.directory.lookup(sid)
        if record is not None and not fleet.directory.is_self(record) and not await fleet.directory.is_gateway(record.gateway):
            fleet.proxied.labels(label, "owner_unknown").inc()
            log.warning("a directory record names %s, which is not a gateway of the fleet; not followed", record.gateway)
            return error_response(GatewayError("owner_unknown", "the session's record names a gateway that is not in the fleet's list; retry shortly", 503))
    except RecordRefused:
        fleet.proxied.labels(label, "record_refused").inc()
        return error_response(GatewayError("record_refused", "the session's directory record failed its check and is "
                                           "not followed; its gateway rewrites it shortly; retry", 503))
    except DirectoryUnavailable:
        fleet.proxied.labels(label, "directory_unavailable").inc()
        return error_response(GatewayError("directory_unavailable", "this gateway does not hold the session and cannot reach the session directory; retry shortly", 503))
    if record is None or fleet.directory.is_self(record) or (label in KEYED and record.owner != key_id(key)):
        # Unknown, or another key's session (whose key the caller's is not): the local
        # answer, 404 unknown_session after the same key checks; the key goes nowhere.
        fleet.proxied.labels(label, "unknown").inc()
        return await handler(request)
    if label == "ws":
        return await _proxy_ws(request, fleet, record.gateway)
    return await _proxy_http(request, fleet, record.gateway, label, body)


async def _place(request: web.Request, fleet: Fleet) -> web.Response | None:
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
            target + "/v1/sessions", data=body or None, headers=_forward_headers(request), allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT_S),
        ) as resp:
            payload = await _read_capped(resp.content, MAX_PROXIED_RESPONSE_BYTES)
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


async def _settle_new_session(fleet: Fleet, response: web.StreamResponse) -> web.StreamResponse:
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


def _forward_headers(request: web.Request) -> dict[str, str]:
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
    # The caller's Host: the holder's host and same-origin checks see what this gateway saw.
    headers["Host"] = request.host
    headers[HOP_HEADER] = "1"
    forwarded_for = request.headers.get("X-Forwarded-For")
    remote = request.remote or "unknown"
    headers["X-Forwarded-For"] = f"{forwarded_for}, {remote}" if forwarded_for else remote
    return headers


def _unreachable(fleet: Fleet, label: str, owner: str, exc: BaseException) -> web.Response:
    fleet.proxied.labels(label, "owner_unreachable").inc()
    log.warning("gateway %s holding a session did not answer: %s", owner, type(exc).__name__)
    return error_response(GatewayError("owner_unreachable", "the gateway that holds this session did not answer; retry shortly", 502))


async def _proxy_http(request: web.Request, fleet: Fleet, owner: str, label: str, body: bytes) -> web.Response:
    try:
        async with fleet.client.request(
            request.method, owner + str(request.rel_url), data=body or None, headers=_forward_headers(request),
            allow_redirects=False, timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT_S),
        ) as resp:
            payload = await _read_capped(resp.content, MAX_PROXIED_RESPONSE_BYTES)
            headers = {name: resp.headers[name] for name in RETURNED_HEADERS if name in resp.headers}
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _unreachable(fleet, label, owner, exc)
    fleet.proxied.labels(label, "proxied").inc()
    return web.Response(status=status, body=payload, headers=headers)


async def _read_capped(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body, however many segments it comes in (one read() returns only
    what has arrived so far), refused past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.read(limit + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise aiohttp.ClientPayloadError(f"answer over {limit} bytes")


async def _proxy_ws(request: web.Request, fleet: Fleet, owner: str) -> web.StreamResponse:
    downstream = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, max_msg_size=fleet.max_ws_message, decode_text=False)
    if not downstream.can_prepare(request).ok:
        # Not an upgrade: no socket to the holder (it would take the session's
        # writer role from the real backend while the caller gets its error).
        return await _proxy_http(request, fleet, owner, "ws", b"")
    url = "ws" + owner[len("http"):] + str(request.rel_url)  # http -> ws, https -> wss
    try:
        # The handshake is bounded like any proxied request; the socket then lives as long as the session.
        upstream = await asyncio.wait_for(fleet.client.ws_connect(
            url, headers=_forward_headers(request), heartbeat=WS_HEARTBEAT_S, max_msg_size=fleet.max_ws_message,
            timeout=aiohttp.ClientWSTimeout(ws_close=5.0), autoping=True,
        ), PROXY_TIMEOUT_S)
    except aiohttp.WSServerHandshakeError:
        # The holder refused the upgrade (unknown session, bad role): ask again
        # without it, and relay its JSON error as it wrote it.
        return await _proxy_http(request, fleet, owner, "ws", b"")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _unreachable(fleet, "ws", owner, exc)
    fleet.proxied.labels("ws", "proxied").inc()
    # decode_text=False, as the local handler: a text frame that is not UTF-8
    # reaches the holder, which answers it with an error event.
    try:
        await downstream.prepare(request)
    except BaseException:
        await upstream.close()
        raise
    fleet.sockets.add(downstream)

    async def to_caller() -> None:
        async for msg in upstream:
            if msg.type == WSMsgType.TEXT:
                await downstream.send_str(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await downstream.send_bytes(msg.data)
            else:
                break

    async def to_holder() -> None:
        async for msg in downstream:
            if msg.type == WSMsgType.TEXT:
                await upstream.send_frame(msg.data if isinstance(msg.data, bytes) else msg.data.encode(), WSMsgType.TEXT)
            elif msg.type == WSMsgType.BINARY:
                await upstream.send_bytes(msg.data)
            else:
                break

    pumps = [asyncio.ensure_future(to_caller()), asyncio.ensure_future(to_holder())]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in pumps:
            pump.cancel()
        fleet.sockets.discard(downstream)
        code = upstream.close_code
        if not upstream.closed:
            await upstream.close()  # the caller left: the holder sees its backend go
        if not downstream.closed:
            if code in WS_CLOSE_CODES_NOT_SENDABLE:
                await downstream.close(code=1001, message=b"the gateway holding the session went away")
            else:
                await downstream.close(code=code, message=b"closed by the gateway holding the session")
    return downstream
