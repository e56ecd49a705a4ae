"""The session API for voice-bot backends.

A backend creates a session ahead of time (`POST /v1/sessions`), hands the
browser a short-lived client token for `/v1/offer` (or puts it in a Twilio
`<Stream>`), and drives the session over a WebSocket that carries the same
JSON messages as the data channel. API keys guard everything here; with no key
configured the endpoints are open (local demo).

Client tokens are `base64url(payload).base64url(hmac_sha256(payload))`, the
payload holding the session id and an expiry, so the server keeps no token
state and a restart with the same `--token-secret` still accepts them.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import WSMsgType, web

from ..gateway.backends.backend_link import AUDIO_FORMATS
from ..gateway.sessions.session import Session
from ..gateway.errors import GatewayError, checked_voice
from ..gateway.sessions.registry import TokenSigner
from ..gateway.backends.relay_options import parse_options as parse_relay
from .errors import error_response, read_json_object

log = logging.getLogger(__name__)

CREATE_BODY_LIMIT = 8192


SIGNER = web.AppKey("token_signer", TokenSigner)
def bearer_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None


def api_key_of(request: web.Request) -> str | None:
    return bearer_of(request) or request.headers.get("X-API-Key")


def check_client_token(request: web.Request, token: object, session_id: str) -> None:
    """The request carries a client token for `session_id` (in the body, or as a bearer token)."""
    token = token if token is not None else bearer_of(request)
    if token is None:
        raise GatewayError("token_required", "this needs the session's client token: 'token' in the body, or Authorization: Bearer <token>", 401)
    if request.app[SIGNER].verify(token) != session_id:
        raise GatewayError("token_mismatch", "the token was issued for another session", 403)


def check_api_key(request: web.Request, query: bool = False) -> str | None:
    """The caller's key; refuses (401) when keys are configured and this one is not among them.
    `query`: the key may come as ?key= too (a browser cannot set a WebSocket's headers)."""
    keys = request.app["gateway"].settings.api_key
    if not keys:
        return None
    given = api_key_of(request) or (request.query.get("key") if query else None)
    if not given:
        raise GatewayError("unauthorized", "an API key is required: Authorization: Bearer <key> or X-API-Key", 401)
    # Header bytes that are not UTF-8 reach us as surrogates; compare raw bytes.
    given_bytes = given.encode("utf-8", "surrogateescape")
    match = None
    for key in keys:
        if hmac.compare_digest(given_bytes, key.encode("utf-8")):
            match = key
    if match is not None:
        return match
    raise GatewayError("invalid_api_key", "the API key is not valid", 401)


def _session_or_404(request: web.Request, key: str | None) -> Session:
    """The session in the path, if the caller's key made it (Gateway.owned_session)."""
    return request.app["gateway"].owned_session(request.match_info["session_id"], key)


def join_session(app: web.Application, sid: str | None, token: object) -> Session:
    """The session made ahead that `token` was issued for (Gateway.join_session)."""
    return app["gateway"].join_session(sid, token)


# HTTP
def _urls(request: web.Request, session_id: str) -> dict:
    proto = request.headers.get("X-Forwarded-Proto", request.scheme)
    host = request.headers.get("X-Forwarded-Host", request.host)
    return session_urls(f"{proto}://{host}", session_id)


def session_urls(base: str, session_id: str) -> dict:
    """A session's URLs on the gateway at `base` (http(s)://HOST[:PORT])."""
    http = base.rstrip("/")
    ws = ("wss" if http.startswith("https:") else "ws") + http[http.index(":"):]
    return {
        "session_url": f"{http}/v1/sessions/{session_id}",
        "offer_url": f"{http}/v1/offer",
        "ws_url": f"{ws}/v1/sessions/{session_id}/ws",
        "telephony_url": f"{ws}/v1/telephony/twilio",
    }


async def handle_create(request: web.Request) -> web.Response:
    key = check_api_key(request)
    gw = request.app["gateway"]
    try:
        body = await read_json_object(request, CREATE_BODY_LIMIT, "an empty body is fine too", allow_empty=True)
    except GatewayError as exc:
        return error_response(exc)
    try:
        voice = checked_voice(gw.engine, body.get("voice"))
        relay = body.get("relay")
        if relay is not None and not isinstance(relay, dict):
            raise GatewayError("invalid_field", "'relay' must be an object such as {\"url\": \"wss://app.example/relay\"}")
        relay = parse_relay(relay, default_url=gw.settings.relay_url) if relay is not None else None  # docs/relay.md
    except GatewayError as exc:
        return error_response(exc)
    session = gw.create_session(voice=voice, key=key, made_ahead=True, relay=relay)
    signer = request.app[SIGNER]
    log.info("session %s made ahead through the session API", session.id, extra={"session_id": session.id})
    return web.json_response(
        {
            "session_id": session.id,
            "client_token": signer.issue(session.id),
            "token_expires_in_s": signer.ttl_s,
            **_urls(request, session.id),
        },
        status=201,
    )


def describe(app: web.Application, session: Session) -> dict:
    return app["gateway"].describe(session)


async def handle_get(request: web.Request) -> web.Response:
    key = check_api_key(request)
    return web.json_response(describe(request.app, _session_or_404(request, key)))


async def handle_list(request: web.Request) -> web.Response:
    """The caller's own sessions, or those of one phone call with `?call_sid=`."""
    key = check_api_key(request)
    call_sid = request.query.get("call_sid")
    out = []
    for session in request.app["gateway"].owned_sessions(key):
        state = describe(request.app, session)
        telephony = state["connected"]["telephony"]
        if call_sid is not None and (telephony is None or telephony.get("call_sid") != call_sid):
            continue
        out.append(state)
    return web.json_response({"sessions": out})


async def handle_delete(request: web.Request) -> web.Response:
    key = check_api_key(request)
    session = _session_or_404(request, key)
    await session.close("ended through the session API")
    return web.json_response({"session_id": session.id, "closed": True})


# The backend WebSocket
async def handle_ws(request: web.Request) -> web.StreamResponse:
    """Checks the request and wires the socket; the gateway's BackendLink
    (gateway/backends/backend_link.py) does the rest: role, events, the caller's audio."""
    key = check_api_key(request)
    session = _session_or_404(request, key)
    role = request.query.get("role", "writer")
    if role not in ("writer", "watcher"):
        return error_response(GatewayError("invalid_field", "'role' must be 'writer' or 'watcher'"))
    audio = request.query.get("audio")
    if audio is not None and audio not in AUDIO_FORMATS:
        return error_response(GatewayError("invalid_field", f"'audio' must be one of: {', '.join(AUDIO_FORMATS)} (the caller's audio as binary messages)"))
    gw = request.app["gateway"]
    try:
        gw.backend_room(session, key)  # answered as HTTP 429 before the upgrade
    except GatewayError as exc:
        return error_response(exc)
    limit = gw.settings.max_message_bytes
    # decode_text=False: a text frame with invalid UTF-8 reaches the session
    # as bytes and earns an error event instead of closing the connection.
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=max(4 * limit, 1 << 20), decode_text=False)
    await ws.prepare(request)
    transport = request.transport
    try:
        link = gw.attach_backend(session, ws, role, audio is not None, key,
                                 abort=transport.abort if transport is not None else None)
    except GatewayError as exc:  # others attached while this one upgraded
        await ws.close(code=1013, message=exc.code.encode())
        return ws
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                link.on_text(msg.data)
            elif msg.type == WSMsgType.BINARY:
                link.on_binary()
            elif msg.type == WSMsgType.ERROR:
                break
    finally:
        await link.detach()
    return ws


def add_routes(app: web.Application) -> None:
    # The gateway's own client tokens (gateway/sessions/registry.py), under a key the routes share.
    app[SIGNER] = app["gateway"].tokens
    app.router.add_post("/v1/sessions", handle_create)
    app.router.add_get("/v1/sessions", handle_list)
    app.router.add_get("/v1/sessions/{session_id}", handle_get)
    app.router.add_delete("/v1/sessions/{session_id}", handle_delete)
    app.router.add_get("/v1/sessions/{session_id}/ws", handle_ws)
