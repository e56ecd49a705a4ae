"""The bi-streaming TTS WebSocket: `GET /v1/tts/ws`.

Text goes in as it arrives (an LLM's tokens), audio comes out as it is made,
with each word's start and end on the audio's own clock. One connection
carries several contexts, each its own utterance, so an agent can start its
next reply while the last one is being cancelled. The messages are in
docs/tts-websocket.md.

This module parses, authenticates, routes and writes frames. The contexts are
gateway/peerless/speech_contexts.py's `SpeechContexts` (how many, their text, their idle end,
their audio's format and word timings), each a gateway/peerless/peerless_speech.py
`PeerlessUtterance` (its slot, stream, audio cap and cancel), the model `POST /v1/tts`
uses too. Bounded here: bytes and messages a second per connection
(--max-message-bytes, --max-messages-per-s), text per message (--max-text-chars),
and what waits for the socket (a short queue; a reader that takes nothing for
--write-stall-s loses the connection, a slow one paces synthesis).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time

from aiohttp import WSMsgType, web

from ..gateway.errors import GatewayError, checked_voice
from ..gateway.sessions.protocol import RateLimiter, decode_json
from ..gateway.peerless.speech_contexts import (CONTEXT_FORMATS, ContextAudio, ContextCancelled, ContextDone, ContextError,
                                       ContextOutput, SpeechContexts)
from .errors import error_response
from .http_guard import RateLimitedLog, client_address
from .sessions_api import check_api_key

log = logging.getLogger(__name__)

# A context's id: what ElevenLabs-style clients send (UUIDs, short names).
CONTEXT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
CLIENT_TYPES = ("text", "flush", "end", "cancel")
# Audio messages waiting for the socket; past it, contexts wait (synthesis is paced by the reader).
OUT_QUEUE = 32
# Control messages (errors, acknowledgements) waiting for the socket; past it the client is disconnected.
MAX_CONTROL = 256
# A connection over its message rate for this long in a row is closed.
MAX_FLOOD_S = 5.0
_client_log = RateLimitedLog()


def _clean(value: object, limit: int = 64) -> str:
    text = str(value)[:limit]
    return "".join(ch if ch.isprintable() else "?" for ch in text)


class Connection:
    """One connection's socket: its one writer, the client's messages parsed and routed to its
    contexts (gateway/peerless/speech_contexts.py), and the events they make written as JSON frames."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, caller: str, output: ContextOutput,
                 voice: str | None) -> None:
        self.request = request
        self.ws = ws
        gw = request.app["gateway"]
        self.settings = gw.settings
        self.caller = caller
        self.contexts = SpeechContexts(gw.engine, gw.admission, gw.settings, caller, voice, output, self)
        # Everything for the socket, in order; audio bounded by the slots, control by MAX_CONTROL.
        self.out: asyncio.Queue = asyncio.Queue()
        self.audio_slots = asyncio.Semaphore(OUT_QUEUE)
        self.control_pending = 0
        self.closing: str | None = None

    # Out (the contexts' ContextSink)
    async def send(self, event: ContextAudio | ContextDone) -> None:
        """A context's audio or done: waits while OUT_QUEUE of them wait for the socket."""
        await self.audio_slots.acquire()
        self.out.put_nowait(event)

    def send_now(self, event: ContextCancelled | ContextError | dict) -> None:
        """A control message (ready, errors, acknowledgements): never waits behind the
        audio slots; as many as the client's own messages, which are rate limited, and a
        client that leaves MAX_CONTROL of them unread is disconnected."""
        if self.control_pending >= MAX_CONTROL:
            self.disconnect("slow_reader")
            return
        self.control_pending += 1
        self.out.put_nowait(event)

    def error(self, code: str, message: str, context_id: str | None = None) -> None:
        self.send_now(ContextError(code, message, context_id))

    def disconnect(self, why: str) -> None:
        if self.closing is None:
            self.closing = why
            _client_log(log.warning, f"tts ws {_clean(self.caller)}: {why}; disconnecting it")
        if self.request.transport is not None:
            self.request.transport.abort()

    async def writer(self) -> None:
        """The one task that writes to the socket, in order; a cancelled context's
        queued audio is dropped here, so none of it follows its `cancelled`."""
        while True:
            event = await self.out.get()
            try:
                if isinstance(event, (ContextAudio, ContextDone)):
                    self.audio_slots.release()
                    if event.context.cancelled:
                        continue
                else:
                    self.control_pending -= 1
                stall = self.settings.write_stall_s
                try:
                    await asyncio.wait_for(self.ws.send_str(json.dumps(_message(event), separators=(",", ":"))), stall)
                except asyncio.TimeoutError:
                    self.disconnect(f"read nothing for {stall:g} s")
                    return
                except (ConnectionError, RuntimeError):
                    return
            finally:
                self.out.task_done()

    # In
    def handle(self, raw: str | bytes) -> None:
        msg = decode_json(raw, "message", "send one JSON object with a 'type'", self.settings.max_message_bytes)
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise GatewayError("invalid_message", "a message is a JSON object with a string 'type'")
        kind = msg["type"]
        if kind not in CLIENT_TYPES:
            raise GatewayError("unknown_type", f"unknown message type {kind[:40]!r}; expected one of {', '.join(CLIENT_TYPES)}")
        cid = msg.get("context_id")
        if not isinstance(cid, str) or not CONTEXT_ID.fullmatch(cid):
            raise GatewayError("invalid_field", "'context_id' must be 1 to 64 letters, digits or _.:-")
        if kind == "text":
            text = msg.get("text")
            if not isinstance(text, str):
                raise GatewayError("invalid_field", "'text' needs a string 'text'", id=cid)
            if len(text) > self.settings.max_text_chars:
                raise GatewayError("text_too_long", f"text has {len(text)} characters; the limit per message is {self.settings.max_text_chars}", id=cid)
            if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
                raise GatewayError("invalid_utf8", "text holds unpaired surrogates", id=cid)
            self.contexts.text(cid, text, msg.get("voice"))
        elif kind == "cancel":
            self.contexts.cancel(cid)
        elif kind == "flush":
            self.contexts.flush(cid)
        else:
            self.contexts.end(cid)


