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

import asyncio
import hmac
import itertools
import json
import logging
import time

from aiohttp import WSMsgType, web

from ..gateway.protocol import parse
from ..gateway.session import Session
from ..gateway.errors import GatewayError, checked_voice
from ..gateway.frames import FRAME_MS
from ..gateway.registry import SessionRegistry, TokenSigner
from .errors import error_response, read_json_object

log = logging.getLogger(__name__)

# Events a slow backend may leave unread before it is disconnected.
MAX_PENDING_EVENTS = 10000
# What `?audio=` may ask for: 16 kHz mono PCM16 frames (gateway/caller_audio.py).
AUDIO_FORMATS = ("pcm16",)
CREATE_BODY_LIMIT = 8192


SIGNER = web.AppKey("token_signer", TokenSigner)
REGISTRY = web.AppKey("session_registry", SessionRegistry)
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
    """The session in the path, if the caller's key made it; the same 404 otherwise,
    so another key cannot even learn that it exists."""
    sid = request.match_info["session_id"]
    session = request.app["gateway"].sessions.get(sid)
    if session is None or session.closed or not request.app[REGISTRY].owned_by(sid, key):
        raise GatewayError("unknown_session", "no such session", 404)
    return session


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
    except GatewayError as exc:
        return error_response(exc)
    session = gw.create_session(voice=voice, key=key, made_ahead=True)
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
    gw = app["gateway"]
    registry = app[REGISTRY]
    now_mono, now_wall = time.monotonic(), time.time()
    call = registry.calls.get(session.id)
    backends = registry.backends.get(session.id, {})
    playing = session.playout.current
    return {
        "session_id": session.id,
        "made_ahead": session.id in registry.made_ahead,
        "codec": session.output_codec,
        "connected": {
            "webrtc": gw.peer_state(session.id),
            "telephony": None if call is None else call.describe(),
        },
        "utterances": {
            "queued": len(session.utterances),
            "playing": playing.id if playing is not None and playing.started else None,
            "ids": [u.id for u in session.utterances],
        },
        "writer": session.writer,
        "watchers": sorted(name for name, role in backends.items() if role == "watcher"),
        "backends": len(backends),
        "options": session.describe_options(),
        "stats": dict(session.stats),
        "created_at": round(now_wall - (now_mono - session.created_at), 3),
        "last_activity": round(now_wall - (now_mono - session.last_activity), 3),
    }


async def handle_get(request: web.Request) -> web.Response:
    key = check_api_key(request)
    return web.json_response(describe(request.app, _session_or_404(request, key)))


async def handle_list(request: web.Request) -> web.Response:
    """The caller's own sessions, or those of one phone call with `?call_sid=`."""
    key = check_api_key(request)
    registry = request.app[REGISTRY]
    call_sid = request.query.get("call_sid")
    out = []
    for session in list(request.app["gateway"].sessions.values()):
        if session.closed or not registry.owned_by(session.id, key):
            continue
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
_connection_ids = itertools.count(1)


