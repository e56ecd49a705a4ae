"""The bi-streaming TTS WebSocket: `GET /v1/tts/ws`.

Text goes in as it arrives (an LLM's tokens), audio comes out as it is made,
with each word's start and end on the audio's own clock. One connection
carries several contexts, each its own utterance, so an agent can start its
next reply while the last one is being cancelled. The messages are in
docs/tts-websocket.md.

Everything a request to `POST /v1/tts` meets applies here, and comes from
signaling/tts_http.py: the API key, the text checks and limits, admission
(each open context takes one of the request slots while it lives), the audio
cap per context; the formatters and their threads are signaling/audio_formats.py's. What is new is bounded
here: contexts per connection (--tts-ws-max-contexts), text per context
(--max-utterance-chars), bytes and messages a second per connection
(--max-message-bytes, --max-messages-per-s), what waits for the socket (a
short queue; a reader that takes nothing for --write-stall-s loses the
connection, a slow one paces synthesis), and how long a context may hold its slot
doing nothing (--tts-ws-context-idle-s: no new text and no audio made; a `flush` or
blank text is not new text, so flushes alone cannot keep a slot).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time
from collections import OrderedDict

from aiohttp import WSMsgType, web

from ..engine.base import SynthesisOptions
from ..gateway.admission import SpeechSlot
from ..gateway.errors import GatewayError, checked_voice
from ..gateway.speech_request import SpeechStream, open_speech
from ..gateway.protocol import RateLimiter, decode_json
from ..gateway.text_pump import TEXT_SLICE_CHARS
from .errors import error_response
from .http_guard import RateLimitedLog, client_address
from .sessions_api import check_api_key
from .audio_formats import FORMAT_THREADS, OpusPackets, Pcm16Pieces

log = logging.getLogger(__name__)

FORMATS = ("pcm16", "opus")
# A context's id: what ElevenLabs-style clients send (UUIDs, short names).
CONTEXT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
CLIENT_TYPES = ("text", "flush", "end", "cancel")
# Audio messages waiting for the socket; past it, contexts wait (synthesis is paced by the reader).
OUT_QUEUE = 32
# Control messages (errors, acknowledgements) waiting for the socket; past it the client is disconnected.
MAX_CONTROL = 256
# Ids of ended contexts remembered, so late text for one is refused rather than opening it anew.
MAX_CLOSED_IDS = 256
# How a remembered context ended. After an error about it (it failed, or was refused as it opened),
# its error was its last word: what the client still sends for it is ignored, not answered with
# more errors (a client streaming tokens sends them before it reads the error). One refused for
# want of room may be opened again by a later `text` (a retry); its flush and end are ignored.
ENDED, FAILED, REFUSED = "ended", "failed", "refused"
# A connection over its message rate for this long in a row is closed.
MAX_FLOOD_S = 5.0
OPUS_RATE = 48000  # what a receiver decodes the packets at (audio_formats.OpusPackets)
_client_log = RateLimitedLog()


def _clean(value: object, limit: int = 64) -> str:
    text = str(value)[:limit]
    return "".join(ch if ch.isprintable() else "?" for ch in text)


class Context:
    def __init__(self, cid: str, stream: SpeechStream) -> None:
        self.id = cid
        self.stream = stream
        self.chars = 0
        self.seq = 0
        self.out_ms = 0.0  # audio sent so far, on this context's clock
        self.engine_s = 0.0  # engine audio received so far (words are placed on it)
        self.samples = 0  # engine samples taken (the audio cap)
        self.cancelled = False
        self.failed = False  # ended by an error about it
        self.ended = False  # `end` received
        self.task: asyncio.Task | None = None
        self.slot: SpeechSlot | None = None  # its admission, released once when it ends
        # Last new text or audio made (monotonic): a context quiet for --tts-ws-context-idle-s ends.
        self.active_at = time.monotonic()


class Connection:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse, caller: str, fmt: str, rate: int | None,
                 voice: str | None, words: bool) -> None:
        self.request = request
        self.ws = ws
        self.gw = request.app["gateway"]
        self.settings = self.gw.settings
        self.caller = caller
        self.fmt = fmt
        self.rate = rate  # pcm16's output rate; None: each engine rate as it comes (the default voice's)
        self.voice = voice
        self.words = words
        self.contexts: dict[str, Context] = {}
        self.closed_ids: OrderedDict[str, str] = OrderedDict()  # id -> ENDED, FAILED or REFUSED
        # Everything for the socket, in order; audio bounded by the slots, control by MAX_CONTROL.
        self.out: asyncio.Queue = asyncio.Queue()
        self.audio_slots = asyncio.Semaphore(OUT_QUEUE)
        self.control_pending = 0
        self.closing: str | None = None

    @property
    def sample_rate(self) -> int:
        if self.fmt == "opus":
            return OPUS_RATE
        return self.rate or int(self.gw.engine.info.get("sample_rate") or 16000)

    # Out
    async def send(self, message: dict, ctx: Context) -> None:
        """A context's audio or done: waits while OUT_QUEUE of them wait for the socket."""
        await self.audio_slots.acquire()
        self.out.put_nowait((ctx, message))

    def send_now(self, message: dict) -> None:
        """A control message (ready, errors, acknowledgements): never waits behind the
        audio slots; as many as the client's own messages, which are rate limited, and a
        client that leaves MAX_CONTROL of them unread is disconnected."""
        if self.control_pending >= MAX_CONTROL:
            self.disconnect("slow_reader")
            return
        self.control_pending += 1
        self.out.put_nowait((None, message))

    def error(self, code: str, message: str, context_id: str | None = None) -> None:
        payload = {"type": "error", "code": code, "message": message}
        if context_id is not None:
            payload["context_id"] = context_id
        self.send_now(payload)

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
            ctx, message = await self.out.get()
            try:
                if ctx is None:
                    self.control_pending -= 1
                else:
                    self.audio_slots.release()
                    if ctx.cancelled:
                        continue
                stall = self.settings.write_stall_s
                try:
                    await asyncio.wait_for(self.ws.send_str(json.dumps(message, separators=(",", ":"))), stall)
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
        ctx = self.contexts.get(cid)
        gone = self.closed_ids.get(cid) if ctx is None else None
        if kind == "cancel":
            if ctx is not None:
                self.cancel(ctx)
            elif cid in self.closed_ids:
                self.send_now({"type": "cancelled", "context_id": cid})  # it ended already: nothing more comes
            else:
                raise GatewayError("unknown_context", f"no context {cid!r} on this connection", id=cid)
            return
        if kind == "text":
            text = msg.get("text")
            if not isinstance(text, str):
                raise GatewayError("invalid_field", "'text' needs a string 'text'", id=cid)
            if len(text) > self.settings.max_text_chars:
                raise GatewayError("text_too_long", f"text has {len(text)} characters; the limit per message is {self.settings.max_text_chars}", id=cid)
            if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
                raise GatewayError("invalid_utf8", "text holds unpaired surrogates", id=cid)
            if gone == FAILED:
                return  # its error was its last word
            if ctx is None:
                ctx = self.open(cid, msg.get("voice"))
            elif msg.get("voice") is not None:
                raise GatewayError("invalid_field", "'voice' applies to a context's first text only", id=cid)
            if ctx.ended:
                raise GatewayError("context_ended", f"context {cid!r} has had its 'end'; open a new context", id=cid)
            ctx.chars += len(text)
            if text.strip():
                ctx.active_at = time.monotonic()
            if ctx.chars > self.settings.max_utterance_chars:
                self.fail(ctx, "text_too_long", f"the context's text is over {self.settings.max_utterance_chars} characters; it was stopped")
                return
            for start in range(0, len(text), TEXT_SLICE_CHARS):
                ctx.stream.push_text(text[start : start + TEXT_SLICE_CHARS])
            return
        if ctx is None:
            if gone in (FAILED, REFUSED):
                return  # its error was its last word
            if gone == ENDED:
                raise GatewayError("context_closed", f"context {cid!r} has ended", id=cid)
            raise GatewayError("unknown_context", f"no context {cid!r} on this connection; a 'text' opens one", id=cid)
        if ctx.ended:
            return  # a repeated end or a flush after it: nothing left to do
        if kind == "flush":
            ctx.stream.flush()
        else:  # end
            ctx.ended = True
            ctx.stream.end_input()

    def open(self, cid: str, voice: object) -> Context:
        if self.closed_ids.get(cid) == ENDED:
            raise GatewayError("context_closed", f"context {cid!r} has ended; open a new context with another id", id=cid)
        self.closed_ids.pop(cid, None)  # refused before: this is a retry
        try:
            return self._open(cid, voice)
        except GatewayError as exc:
            exc.id = cid  # every error about a context names it
            # No room now (429, 503): a later `text` may try again. A mistake in the message
            # that opened it (an unknown voice): the context is over.
            self._remember(cid, REFUSED if exc.status in (429, 503) else FAILED)
            raise

    def _open(self, cid: str, voice: object) -> Context:
        limit = self.settings.tts_ws_max_contexts
        if len(self.contexts) >= limit:
            raise GatewayError("too_many_contexts", f"this connection has {limit} open contexts; end or cancel one first", 429)
        if voice is not None and not isinstance(voice, str):
            raise GatewayError("invalid_field", "'voice' must be a string", id=cid)
        voice = checked_voice(self.gw.engine, voice) if voice is not None else self.voice
        slot = self.gw.admission.speech_slot(self.caller)
        try:
            stream = open_speech(self.gw.engine, SynthesisOptions(voice=voice))
        except GatewayError:
            slot.release()
            raise
        ctx = Context(cid, stream)
        ctx.slot = slot
        self.contexts[cid] = ctx
        ctx.task = asyncio.ensure_future(self.speak(ctx))
        self._watch_idle(ctx)
        return ctx

    def _remember(self, cid: str, how: str) -> None:
        self.closed_ids[cid] = how
        self.closed_ids.move_to_end(cid)
        while len(self.closed_ids) > MAX_CLOSED_IDS:
            self.closed_ids.popitem(last=False)

    def _watch_idle(self, ctx: Context) -> None:
        """End `ctx` once it has had no new text and made no audio for --tts-ws-context-idle-s:
        an open context holds a speech slot, and one word with a `flush` every few seconds
        held all of them at no cost (issue 53, finding 6)."""
        idle = self.settings.tts_ws_context_idle_s

        def check() -> None:
            if self.contexts.get(ctx.id) is not ctx:
                return
            quiet = time.monotonic() - ctx.active_at
            if quiet >= idle:
                self.fail(ctx, "context_idle", f"no new text and no audio for {idle:g} s; the context ended and "
                          "gave up its slot (open a new one to speak again)")
            else:
                asyncio.get_running_loop().call_later(idle - quiet, check)

        asyncio.get_running_loop().call_later(idle, check)

    def forget(self, ctx: Context) -> None:
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
            self._remember(ctx.id, FAILED if ctx.failed else ENDED)
        if ctx.slot is not None:
            ctx.slot.release()
        ctx.stream.cancel()

    def cancel(self, ctx: Context) -> None:
        # Marked first: the writer drops what of it is queued, and the task stops at its next await.
        ctx.cancelled = True
        self.forget(ctx)
        if ctx.task is not None:
            ctx.task.cancel()
        self.send_now({"type": "cancelled", "context_id": ctx.id})

    def fail(self, ctx: Context, code: str, message: str) -> None:
        ctx.cancelled = True
        ctx.failed = True
        self.forget(ctx)
        if ctx.task is not None:
            ctx.task.cancel()
        self.error(code, message, ctx.id)

    async def speak(self, ctx: Context) -> None:
        loop = asyncio.get_running_loop()
        pieces: OpusPackets | Pcm16Pieces | None = None
        words: list[dict] = []  # words not yet sent with audio
        try:
            async for chunk in ctx.stream:
                if pieces is None:
                    if self.fmt == "opus":
                        pieces = await loop.run_in_executor(FORMAT_THREADS, OpusPackets, chunk.sample_rate)
                    else:
                        pieces = await loop.run_in_executor(FORMAT_THREADS, Pcm16Pieces, chunk.sample_rate, self.sample_rate)
                    max_samples = int(self.settings.tts_max_audio_s * chunk.sample_rate)
                if ctx.samples >= max_samples:
                    log.info("tts ws: a context reached --tts-max-audio-s (%g s); the rest is not synthesized", self.settings.tts_max_audio_s)
                    break
                pcm = chunk.pcm[: max_samples - ctx.samples]
                ctx.samples += len(pcm)
                if self.words:
                    for w in chunk.words:
                        if w.start * chunk.sample_rate >= len(pcm):
                            break
                        words.append({"word": w.text, "start_ms": round((ctx.engine_s + w.start) * 1000.0, 1),
                                      "end_ms": round((ctx.engine_s + min(w.end, len(pcm) / chunk.sample_rate)) * 1000.0, 1)})
                ctx.engine_s += len(pcm) / chunk.sample_rate
                words = await self.send_audio(ctx, await loop.run_in_executor(FORMAT_THREADS, pieces.feed, pcm), words)
                ctx.active_at = time.monotonic()
            if pieces is not None:
                words = await self.send_audio(ctx, await loop.run_in_executor(FORMAT_THREADS, pieces.finish), words)
            if words:
                await self.send_audio(ctx, [b""], words)
            await self.send({"type": "done", "context_id": ctx.id, "duration_ms": round(ctx.out_ms, 1)}, ctx)
        except asyncio.CancelledError:
            return
        except GatewayError as exc:  # the engine failed (gateway/speech_request.py)
            log.warning("tts ws: engine failed mid-context: %s", exc.message)
            ctx.failed = True
            self.error(exc.code, exc.message, ctx.id)
        except Exception as exc:  # a bug costs this context, not the connection
            log.exception("tts ws: context failed")
            ctx.failed = True
            self.error("internal", f"internal error: {type(exc).__name__}", ctx.id)
        finally:
            self.forget(ctx)

    async def send_audio(self, ctx: Context, pieces: list[bytes], words: list[dict]) -> list[dict]:
        """One `audio` message per piece; the words so far go with the first. Returns the words left unsent."""
        bytes_per_ms = 2 * self.sample_rate / 1000.0
        for data in pieces:
            duration = 20.0 if self.fmt == "opus" and data else len(data) / bytes_per_ms
            message = {"type": "audio", "context_id": ctx.id, "seq": ctx.seq,
                       "audio": base64.b64encode(data).decode("ascii"),
                       "start_ms": round(ctx.out_ms, 1), "duration_ms": round(duration, 1), "words": words}
            words = []
            ctx.seq += 1
            ctx.out_ms += duration
            await self.send(message, ctx)
        return words

    async def close(self) -> None:
        for ctx in list(self.contexts.values()):
            ctx.cancelled = True
            self.forget(ctx)
            if ctx.task is not None:
                ctx.task.cancel()


