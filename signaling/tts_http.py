"""Plain HTTP text-to-speech: `POST /v1/tts`, audio streamed back as it is made.

    curl -X POST http://127.0.0.1:8080/v1/tts -H 'Content-Type: application/json' \
         -d '{"text": "Hello there.", "format": "wav"}' --output hello.wav

The response is chunked and its first bytes leave once the first unit of text
is synthesized, not when the whole text is. The same text limits, engine and
speech tags apply as on the data channel; with API keys configured, one is
required here too. See docs/http-tts.md.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
from aiohttp import web

from ..engine.base import SynthesisOptions
from ..engine.errors import EngineCrashed, EngineStreamError, EngineUnavailable, public_engine_error
from ..engine.stream import StreamChunk, TTSStream
from ..gateway import priority
from ..gateway.encoder import ulaw_encode
from ..gateway.resample import StreamResampler
from ..gateway.text_pump import TEXT_SLICE_CHARS
from ..gateway.errors import GatewayError, checked_voice
from .errors import error_response, read_json_object
from .sessions_api import check_api_key

log = logging.getLogger(__name__)

FORMATS = ("wav", "pcm", "mulaw", "opus")
UNKNOWN_SIZE = 0xFFFFFFFF

# Resampling and Opus run here, never on the event loop; one request's calls
# are awaited in order, so each formatter is only ever used by one thread at a time.
# The event loop's priority (--media-priority): these threads hold the GIL it waits for.
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tts-http", initializer=priority.enter_media_thread)


# Output formats: engine PCM in, response bytes out.
class Formatter:
    content_type = "application/octet-stream"

    def __init__(self, engine_rate: int) -> None:
        self.engine_rate = engine_rate

    @property
    def sample_rate(self) -> int:
        return self.engine_rate

    def start(self) -> bytes:
        return b""

    def feed(self, pcm: np.ndarray) -> bytes:
        return np.asarray(pcm, dtype="<i2").tobytes()

    def finish(self) -> bytes:
        return b""


class WavFormatter(Formatter):
    content_type = "audio/wav"

    def start(self) -> bytes:
        # RIFF and data sizes unknown while streaming: 0xFFFFFFFF, which players
        # read as "until the end of the stream".
        rate = self.engine_rate
        fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
        return b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", UNKNOWN_SIZE)


class PcmFormatter(Formatter):
    @property
    def content_type(self) -> str:  # type: ignore[override]
        return f"audio/L16; rate={self.engine_rate}; channels=1"


class MulawFormatter(Formatter):
    content_type = "audio/basic"

    def __init__(self, engine_rate: int) -> None:
        super().__init__(engine_rate)
        self.resampler = StreamResampler(engine_rate, 8000)

    @property
    def sample_rate(self) -> int:
        return 8000

    def feed(self, pcm: np.ndarray) -> bytes:
        return ulaw_encode(self.resampler.process(pcm))

    def finish(self) -> bytes:
        return ulaw_encode(self.resampler.process(np.zeros(0, dtype=np.int16), last=True))


class _Sink:
    """Where the Ogg muxer writes; taken out after every call."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> int:
        self.data += bytes(data)
        return len(data)

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class OpusFormatter(Formatter):
    content_type = "audio/ogg; codecs=opus"
    FRAME = 960  # 20 ms at 48 kHz

    def __init__(self, engine_rate: int) -> None:
        super().__init__(engine_rate)
        self.resampler = StreamResampler(engine_rate, 48000)
        self.sink = _Sink()
        # Short Ogg pages, so audio leaves as it is encoded rather than once a second.
        self.container = av.open(self.sink, "w", format="ogg", options={"page_duration": "100000"})
        self.stream = self.container.add_stream("libopus", rate=48000)
        self.stream.layout = "mono"
        self.pending = np.zeros(0, dtype=np.int16)
        self.pts = 0

    @property
    def sample_rate(self) -> int:
        return 48000

    def _encode(self, pcm: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 48000
        frame.pts = self.pts
        self.pts += len(pcm)
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def feed(self, pcm: np.ndarray) -> bytes:
        samples = np.concatenate([self.pending, self.resampler.process(pcm)])
        whole = len(samples) // self.FRAME * self.FRAME
        for i in range(0, whole, self.FRAME):
            self._encode(samples[i : i + self.FRAME])
        self.pending = samples[whole:]
        return self.sink.take()

    def finish(self) -> bytes:
        rest = np.concatenate([self.pending, self.resampler.process(np.zeros(0, dtype=np.int16), last=True)])
        if len(rest):
            padded = np.zeros(-(-len(rest) // self.FRAME) * self.FRAME, dtype=np.int16)
            padded[: len(rest)] = rest
            for i in range(0, len(padded), self.FRAME):
                self._encode(padded[i : i + self.FRAME])
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()
        return self.sink.take()

    def close(self) -> None:
        try:
            self.container.close()
        except Exception:
            pass


FORMATTERS: dict[str, type[Formatter]] = {
    "wav": WavFormatter,
    "pcm": PcmFormatter,
    "mulaw": MulawFormatter,
    "opus": OpusFormatter,
}


# The request
def _body_limit(settings) -> int:
    # A whole utterance fits, at up to 4 UTF-8 bytes a character, plus the JSON around it.
    return max(settings.max_message_bytes, settings.max_utterance_chars * 4 + 4096)


def _options(request: web.Request, body: dict) -> tuple[str, str, SynthesisOptions]:
    gw = request.app["gateway"]
    settings = gw.settings
    text = body.get("text")
    if not isinstance(text, str) or not text.strip():
        raise GatewayError("invalid_field", "'text' must be a non-empty string")
    limit = settings.max_utterance_chars
    if len(text) > limit:
        raise GatewayError("text_too_long", f"text has {len(text)} characters; the limit is {limit}")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise GatewayError("invalid_utf8", "text holds unpaired surrogates")
    fmt = body.get("format", "wav")
    if fmt not in FORMATS:
        raise GatewayError("invalid_field", f"'format' must be one of {', '.join(FORMATS)}")
    voice = checked_voice(gw.engine, body.get("voice"))
    rate = body.get("rate", 1.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.25 <= rate <= 4.0:
        raise GatewayError("invalid_field", "'rate' must be a number from 0.25 to 4.0")
    return text, fmt, SynthesisOptions(voice=voice, rate=float(rate))


async def push_in_slices(stream: TTSStream, text: str) -> None:
    """Feed the text a slice per turn of the event loop, so a long text never holds it."""
    for start in range(0, len(text), TEXT_SLICE_CHARS):
        stream.push_text(text[start : start + TEXT_SLICE_CHARS])
        await asyncio.sleep(0)


async def _first_chunk(stream: TTSStream) -> StreamChunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except EngineStreamError as exc:
        raise GatewayError("engine_error", public_engine_error(exc)) from None
    except (EngineCrashed, EngineUnavailable) as exc:
        raise GatewayError("engine_unavailable", str(exc), 503) from None


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


class TtsSlots:
    """POST /v1/tts requests synthesizing now, in total and per caller (API key, or client
    address without keys). Each also takes one of --max-sessions' slots."""

    def __init__(self) -> None:
        self.by_caller: dict[str, int] = {}

    def acquire(self, gw, caller: str) -> None:
        settings = gw.settings
        if gw.tts_active >= settings.tts_max_concurrent or len(gw.sessions) + gw.tts_active >= settings.max_sessions:
            raise GatewayError("at_capacity", "the server is synthesizing its maximum of requests; retry in a moment", 503)
        if self.by_caller.get(caller, 0) >= settings.tts_max_concurrent_per_key:
            raise GatewayError("too_many_requests", f"this caller has {settings.tts_max_concurrent_per_key} requests synthesizing; wait for one to finish", 429)
        self.by_caller[caller] = self.by_caller.get(caller, 0) + 1
        gw.tts_active += 1

    def release(self, gw, caller: str) -> None:
        gw.tts_active -= 1
        left = self.by_caller.get(caller, 1) - 1
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)


TTS_SLOTS = web.AppKey("tts_slots", TtsSlots)


async def handle_tts(request: web.Request) -> web.StreamResponse:
    timeline = _Timeline()
    key = check_api_key(request)  # raises a JSON 401
    gw = request.app["gateway"]
    from .server import client_address  # the server module imports this one

    caller = key if key is not None else client_address(request, gw.trusted_proxies)
    slots = request.app[TTS_SLOTS]
    try:
        body = await read_json_object(request, _body_limit(gw.settings), 'send {"text": "...", "format": "wav"}')
        text, fmt, options = _options(request, body)
        slots.acquire(gw, caller)
    except GatewayError as exc:
        response = error_response(exc)
        if exc.status in (429, 503):
            response.headers["Retry-After"] = "1"
        return response
    try:
        return await _synthesize(request, gw, text, fmt, options, timeline)
    finally:
        slots.release(gw, caller)


async def _synthesize(
    request: web.Request, gw, text: str, fmt: str, options: SynthesisOptions, timeline: _Timeline
) -> web.StreamResponse:
    try:
        stream = gw.engine.stream(options)
    except EngineUnavailable as exc:
        return error_response(GatewayError("engine_unavailable", str(exc), 503))
    # Audio is capped per request: text that expands into hours of audio (breaks,
    # spelled-out symbols) costs the server as much CPU as it says.
    sent_samples = 0

    loop = asyncio.get_running_loop()
    formatter: Formatter | None = None
    response: web.StreamResponse | None = None
    try:
        try:
            await push_in_slices(stream, text)
            stream.end_input()
            # Headers wait for the first chunk: an engine error can still be a JSON error,
            # and the WAV header needs the engine's rate.
            first = await _first_chunk(stream)
        except GatewayError as exc:
            return error_response(exc)
        rate = first.sample_rate if first is not None else int(gw.engine.info.get("sample_rate") or 16000)
        formatter = await loop.run_in_executor(_pool, FORMATTERS[fmt], rate)
        response = web.StreamResponse(
            headers={
                "Content-Type": formatter.content_type,
                "X-Sample-Rate": str(formatter.sample_rate),
                "X-Audio-Format": fmt,
                "X-Max-Audio-S": f"{gw.settings.tts_max_audio_s:g}",
                "Cache-Control": "no-store",
            }
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        head = await loop.run_in_executor(_pool, formatter.start)
        max_samples = int(gw.settings.tts_max_audio_s * rate)
        if first is not None:
            timeline.chunk(first)
            pcm = first.pcm[:max_samples]
            sent_samples += len(pcm)
            head += await loop.run_in_executor(_pool, formatter.feed, pcm)
        await response.write(head)
        timeline.first_bytes_at = time.monotonic()
        try:
            async for chunk in stream:
                timeline.chunk(chunk)
                if sent_samples >= max_samples:
                    log.info("tts: request reached --tts-max-audio-s (%g s); the rest is not synthesized", gw.settings.tts_max_audio_s)
                    break
                pcm = chunk.pcm[: max_samples - sent_samples]
                sent_samples += len(pcm)
                data = await loop.run_in_executor(_pool, formatter.feed, pcm)
                if data:
                    await response.write(data)
        except (EngineStreamError, EngineCrashed, EngineUnavailable) as exc:
            # Headers are gone: cut the body short so the client sees it incomplete.
            log.warning("tts: engine failed mid-response: %s", exc)
            request.transport and request.transport.close()
            return response
        tail = await loop.run_in_executor(_pool, formatter.finish)
        if tail:
            await response.write(tail)
        await response.write_eof()
        timeline.log(fmt, len(text))
        return response
    except ConnectionResetError:
        # The client went away mid-body: nothing to answer, and nothing for
        # aiohttp to log as a server error. The finally cancels synthesis.
        if response is None:
            raise
        log.info("tts: the client went away before the end of the audio")
        return response
    finally:
        stream.cancel()
        if isinstance(formatter, OpusFormatter):
            formatter.close()


def add_routes(app: web.Application) -> None:
    app[TTS_SLOTS] = TtsSlots()
    app.router.add_post("/v1/tts", handle_tts)