async def handle_ws(request: web.Request) -> web.StreamResponse:
    key = check_api_key(request)
    session = _session_or_404(request, key)
    role = request.query.get("role", "writer")
    if role not in ("writer", "watcher"):
        return error_response(GatewayError("invalid_field", "'role' must be 'writer' or 'watcher'"))
    audio = request.query.get("audio")
    if audio is not None and audio not in AUDIO_FORMATS:
        return error_response(GatewayError("invalid_field", f"'audio' must be one of: {', '.join(AUDIO_FORMATS)} (the caller's audio as binary messages)"))
    gw = request.app["gateway"]
    limit = gw.settings.max_message_bytes
    # decode_text=False: a text frame with invalid UTF-8 reaches the session
    # as bytes and earns an error event instead of closing the connection.
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=max(4 * limit, 1 << 20), decode_text=False)
    await ws.prepare(request)
    name = f"ws:{next(_connection_ids)}"
    if role == "writer" and session.writer is None:
        session.writer = name
    else:
        role = "watcher"
    request.app[REGISTRY].add_backend(session.id, name, role)
    # Events (dicts) and, with ?audio=, the caller's audio frames (bytes), in the order they happened.
    outbox: asyncio.Queue = asyncio.Queue()
    frames_queued = 0
    max_frames = max(1, gw.settings.caller_audio_buffer_ms // FRAME_MS)
    frames_sent = gw.metrics.caller_audio_frames.labels("sent")
    frames_dropped = gw.metrics.caller_audio_frames.labels("dropped")

    def on_audio(message: bytes) -> None:
        # A backend that reads too slowly loses frames, never memory: a gap in its sequence numbers.
        nonlocal frames_queued
        if frames_queued >= max_frames:
            frames_dropped.inc()
            return
        frames_queued += 1
        outbox.put_nowait(message)

    def on_event(event: dict) -> None:
        if outbox.qsize() - frames_queued >= MAX_PENDING_EVENTS:
            log.warning("session %s: backend %s reads too slowly; disconnecting it", session.id, name, extra={"session_id": session.id})
            outbox.put_nowait(None)
            return
        outbox.put_nowait(event)

    async def pump() -> None:
        nonlocal frames_queued
        while True:
            event = await outbox.get()
            if isinstance(event, bytes):
                frames_queued -= 1
                try:
                    await ws.send_bytes(event)
                except (ConnectionError, RuntimeError):
                    return
                frames_sent.inc()
                continue
            if event is None:
                await ws.close(code=1013, message=b"events not read fast enough")
                return
            try:
                await ws.send_str(json.dumps(event))
            except (ConnectionError, RuntimeError):
                return
            if event.get("type") == "session.closed":
                await ws.close()
                return

    session.add_listener(name, on_event)
    on_event({**session.ready_event(), "role": role, "writer": session.writer})
    sender = asyncio.ensure_future(pump())
    if audio is not None:
        session.add_audio_tap(name, on_audio)
    log.info("session %s: backend %s attached as %s%s", session.id, name, role, " with the caller's audio" if audio else "",
             extra={"session_id": session.id})
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                _backend_message(session, name, msg.data)
            elif msg.type == WSMsgType.BINARY:
                on_event({"type": "error", "code": "binary_frame", "message": "binary frames are not accepted; send JSON text frames"})
            elif msg.type == WSMsgType.ERROR:
                break
    finally:
        session.remove_audio_tap(name)
        session.remove_listener(name)
        request.app[REGISTRY].drop_backend(session.id, name)
        if session.writer == name:
            session.writer = None
        if not sender.done():
            if session.closed:
                await asyncio.wait([sender], timeout=1.0)
            sender.cancel()
        log.info("session %s: backend %s detached", session.id, name, extra={"session_id": session.id})
    return ws


def _backend_message(session: Session, name: str, raw: str | bytes) -> None:
    if session.writer != name:
        # A watcher may ping; everything else is refused here, even while no
        # writer holds the session, so a watcher never races the writer.
        try:
            msg = parse(raw, session.options.limits)
        except GatewayError:
            msg = None  # let the session report the parse error itself
        if msg is not None and msg["type"] != "ping":
            session.emit(
                GatewayError("read_only", "this backend watches the session; only its writer may send text, cancel or updates", id=msg.get("id")).event(),
                only=name,
            )
            return
    session.handle_message(raw, source=name)


def add_routes(app: web.Application) -> None:
    # The gateway's own (gateway/registry.py): the routes read them under these keys.
    app[SIGNER] = app["gateway"].tokens
    app[REGISTRY] = app["gateway"].registry
    app.router.add_post("/v1/sessions", handle_create)
    app.router.add_get("/v1/sessions", handle_list)
    app.router.add_get("/v1/sessions/{session_id}", handle_get)
    app.router.add_delete("/v1/sessions/{session_id}", handle_delete)
    app.router.add_get("/v1/sessions/{session_id}/ws", handle_ws)
