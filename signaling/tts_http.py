"""Plain HTTP text-to-speech: `POST /v1/tts`, audio streamed back as it is made.

    curl -X POST http://127.0.0.1:8080/v1/tts -H 'Content-Type: application/json' \
         -d '{"text": "Hello there.", "format": "wav"}' --output hello.wav

The response is chunked and its first bytes leave once the first unit of text
is synthesized, not when the whole text is. The same text limits, engine and
speech tags apply as on the data channel; with API keys configured, one is
required here too. See docs/http-tts.md.

`serve_speech` is the one way a request becomes streamed audio: OpenAI's
`POST /v1/audio/speech` (signaling/openai_speech.py) goes through it too, with
its own parsing of the body. This module parses, authenticates and writes the response;
the request's utterance (its slot, stream, audio cap and cancel) is gateway/peerless/speech_contexts.py's
`PeerlessUtterance`, as each TTS WebSocket context's is, and its audio's format, threads, price
and pace are gateway/peerless/http_audio.py's.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from ..engine.base import SynthesisOptions
from ..gateway.errors import GatewayError, checked_voice
from ..gateway.load.late_blame import address_tenant, key_tenant
from ..gateway.peerless.peerless_speech import HttpSpeech, format_names, open_http_speech
from .errors import error_response, read_json_object
from .http_guard import RateLimitedLog, client_address
from .sessions_api import check_api_key

log = logging.getLogger(__name__)
_client_log = RateLimitedLog()
FORMATS = format_names("tts")


# The request
def body_limit(settings) -> int:
    # A whole utterance fits, at up to 4 UTF-8 bytes a character, plus the JSON around it.
    return max(settings.max_message_bytes, settings.max_utterance_chars * 4 + 4096)


def checked_text(text: object, name: str, limit: int) -> str:
    """A text to speak: a non-empty string of at most `limit` characters, with no unpaired surrogates."""
    if not isinstance(text, str) or not text.strip():
        raise GatewayError("invalid_field", f"'{name}' must be a non-empty string")
    if len(text) > limit:
        raise GatewayError("text_too_long", f"{name} has {len(text)} characters; the limit is {limit}")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise GatewayError("invalid_utf8", f"{name} holds unpaired surrogates")
    return text


def checked_rate(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.25 <= value <= 4.0:
        raise GatewayError("invalid_field", f"'{name}' must be a number from 0.25 to 4.0")
    return float(value)


@dataclass
class SpeechRequest:
    """What one HTTP request asks to hear, however its body spelled it."""

    text: str
    fmt: str  # the format's name, for X-Audio-Format and the log
    options: SynthesisOptions
    family: str = "tts"  # whose formats `fmt` is one of (gateway/peerless/peerless_speech.format_names)
    sse: bool = False  # the audio as server-sent events (OpenAI's stream_format "sse")


def _tts_request(gw, body: dict) -> SpeechRequest:
    text = checked_text(body.get("text"), "text", gw.settings.max_utterance_chars)
    fmt = body.get("format", "wav")
    if fmt not in FORMATS:
        raise GatewayError("invalid_field", f"'format' must be one of {', '.join(FORMATS)}")
    voice = checked_voice(gw.engine, body.get("voice"))
    rate = checked_rate(body.get("rate", 1.0), "rate")
    return SpeechRequest(text, fmt, SynthesisOptions(voice=voice, rate=rate))


async def serve_speech(request: web.Request, parse: Callable[..., SpeechRequest], hint: str) -> web.StreamResponse:
    """Key, body, limits, synthesis and streaming for one speech request; `parse`
    turns the body into a SpeechRequest (raising GatewayError for a bad field)."""
    received_at = time.monotonic()
    key = check_api_key(request)  # raises a JSON 401
    gw = request.app["gateway"]

    caller = key if key is not None else client_address(request, gw.trusted_proxies)
    tenant = key_tenant(key) if key is not None else address_tenant(caller)
    try:
        body = await read_json_object(request, body_limit(gw.settings), hint)
        job = parse(gw, body)
        # In flight in total and per caller, each taking a session's slot (more for a compressed
        # format), and the node's load.
        speech = open_http_speech(gw.engine, gw.admission, caller, tenant, job.options, gw.settings.tts_max_audio_s,
                                  job.family, job.fmt, lambda why: _shed(request, why))
    except GatewayError as exc:
        return error_response(exc)
    speech.utterance.timeline.received_at = received_at  # its log counts from the request's arrival
    try:
        return await _synthesize(request, gw, job, speech)
    finally:
        speech.close()  # synthesis stops, the slot is free


def _shed(request: web.Request, why: str) -> None:
    """A request's encodes were blamed for late frames (gateway/load/late_blame.py): it is cut."""
    _client_log(log.warning, f"tts: a request was cut: {why}")
    if request.transport is not None:
        request.transport.abort()


