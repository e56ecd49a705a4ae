"""Plain HTTP text-to-speech: `POST /v1/tts`, audio streamed back as it is made.

    curl -X POST http://127.0.0.1:8080/v1/tts -H 'Content-Type: application/json' \
         -d '{"text": "Hello there.", "format": "wav"}' --output hello.wav

The response is chunked and its first bytes leave once the first unit of text
is synthesized, not when the whole text is. The same text limits, engine and
speech tags apply as on the data channel; with API keys configured, one is
required here too. See docs/http-tts.md.

`serve_speech` is the one way a request becomes streamed audio: OpenAI's
`POST /v1/audio/speech` (signaling/openai_speech.py) goes through it too, with
its own parsing of the body. The formatters (engine PCM in, response bytes out) are
signaling/audio_formats.py, and serve the TTS WebSocket (signaling/tts_ws.py) as well.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from aiohttp import web

from ..engine.base import SynthesisOptions
from ..engine.stream import StreamChunk
from ..gateway.text_pump import TEXT_SLICE_CHARS
from ..gateway.errors import GatewayError, checked_voice
from ..gateway.late_blame import LateBlame, address_tenant, key_tenant
from ..gateway.speech_request import SpeechStream, open_speech
from .audio_formats import FORMATS, FORMATTERS, EncodedFormatter, Formatter, pause_after, slots_of, threads_of
from .errors import error_response, read_json_object
from .http_guard import RateLimitedLog, client_address
from .sessions_api import check_api_key

log = logging.getLogger(__name__)
_client_log = RateLimitedLog()
T = TypeVar("T")




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
    formatter: Callable[[int], Formatter]  # the engine's rate -> a formatter (made in the pool)
    sse: bool = False  # the audio as server-sent events (OpenAI's stream_format "sse")


def _tts_request(gw, body: dict) -> SpeechRequest:
    text = checked_text(body.get("text"), "text", gw.settings.max_utterance_chars)
    fmt = body.get("format", "wav")
    if fmt not in FORMATS:
        raise GatewayError("invalid_field", f"'format' must be one of {', '.join(FORMATS)}")
    voice = checked_voice(gw.engine, body.get("voice"))
    rate = checked_rate(body.get("rate", 1.0), "rate")
    return SpeechRequest(text, fmt, SynthesisOptions(voice=voice, rate=rate), FORMATTERS[fmt])


async def push_in_slices(stream: SpeechStream, text: str) -> None:
    """Feed the text a slice per turn of the event loop, so a long text never holds it."""
    for start in range(0, len(text), TEXT_SLICE_CHARS):
        stream.push_text(text[start : start + TEXT_SLICE_CHARS])
        await asyncio.sleep(0)


async def _first_chunk(stream: SpeechStream) -> StreamChunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


class _Timeline:
    """When this request's audio was made and sent, on the monotonic clock the
    engine worker shares; logged once per request so an operator (and the
    streaming test) can see that bytes left while synthesis was still running."""

    def __init__(self) -> None:
        self.received_at = time.monotonic()
        self.first_bytes_at: float | None = None
        self.units: dict[int, float] = {}  # unit index -> when its synthesis began

    def chunk(self, chunk: StreamChunk) -> None:
        started = self.units.get(chunk.unit_index)
        if chunk.synth_started_at and (started is None or chunk.synth_started_at < started):
            self.units[chunk.unit_index] = chunk.synth_started_at

    def log(self, fmt: str, chars: int) -> None:
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - self.received_at) * 1000.0, 1)

        last_unit = self.units[max(self.units)] if self.units else None
        fields = {
            "format": fmt,
            "chars": chars,
            "units": len(self.units),
            "first_bytes_ms": ms(self.first_bytes_at),
            "last_unit_synthesis_started_ms": ms(last_unit),
            "done_ms": ms(time.monotonic()),
        }
        log.info(
            "tts request: %d units, first bytes sent at %s ms, last unit's synthesis started at %s ms",
            fields["units"], fields["first_bytes_ms"], fields["last_unit_synthesis_started_ms"],
            extra={"fields": fields},
        )


async def serve_speech(request: web.Request, parse: Callable[..., SpeechRequest], hint: str) -> web.StreamResponse:
    """Key, body, limits, synthesis and streaming for one speech request; `parse`
    turns the body into a SpeechRequest (raising GatewayError for a bad field)."""
    timeline = _Timeline()
    key = check_api_key(request)  # raises a JSON 401
    gw = request.app["gateway"]

    caller = key if key is not None else client_address(request, gw.trusted_proxies)
    tenant = key_tenant(key) if key is not None else address_tenant(caller)
    try:
        body = await read_json_object(request, body_limit(gw.settings), hint)
        job = parse(gw, body)
        # In flight in total and per caller, each taking a session's slot, and the node's load.
        slot = gw.admission.speech_slot(caller, slots_of(job.fmt), tenant)
    except GatewayError as exc:
        return error_response(exc)
    work = _Work(request, gw.admission.blame, tenant, job.fmt)
    try:
        with slot:
            return await _synthesize(request, gw, job, timeline, work)
    finally:
        gw.admission.blame.forget(work)


class _Work:
    """One request's formatting, run on a formatter thread and charged to its caller: when frames
    are late and its encodes are to blame, it can be shed (gateway/late_blame.py)."""

    def __init__(self, request: web.Request, blame: LateBlame, tenant: str, fmt: str) -> None:
        self.request = request
        self.blame = blame
        self.tenant = tenant
        self.fmt = fmt

    async def run(self, threads: ThreadPoolExecutor, fn: Callable[..., T], *args: object) -> T:
        result, spent = await asyncio.get_running_loop().run_in_executor(threads, _timed, fn, *args)
        self.blame.charge(self.tenant, spent, self)  # on the loop's thread: the blame's tables are its alone
        pause = pause_after(self.fmt, spent)
        if pause > 0:
            await asyncio.sleep(pause)  # a compressed encode's pace (signaling/audio_formats.py)
        return result

    def shed(self, why: str) -> None:
        _client_log(log.warning, f"tts: a request was cut: {why}")
        if self.request.transport is not None:
            self.request.transport.abort()


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


def _timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """`fn(*args)` and the CPU time it took this thread."""
    started = time.thread_time()
    result = fn(*args)
    return result, time.thread_time() - started


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _synthesize(request: web.Request, gw, job: SpeechRequest, timeline: _Timeline, work: _Work) -> web.StreamResponse:
    try:
        stream = open_speech(gw.engine, job.options)
    except GatewayError as exc:
        return error_response(exc)
    # Audio is capped per request: text that expands into hours of audio (breaks,
    # spelled-out symbols) costs the server as much CPU as it says.
    sent_samples = 0

    threads = threads_of(job.fmt)
    formatter: Formatter | None = None
    response: web.StreamResponse | None = None
    try:
        try:
            await push_in_slices(stream, job.text)
            stream.end_input()
            # Headers wait for the first chunk: an engine error can still be a JSON error,
            # and the WAV header needs the engine's rate.
            first = await _first_chunk(stream)
        except GatewayError as exc:
            return error_response(exc)
        rate = first.sample_rate if first is not None else int(gw.engine.info.get("sample_rate") or 16000)
        formatter = await work.run(threads, job.formatter, rate)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream" if job.sse else formatter.content_type,
                "X-Sample-Rate": str(formatter.sample_rate),
                "X-Audio-Format": job.fmt,
                "X-Max-Audio-S": f"{gw.settings.tts_max_audio_s:g}",
                "Cache-Control": "no-store",
            }
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        body = _Body(request, response, job.sse, gw.settings.write_stall_s)
        head = await work.run(threads, formatter.start)
        max_samples = int(gw.settings.tts_max_audio_s * rate)
        if first is not None:
            timeline.chunk(first)
            pcm = first.pcm[:max_samples]
            sent_samples += len(pcm)
            head += await work.run(threads, formatter.feed, pcm)
        await body.write(head)
        timeline.first_bytes_at = time.monotonic()
        try:
            async for chunk in stream:
                timeline.chunk(chunk)
                if sent_samples >= max_samples:
                    log.info("tts: request reached --tts-max-audio-s (%g s); the rest is not synthesized", gw.settings.tts_max_audio_s)
                    break
                pcm = chunk.pcm[: max_samples - sent_samples]
                sent_samples += len(pcm)
                await body.write(await work.run(threads, formatter.feed, pcm))
        except GatewayError as exc:  # the engine failed (gateway/speech_request.py)
            # Headers are gone: cut the body short so the client sees it incomplete.
            log.warning("tts: engine failed mid-response: %s", exc)
            if request.transport is not None:
                request.transport.close()
            return response
        await body.write(await work.run(threads, formatter.finish))
        await body.end(sent_samples / rate)
        timeline.log(job.fmt, len(job.text))
        return response
    except ConnectionResetError as exc:
        # The client went away mid-body, or read nothing for --write-stall-s: nothing
        # to answer, and nothing for aiohttp to log as a server error. The finally cancels
        # synthesis, and the caller's `with` frees the slot.
        if response is None:
            raise
        if isinstance(exc, WriteStalled):
            _client_log(log.info, f"tts: {exc}; disconnected it")
        else:
            log.info("tts: the client went away before the end of the audio")
        return response
    finally:
        stream.cancel()
        if isinstance(formatter, EncodedFormatter):
            formatter.close()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/tts", handle_tts)
