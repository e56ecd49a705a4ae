"""The HTTP face of the gateway: SDP offer/answer, ICE config, health, metrics, the page.

Every error is JSON `{"error": {"code", "message"}}` with a fitting status.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from ..config import Settings
from ..engine.runtime.client import EngineClient
from ..gateway.errors import GatewayError
from ..gateway import heap, media_startup
from ..gateway.gateway import Gateway
from .errors import MAX_CANDIDATE_BYTES, MAX_OFFER_BYTES, error_response, read_json_object
from .http_guard import client_address
from . import http_guard, openai_speech, openapi, sessions_api, tts_http, tts_ws, twilio_stream

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
OPENAPI = web.AppKey("openapi", dict)
# Paths a load balancer or kubelet probes by IP address: answered whatever the Host.
HOST_CHECK_EXEMPT = ("/healthz", "/readyz")
SECURITY_HEADERS = {
    # The page loads only its own scripts and styles and talks only to its own origin.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "media-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


async def handle_offer(request: web.Request) -> web.Response:
    gw: Gateway = request.app["gateway"]
    try:
        body = await read_json_object(request, MAX_OFFER_BYTES)
        sdp, kind = body.get("sdp"), body.get("type", "offer")
        if not isinstance(sdp, str) or not sdp.strip():
            raise GatewayError("invalid_sdp", "'sdp' must be the offer's SDP text")
        if kind != "offer":
            raise GatewayError("invalid_sdp", "'type' must be 'offer'")
        address = client_address(request, gw.trusted_proxies)
        session, created = gw.session_for_offer(body.get("session_id"), body.get("token"), body.get("voice"), address)
    except GatewayError as exc:
        return error_response(exc)
    try:
        answer = await gw.answer_offer(session, sdp, created)
    except GatewayError as exc:
        return error_response(exc)
    reply = {"sdp": answer, "type": "answer", "session_id": session.id}
    if created:
        # Trickle ICE for this session needs it (POST /v1/sessions/{id}/candidates).
        reply["token"] = request.app[sessions_api.SIGNER].issue(session.id)
    return web.json_response(reply)


async def handle_candidate(request: web.Request) -> web.Response:
    """Trickle ICE from the peer; only the holder of the session's client token may add candidates."""
    gw: Gateway = request.app["gateway"]
    sid = request.match_info["session_id"]
    try:
        body = await read_json_object(request, MAX_CANDIDATE_BYTES)
        sessions_api.check_client_token(request, body.get("token"), sid)
    except GatewayError as exc:
        return error_response(exc)
    try:
        await gw.add_candidate(sid, body)
    except GatewayError as exc:
        return error_response(exc)
    return web.json_response({"ok": True})


async def handle_ice_servers(request: web.Request) -> web.Response:
    """STUN servers for anyone; TURN servers, with credentials bound to one session and
    valid for --turn-ttl-s, only against that session's client token (a TURN server
    handed to everyone is an open relay)."""
    gw: Gateway = request.app["gateway"]
    token = request.query.get("token") or sessions_api.bearer_of(request)
    session_id = None
    if token is not None:
        try:
            session_id = gw.token_session(token)
        except GatewayError as exc:
            return error_response(exc)
    servers = []
    for server in gw.ice.servers_for(session_id or "anonymous"):
        url = server.urls if isinstance(server.urls, str) else server.urls[0]
        if session_id is None and (server.username or url.startswith("turn")):
            continue
        entry: dict[str, str | list[str] | None] = {"urls": [server.urls] if isinstance(server.urls, str) else server.urls}
        if server.username:
            entry["username"] = server.username
            entry["credential"] = server.credential
        servers.append(entry)
    if gw.ice.turn_secret and session_id is not None:
        return web.json_response({"ice_servers": servers, "ttl": gw.ice.turn_ttl_s})
    return web.json_response({"ice_servers": servers})