def _message(event: ContextAudio | ContextDone | ContextCancelled | ContextError | dict) -> dict:
    """An event as its JSON message (docs/tts-websocket.md)."""
    if isinstance(event, ContextAudio):
        words = [{"word": w.word, "start_ms": w.start_ms, "end_ms": w.end_ms} for w in event.words]
        return {"type": "audio", "context_id": event.context.id, "seq": event.seq,
                "audio": base64.b64encode(event.data).decode("ascii"),
                "start_ms": event.start_ms, "duration_ms": event.duration_ms, "words": words}
    if isinstance(event, ContextDone):
        return {"type": "done", "context_id": event.context.id, "duration_ms": event.duration_ms}
    if isinstance(event, ContextCancelled):
        return {"type": "cancelled", "context_id": event.context_id}
    if isinstance(event, ContextError):
        payload = {"type": "error", "code": event.code, "message": event.message}
        if event.context_id is not None:
            payload["context_id"] = event.context_id
        return payload
    return event


def _query(request: web.Request, gw) -> tuple[ContextOutput, str | None]:
    q = request.query
    fmt = q.get("format", "pcm16")
    if fmt not in CONTEXT_FORMATS:
        raise GatewayError("invalid_field", f"'format' must be one of {', '.join(CONTEXT_FORMATS)}")
    rate = None
    if "sample_rate" in q:
        if fmt != "pcm16":
            raise GatewayError("invalid_field", "'sample_rate' applies to pcm16 only; Opus packets decode at 48000 Hz")
        raw = q["sample_rate"]
        if not raw.isdigit() or not 8000 <= int(raw) <= 48000:
            raise GatewayError("invalid_field", "'sample_rate' must be a whole number from 8000 to 48000")
        rate = int(raw)
    voice = checked_voice(gw.engine, q["voice"]) if "voice" in q else None
    words = q.get("words", "true")
    if words not in ("true", "false"):
        raise GatewayError("invalid_field", "'words' must be true or false")
    return ContextOutput(fmt, rate, words == "true"), voice


async def handle_tts_ws(request: web.Request) -> web.StreamResponse:
    gw = request.app["gateway"]
    try:
        key = check_api_key(request, query=True)  # raises a JSON 401
        output, voice = _query(request, gw)
        if not gw.accepting:
            raise GatewayError("draining", "the server is shutting down; retry on another instance", 503)
    except GatewayError as exc:
        return error_response(exc)
    caller = key if key is not None else client_address(request, gw.trusted_proxies)
    limit = gw.settings.max_message_bytes
    # Up to twice the limit arrives and earns a JSON error; past that aiohttp closes with 1009.
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=2 * limit, decode_text=False, compress=False)
    await ws.prepare(request)
    conn = Connection(request, ws, caller, output, voice)
    writer = asyncio.ensure_future(conn.writer())
    default_voice = voice or (gw.engine.info.get("voices") or [None])[0]
    conn.send_now({"type": "ready", "sample_rate": conn.contexts.sample_rate, "format": output.fmt, "voice": default_voice,
                   "max_contexts": gw.settings.tts_ws_max_contexts})
    limiter = RateLimiter(gw.settings.max_messages_per_s)
    flooding_since: float | None = None
    idle = gw.settings.idle_timeout_s
    try:
        while not ws.closed and conn.closing is None:
            try:
                msg = await ws.receive(timeout=idle)
            except asyncio.TimeoutError:
                conn.error("idle_timeout", f"no message for {idle:g} s; closing")
                break
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                break
            if msg.type == WSMsgType.ERROR:
                break
            if not limiter.allow():
                now = time.monotonic()
                if flooding_since is None:
                    flooding_since = now
                    conn.error("rate_limited", f"more than {gw.settings.max_messages_per_s:g} messages a second; messages are being dropped")
                elif now - flooding_since > MAX_FLOOD_S:
                    conn.closing = "rate_limited"
                    break
                continue
            flooding_since = None
            if msg.type == WSMsgType.BINARY:
                conn.error("binary_frame", "messages are JSON text frames; a binary frame was ignored")
                continue
            if msg.type != WSMsgType.TEXT:
                continue
            try:
                conn.handle(msg.data)
            except GatewayError as exc:
                conn.error(exc.code, exc.message, exc.id)
            except Exception as exc:  # a bug costs this message, not the connection
                log.exception("tts ws: message failed")
                conn.error("internal", f"internal error: {type(exc).__name__}")
    finally:
        conn.contexts.close()
        # Let what is queued (errors, cancelled) go out before the close, briefly.
        if not ws.closed and not writer.done():
            try:
                await asyncio.wait_for(conn.out.join(), 1.0)
            except asyncio.TimeoutError:
                pass
        writer.cancel()
        if not ws.closed:
            code = 1013 if conn.closing else 1000
            try:
                await asyncio.wait_for(ws.close(code=code, message=(conn.closing or "").encode()), 2.0)
            except (asyncio.TimeoutError, ConnectionError, RuntimeError):
                pass
    return ws


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/tts/ws", handle_tts_ws)