def _query(request: web.Request, gw) -> tuple[str, int | None, str | None, bool]:
    q = request.query
    fmt = q.get("format", "pcm16")
    if fmt not in FORMATS:
        raise GatewayError("invalid_field", f"'format' must be one of {', '.join(FORMATS)}")
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
    return fmt, rate, voice, words == "true"


async def handle_tts_ws(request: web.Request) -> web.StreamResponse:
    gw = request.app["gateway"]
    try:
        key = check_api_key(request, query=True)  # raises a JSON 401
        fmt, rate, voice, words = _query(request, gw)
        if not gw.accepting:
            raise GatewayError("draining", "the server is shutting down; retry on another instance", 503)
    except GatewayError as exc:
        return error_response(exc)
    caller = key if key is not None else client_address(request, gw.trusted_proxies)
    limit = gw.settings.max_message_bytes
    # Up to twice the limit arrives and earns a JSON error; past that aiohttp closes with 1009.
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=2 * limit, decode_text=False, compress=False)
    await ws.prepare(request)
    conn = Connection(request, ws, caller, fmt, rate, voice, words)
    writer = asyncio.ensure_future(conn.writer())
    default_voice = voice or (gw.engine.info.get("voices") or [None])[0]
    conn.send_now({"type": "ready", "sample_rate": conn.sample_rate, "format": fmt, "voice": default_voice,
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
        await conn.close()
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
