"""Phone calls through Twilio Media Streams: `wss://host/v1/telephony/twilio`.

The protocol is Twilio's, exactly as the phone side speaks it: JSON text
frames `connected`, `start`, `media` (base64 μ-law, 8 kHz), `dtmf`, `mark`,
`stop` in; `media`, `mark`, `clear` out. See docs/telephony.md.

A `start` whose `customParameters` carry `session_id` and its client `token`
(from `POST /v1/sessions`) joins that session, so the bot backend that made
it drives the call. Otherwise the call gets a new session, unless the server
requires API keys or tokens. Caller audio goes through the session's VAD, so
a caller talking over the bot interrupts it just as a browser microphone does,
and on to the backends that ask for it (`?audio=pcm16`), upsampled to 16 kHz
(gateway/phone/twilio_input.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import time
from collections import OrderedDict

from aiohttp import WSMsgType, web

from ..gateway.sessions.session import Session
from ..gateway.phone.call_link import CallLink
from ..gateway.sessions.protocol import RateLimiter, decode_json
from ..gateway.backends.relay_options import options_from_parameters
from ..gateway.errors import GatewayError
from .errors import error_response
from .http_guard import RateLimitedLog, client_address
from .sessions_api import join_session

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 * 1024
# μ-law at 8 kHz is one byte a sample: Twilio sends 160 bytes (20 ms) a frame. Up to five
# such frames at once are taken; a larger payload is refused before it is decoded, so that
# at the frame rate limit a stream carries at most 20 times real time.
MAX_MEDIA_BYTES = 800
MAX_MEDIA_B64 = 4 * -(-MAX_MEDIA_BYTES // 3)
# Signatures remembered to refuse replays: past this many, the oldest are forgotten first.
MAX_SIGNATURES_SEEN = 100_000
# What clients make this module log (their errors, refusals) is one line a second at most,
# process-wide: the route is open to anyone who can reach it, Twilio configured or not.
_client_log = RateLimitedLog()
MULAW = "audio/x-mulaw"
INBOUND_EVENTS = ("connected", "start", "media", "dtmf", "mark", "stop")
# Twilio's ids (MZ..., CA...) are letters and digits; anything else is refused
# before it reaches a log line or an event.
SID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Frames per second a stream may send: Twilio sends 50 media frames a second
# plus a few marks and DTMF; this leaves room for bursts after a network stall.
MAX_FRAMES_PER_S = 200.0
# A stream over its rate for this many seconds in a row is closed.
MAX_FLOOD_S = 5.0


def _clean(value: object, limit: int = 64) -> str:
    """A client-supplied value made safe for a log line: printable, one line, short."""
    text = str(value)[:limit]
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def twilio_signature(auth_token: str, url: str) -> str:
    """Twilio's request signature for a URL with no POST parameters: base64(HMAC-SHA1(token, url))."""
    digest = hmac.new(auth_token.encode("utf-8"), url.encode("utf-8"), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def _from_trusted_proxy(request: web.Request, trusted: list) -> bool:
    try:
        ip = ipaddress.ip_address(request.remote or "")
    except ValueError:
        return False
    return any(ip in net for net in trusted)


def _signed_urls(request: web.Request, public_url: str | None, trusted: list) -> list[str]:
    """The URLs Twilio may have signed: the stream's wss:// URL as configured or as seen.
    X-Forwarded-Host/Proto count only from a --trusted-proxy: from anyone else they would let
    a signature made for another host pass here."""
    if public_url:
        base = public_url.rstrip("/")
    elif _from_trusted_proxy(request, trusted):
        proto = request.headers.get("X-Forwarded-Proto", request.scheme)
        base = f"{proto}://{request.headers.get('X-Forwarded-Host', request.host)}"
    else:
        base = f"{request.scheme}://{request.host}"
    rest = base.split("://", 1)[-1] + request.path_qs
    return [f"wss://{rest}", f"https://{rest}", f"ws://{rest}", f"http://{rest}"]


def signature_valid(request: web.Request, auth_token: str, public_url: str | None, trusted: list | None = None) -> bool:
    given = request.headers.get("X-Twilio-Signature", "")
    given_bytes = given.encode("utf-8", "surrogateescape")
    ok = False
    for url in _signed_urls(request, public_url, trusted or []):
        ok |= hmac.compare_digest(given_bytes, twilio_signature(auth_token, url).encode("ascii"))
    return ok and bool(given)


class SeenSignatures:
    """Signatures already used, each for its window: a stream URL signed once opens one stream.
    Twilio signs the URL alone, so a captured handshake would otherwise open streams for ever."""

    def __init__(self, window_s: float, limit: int = MAX_SIGNATURES_SEEN) -> None:
        self.window_s = window_s
        self.limit = limit
        self.expires: OrderedDict[str, float] = OrderedDict()

    def first_use(self, signature: str) -> bool:
        now = time.monotonic()
        while self.expires and (next(iter(self.expires.values())) <= now or len(self.expires) >= self.limit):
            self.expires.popitem(last=False)
        if signature in self.expires:
            return False
        self.expires[signature] = now + self.window_s
        return True


SEEN_SIGNATURES = web.AppKey("twilio_seen_signatures", SeenSignatures)


class TwilioCall:
    """One Media Streams connection bound to one session."""

    def __init__(self, app: web.Application, ws: web.WebSocketResponse, address: str = "unknown") -> None:
        self.app = app
        self.ws = ws
        self.address = address
        self.session: Session | None = None
        self.created = False
        self.stream_sid: str | None = None
        self.call_sid: str | None = None
        self.tracks: list[str] = []
        self.media_in = 0
        self.dtmf: list[str] = []
        self.link: CallLink | None = None  # the session's side of the call (gateway/phone/call_link.py), once started

    def describe(self) -> dict:
        return {
            "protocol": "twilio",
            "stream_sid": self.stream_sid,
            "call_sid": self.call_sid,
            "tracks": self.tracks,
            "media_in": self.media_in,
            "dtmf": "".join(self.dtmf),
            **(self.link.describe() if self.link is not None else {}),
        }

    async def send(self, message: dict) -> None:
        await self.ws.send_str(json.dumps(message))

    async def error(self, code: str, message: str) -> None:
        # Twilio never triggers these; a misbehaving client or stand-in reads them.
        # One line, no traceback, nothing the client wrote unescaped.
        _client_log(log.warning, f"telephony stream {_clean(self.stream_sid)}: {code}: {_clean(message, 200)}")
        if not self.ws.closed:
            await self.send({"event": "error", "code": code, "message": message})

    # Inbound
    async def handle(self, raw: str | bytes) -> None:
        msg = decode_json(raw, "the frame")
        if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
            raise GatewayError("invalid_message", "a frame must be a JSON object with a string 'event'")
        event = msg["event"]
        if event not in INBOUND_EVENTS:
            raise GatewayError("unknown_event", f"unknown event {event[:40]!r}; expected one of {', '.join(INBOUND_EVENTS)}")
        if event == "connected":
            return
        if event == "start":
            await self._start(msg)
            return
        if self.session is None:
            if event == "stop":
                return
            raise GatewayError("not_started", f"'{event[:40]}' before 'start'")
        if event == "media":
            self._media(msg)
        elif event == "mark":
            mark = msg.get("mark")
            name = mark.get("name") if isinstance(mark, dict) else None
            if not isinstance(name, str) or len(name) > 256:
                raise GatewayError("invalid_message", "'mark' needs a string mark.name")
            assert self.link is not None
            self.link.on_mark(name)
        elif event == "dtmf":
            dtmf = msg.get("dtmf")
            digit = dtmf.get("digit") if isinstance(dtmf, dict) else None
            if not isinstance(digit, str) or len(digit) != 1 or digit not in "0123456789*#ABCDabcd":
                raise GatewayError("invalid_message", "'dtmf' needs a one-character dtmf.digit (0-9, *, #, A-D)")
            self.dtmf.append(digit)
            self.session.caller.on_dtmf(digit, self.call_sid)
        elif event == "stop":
            raise GatewayError("stopped", "the call ended", fatal=True)

    async def _start(self, msg: dict) -> None:
        if self.session is not None:
            raise GatewayError("already_started", "this stream has already started")
        start = msg.get("start")
        if not isinstance(start, dict):
            raise GatewayError("invalid_message", "'start' needs a 'start' object", fatal=True)
        stream_sid = start.get("streamSid") or msg.get("streamSid")
        if not isinstance(stream_sid, str) or not SID.fullmatch(stream_sid):
            raise GatewayError("invalid_message", "'start' needs a streamSid of letters and digits", fatal=True)
        call_sid = start.get("callSid")
        if call_sid is not None and not (isinstance(call_sid, str) and SID.fullmatch(call_sid)):
            raise GatewayError("invalid_message", "'start.callSid' must be letters and digits", fatal=True)
        fmt = start.get("mediaFormat") or {}
        if not isinstance(fmt, dict):
            raise GatewayError("invalid_message", "'start.mediaFormat' must be an object", fatal=True)
        if fmt and (fmt.get("encoding") != MULAW or fmt.get("sampleRate", 8000) not in (8000, "8000") or fmt.get("channels", 1) not in (1, "1")):
            raise GatewayError("unsupported_format", f"only {MULAW}, 8000 Hz, mono is supported", fatal=True)
        params = start.get("customParameters") or {}
        if not isinstance(params, dict):
            raise GatewayError("invalid_message", "customParameters must be an object", fatal=True)
        tracks = start.get("tracks") or ["inbound"]
        if not isinstance(tracks, list):
            raise GatewayError("invalid_message", "'start.tracks' must be a list", fatal=True)
        self.stream_sid = stream_sid
        self.call_sid = call_sid
        self.tracks = [t for t in tracks[:4] if isinstance(t, str) and len(t) <= 32]
        session = self._session_for(params)
        self.session = session
        self.link = self.app["gateway"].attach_call(session, self, stream_sid, self.send, self._on_session_close)
        log.info(
            "call %s (stream %s) on session %s (%s)",
            _clean(self.call_sid), _clean(stream_sid), session.id, "new" if self.created else "made ahead",
        )
        public = {str(k)[:64]: v for k, v in list(params.items())[:32] if k != "token"}
        session.emit({"type": "call.started", "call_sid": self.call_sid, "stream_sid": stream_sid, "custom_parameters": public})

    def _session_for(self, params: dict) -> Session:
        gw = self.app["gateway"]
        sid, token = params.get("session_id"), params.get("token")
        if sid is None and token is None:
            if gw.settings.api_key or gw.settings.require_token:
                raise GatewayError("token_required", "this server needs customParameters session_id and token from POST /v1/sessions", fatal=True)
            try:
                address = self.address
                # <Parameter name="relay_url"> (or --relay-url): a ConversationRelay application drives the call (docs/relay.md).
                relay = options_from_parameters(params, gw.settings.relay_url)
                voice = None if relay is not None else params.get("voice")
                session = gw.create_session(voice=voice, anonymous_from=address, relay=relay)
            except GatewayError as exc:
                # No room (503): the call protocol has always said "unavailable".
                code = "unavailable" if exc.status == 503 else exc.code
                raise GatewayError(code, exc.message, fatal=True, detail=exc.detail) from None
            self.created = True
            return session
        if token is None:
            raise GatewayError("token_required", "joining a session needs its client token as customParameters.token", fatal=True)
        try:
            return join_session(self.app, sid, token)
        except GatewayError as exc:
            raise GatewayError(exc.code, exc.message, fatal=True) from None

    def _media(self, msg: dict) -> None:
        media = msg.get("media")
        if not isinstance(media, dict) or not isinstance(media.get("payload"), str):
            raise GatewayError("invalid_message", "'media' needs media.payload")
        if len(media["payload"]) > MAX_MEDIA_B64:
            raise GatewayError("frame_too_large", f"media.payload over {MAX_MEDIA_BYTES} bytes of {MULAW} "
                                                  "(Twilio sends 160, 20 ms); the frame was dropped")
        if media.get("track", "inbound") not in ("inbound", "inbound_track", "outbound", "outbound_track"):
            raise GatewayError("invalid_message", "media.track must be inbound or outbound")
        if media.get("track", "inbound") not in ("inbound", "inbound_track"):
            return  # our own audio echoed back on a bidirectional stream
        try:
            ulaw = base64.b64decode(media["payload"], validate=True)
        except (binascii.Error, ValueError):
            raise GatewayError("invalid_payload", "media.payload is not base64") from None
        self.media_in += 1
        assert self.link is not None
        self.link.feed(ulaw)

    # Lifecycle
    async def _on_session_close(self) -> None:
        if not self.ws.closed:
            await self.ws.close()

    async def end(self, reason: str) -> None:
        if self.link is None:
            return
        await self.link.end({"type": "call.ended", "call_sid": self.call_sid, "reason": reason}, reason)
        log.info("call %s (stream %s) ended: %s", _clean(self.call_sid), _clean(self.stream_sid), _clean(reason, 200))


async def handle_twilio(request: web.Request) -> web.StreamResponse:
    gw = request.app["gateway"]
    settings = gw.settings
    if settings.twilio_auth_token:
        if not signature_valid(request, settings.twilio_auth_token, settings.public_url, gw.trusted_proxies):
            _client_log(log.warning, f"telephony: refused a stream from {_clean(request.remote)}: invalid_signature")
            return error_response(GatewayError("invalid_signature", "X-Twilio-Signature does not match this URL; check --twilio-auth-token and --public-url", 403))
        if not request.app[SEEN_SIGNATURES].first_use(request.headers["X-Twilio-Signature"]):
            _client_log(log.warning, f"telephony: refused a stream from {_clean(request.remote)}: signature_replayed")
            return error_response(GatewayError(
                "signature_replayed", "this X-Twilio-Signature has opened a stream already; each stream URL must carry "
                "a per-call value (e.g. ?call={{CallSid}}) to be signed anew", 403))

    ws = web.WebSocketResponse(heartbeat=None, max_msg_size=MAX_FRAME_BYTES, decode_text=False)
    await ws.prepare(request)
    call = TwilioCall(request.app, ws, client_address(request, gw.trusted_proxies))
    reason = "stream closed"
    limiter = RateLimiter(MAX_FRAMES_PER_S)
    flooding_since: float | None = None

    def no_start() -> None:
        if call.session is None and not ws.closed:
            asyncio.ensure_future(_close_unstarted(call))

    start_timer = asyncio.get_running_loop().call_later(settings.telephony_start_timeout_s, no_start)
    try:
        async for msg in ws:
            if not limiter.allow():
                now = time.monotonic()
                if flooding_since is None:
                    flooding_since = now
                    await call.error("rate_limited", f"more than {MAX_FRAMES_PER_S:g} frames per second; frames are being dropped")
                elif now - flooding_since > MAX_FLOOD_S:
                    reason = "rate_limited"
                    break
                continue
            flooding_since = None
            if msg.type == WSMsgType.BINARY:
                await call.error("binary_frame", "Media Streams frames are JSON text; a binary frame was ignored")
                continue
            if msg.type != WSMsgType.TEXT:
                if msg.type == WSMsgType.ERROR:
                    reason = f"stream error: {ws.exception()}"
                break
            try:
                await call.handle(msg.data)
            except GatewayError as exc:
                if exc.code == "stopped":
                    reason = "stop"
                    break
                await call.error(exc.code, exc.message)
                if exc.fatal:
                    reason = exc.code
                    break
            except Exception as exc:  # a bug costs this frame, not the call
                log.exception("telephony stream %s: frame failed", _clean(call.stream_sid))
                await call.error("internal", f"internal error: {type(exc).__name__}")
    finally:
        start_timer.cancel()
        await call.end(reason)
        if not ws.closed:
            await ws.close()
    return ws


async def _close_unstarted(call: TwilioCall) -> None:
    timeout = call.app["gateway"].settings.telephony_start_timeout_s
    await call.error("start_timeout", f"no 'start' within {timeout:g} s")
    await call.ws.close(code=1008, message=b"no start")


def add_routes(app: web.Application) -> None:
    app[SEEN_SIGNATURES] = SeenSignatures(app["gateway"].settings.twilio_replay_window_s)
    app.router.add_get("/v1/telephony/twilio", handle_twilio)