async def handle_healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def handle_readyz(request: web.Request) -> web.Response:
    gw: Gateway = request.app["gateway"]
    ready, why = gw.admission.ready()
    load = gw.admission.figures
    body: dict[str, object] = {"ready": ready, "engine": gw.engine.ready, "accepting": gw.accepting, "sessions": gw.session_count,
            # Admission's view (gateway/load/admission.py), in seconds of audio per second.
            "budget_rtf": round(load.budget, 2) if load.budget != float("inf") else None,
            "demand_rtf": round(load.expected, 2)}
    if why is not None:
        body["reason"] = why
    return web.json_response(body, status=200 if ready else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    gw: Gateway = request.app["gateway"]
    return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8")


async def handle_openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


async def handle_static(request: web.Request) -> web.StreamResponse:
    """The page's own files; anything else (missing, a folder, outside web/) is a JSON 404."""
    root = WEB_DIR.resolve()
    try:
        path = (root / request.match_info["path"]).resolve()
        path.relative_to(root)
        found = path.is_file()
    except (ValueError, OSError):
        found = False
    if not found:
        return error_response(GatewayError("not_found", "no such file", 404))
    return web.FileResponse(path)


async def handle_index(request: web.Request) -> web.StreamResponse:
    index = WEB_DIR / "index.html"
    if not index.exists():
        return error_response(GatewayError("no_page", "the bundled page is not installed", 404))
    return web.FileResponse(index)


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@web.middleware
async def host_check(request: web.Request, handler):
    """Answer only to the host names this server is meant to be reached by.

    DNS rebinding points a name the attacker controls at 127.0.0.1, so a
    page from that name can call a local, keyless gateway as its own origin;
    the Host header still carries the attacker's name, and is refused here.
    """
    allowed = request.app["gateway"].settings.allowed_hosts
    if "*" not in allowed and request.path not in HOST_CHECK_EXEMPT:
        if _host_name(request.host or "") not in allowed:
            return error_response(GatewayError("host_not_allowed", "this server does not answer to that Host; add it with --allowed-host", 421))
    return await handler(request)


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        response = await handler(request)
        if (
            response.status >= 400
            and not response.prepared
            and isinstance(response, web.Response)
            and response.content_type != "application/json"
        ):
            # aiohttp's own answers (the static files' 404) are not JSON; ours always are.
            reason = response.reason or "error"
            return error_response(GatewayError(reason.lower().replace(" ", "_"), reason, response.status))
        return response
    except GatewayError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        response = error_response(GatewayError(exc.reason.lower().replace(" ", "_"), exc.reason, exc.status))
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response


def _origin_allowed(request: web.Request, allowed: list[str]) -> bool:
    origin = request.headers.get("Origin")
    if origin is None:
        return True  # not a browser: servers, curl, telephony providers
    if "*" in allowed or origin in allowed:
        return True
    # Same origin: the bundled page. Compare host:port only, since a TLS proxy in
    # front changes the scheme the gateway sees.
    return urlsplit(origin).netloc == request.host


@web.middleware
async def origin_check(request: web.Request, handler):
    """Browsers may call the API from the gateway's own page, or from configured origins."""
    allowed = request.app["gateway"].settings.cors_origin
    if not _origin_allowed(request, allowed):
        if request.method in ("GET", "HEAD") and not request.headers.get("Upgrade"):
            return await handler(request)  # reads without CORS headers stay unreadable to the page
        return error_response(GatewayError("origin_not_allowed", "this Origin may not use the API; add it with --cors-origin", 403))
    origin = request.headers.get("Origin")
    if request.method == "OPTIONS" and origin and request.headers.get("Access-Control-Request-Method"):
        response = web.Response(status=204)
    else:
        response = await handler(request)
    if origin and (origin in allowed or "*" in allowed) and not response.prepared:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
        response.headers["Access-Control-Allow-Headers"] = "Content-Type, Authorization, X-API-Key"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, PATCH, DELETE, OPTIONS"
    return response


def create_app(settings: Settings, engine: EngineClient | None = None) -> web.Application:
    app = web.Application(middlewares=[host_check, origin_check, json_errors], client_max_size=MAX_OFFER_BYTES)
    app.on_response_prepare.append(_security_headers)
    gw = Gateway(settings, engine)
    app["gateway"] = gw
    app.router.add_post("/v1/offer", handle_offer)
    app.router.add_post("/v1/sessions/{session_id}/candidates", handle_candidate)
    app.router.add_get("/v1/ice-servers", handle_ice_servers)
    app.router.add_get("/healthz", handle_healthz)
    app.router.add_get("/readyz", handle_readyz)
    app.router.add_get("/metrics", handle_metrics)
    app[OPENAPI] = openapi.spec(web=settings.web)
    app.router.add_get("/openapi.json", handle_openapi)
    sessions_api.add_routes(app)
    twilio_stream.add_routes(app)
    tts_http.add_routes(app)
    tts_ws.add_routes(app)
    openai_speech.add_routes(app)
    if settings.web:
        app.router.add_get("/", handle_index)
        app.router.add_get("/static/{path:.+}", handle_static)
    if settings.redis_url:
        # Fleet (issue 16): the session directory and routing to other gateways; its
        # own module, so a standalone gateway imports neither it nor redis.
        from . import fleet

        fleet.setup(app)

    async def on_startup(app: web.Application) -> None:
        await gw.start()

    async def on_cleanup(app: web.Application) -> None:
        await gw.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address `host` names, on `port` (0: one free port for all).

    Taken before the engine and the voice load, so a port in use is said at once; raises OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _base_url(settings: Settings, port: int) -> str:
    if settings.public_url:
        return settings.public_url.rstrip("/")
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "<this machine's address>"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _engine_line(settings: Settings, info: dict) -> str:
    voices = info.get("voices") or []
    voice = settings.voice or (voices[0] if voices else "its default")
    where = f"the engine pool at {settings.engine_url}" if settings.engine_url else f"the {settings.engine} engine"
    device = f" on {info['device']}" if info.get("device") else ""
    load = f", loaded in {info['load_s']:.1f} s" if isinstance(info.get("load_s"), (int, float)) else ""
    more = f" (+{len(voices) - 1} more voices)" if len(voices) > 1 else ""
    return f"voice {voice} on {where}{device}{load}{more}"


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then drain: readiness goes false, new sessions are
    refused, current utterances get up to --drain-timeout-s to finish, then peers close."""
    settings.check()  # raises ConfigError before anything listens
    sockets = listen(settings.host, settings.port)  # raises OSError before the voice loads
    try:
        # Before the engine worker starts and before any encoding thread (raises PriorityError).
        media_startup.configure(settings)
        app = create_app(settings)
        gw: Gateway = app["gateway"]
        runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=http_guard.KEEPALIVE_S)
        await runner.setup()
        http_guard.quiet_descriptor_exhaustion(asyncio.get_running_loop())
        guard = http_guard.ConnectionGuard(
            settings.header_timeout_s, settings.max_connections, settings.max_connections_per_ip,
            exempt=gw.trusted_proxies, on_refused=lambda reason: gw.metrics.http_refused.labels(reason).inc(),
        )
        assert runner.server is not None  # made by setup()
        servers = await http_guard.start_servers(asyncio.get_running_loop(), guard, runner.server, sockets)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    heap.settle()
    # Here, at the process's entry, like settle: collection thresholds are the process's, and
    # tests run several gateways in one process.
    young_collections = heap.YoungCollections(settings.gc_young_threshold) if settings.gc_young_threshold else None
    full_collections = heap.FullCollections(settings.full_gc_interval_s) if settings.full_gc_interval_s else None
    try:
        if young_collections is not None:
            young_collections.start()
        if full_collections is not None and full_collections.start():
            gw.on_session_closed.append(full_collections.session_closed)
        url = _base_url(settings, sockets[0].getsockname()[1])
        log.info("listening on %s", url)
        log.log(*media_startup.media_line(settings))
        log.info("%s", _engine_line(settings, gw.engine.info))
        log.info("%s", media_startup.fast_paths_line(settings, gw.engine.info, gw.fast_paths, gw.compat))
        if settings.web:
            log.info("open %s/ in a browser", url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down: draining for up to %.0f s", settings.drain_timeout_s)
        await gw.drain(settings.drain_timeout_s)
        for server in servers:
            server.close()  # no new connections; runner.cleanup closes the open ones
        await runner.cleanup()
    finally:
        # The young one first: it cannot raise, and the full one awaits.
        if young_collections is not None:
            young_collections.stop()
        if full_collections is not None:
            await full_collections.stop()
    log.info("stopped")


def run(settings: Settings) -> None:
    asyncio.run(serve(settings))