async def handle_tts(request: web.Request) -> web.StreamResponse:
    return await serve_speech(request, _tts_request, 'send {"text": "...", "format": "wav"}')


class WriteStalled(ConnectionResetError):
    """The client took none of the body for --write-stall-s: it was disconnected."""


class _Body:
    """The response body: the formatter's bytes as they are, or each piece as a
    server-sent event carrying it in base64 (OpenAI's `speech.audio.delta`).

    Every write has a deadline, --write-stall-s, as the TTS WebSocket's sends
    do: a client that reads nothing would otherwise hold its speech slot for as long
    as it liked (four of them held every slot; issue 53, finding 6)."""

    def __init__(self, request: web.Request, response: web.StreamResponse, sse: bool, stall_s: float) -> None:
        self.request = request
        self.response = response
        self.sse = sse
        self.stall_s = stall_s

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self.sse:
            data = _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        await self._within_deadline(self.response.write(data))

    async def _within_deadline(self, write) -> None:
        try:
            await asyncio.wait_for(write, self.stall_s)
        except asyncio.TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            raise WriteStalled(f"the client read nothing for {self.stall_s:g} s") from None

    async def end(self, audio_s: float) -> None:
        if self.sse:
            # No tokenizer runs here, so the usage OpenAI's event carries is zero;
            # audio_ms says what was sent.
            usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
            await self._within_deadline(self.response.write(
                _event({"type": "speech.audio.done", "usage": usage, "audio_ms": round(audio_s * 1000)})))
        await self._within_deadline(self.response.write_eof())


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _synthesize(request: web.Request, gw, job: SpeechRequest, speech: HttpSpeech) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    try:
        try:
            # Headers wait for the first chunk: an engine error can still be a JSON error,
            # and the WAV header needs the engine's rate.
            await speech.begin(job.text, int(gw.engine.info.get("sample_rate") or 16000))
        except GatewayError as exc:
            return error_response(exc)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream" if job.sse else speech.content_type,
                "X-Sample-Rate": str(speech.sample_rate),
                "X-Audio-Format": job.fmt,
                "X-Max-Audio-S": f"{gw.settings.tts_max_audio_s:g}",
                "Cache-Control": "no-store",
            }
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        body = _Body(request, response, job.sse, gw.settings.write_stall_s)
        await body.write(await speech.head())
        speech.utterance.timeline.first_bytes_at = time.monotonic()
        try:
            async for data in speech.pieces():
                await body.write(data)
        except GatewayError as exc:  # the engine failed (gateway/peerless/speech_request.py)
            # Headers are gone: cut the body short so the client sees it incomplete.
            log.warning("tts: engine failed mid-response: %s", exc)
            if request.transport is not None:
                request.transport.close()
            return response
        await body.write(await speech.finish())
        await body.end(speech.utterance.audio_s)
        speech.utterance.timeline.log(job.fmt, len(job.text))
        return response
    except ConnectionResetError as exc:
        # The client went away mid-body, or read nothing for --write-stall-s: nothing
        # to answer, and nothing for aiohttp to log as a server error. The caller's
        # finally closes the speech: synthesis stops and its slot is free.
        if response is None:
            raise
        if isinstance(exc, WriteStalled):
            _client_log(log.info, f"tts: {exc}; disconnected it")
        else:
            log.info("tts: the client went away before the end of the audio")
        return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/tts", handle_tts)
