"""OpenAI's speech API, `POST /v1/audio/speech`, so OpenAI clients and the apps built on them speak through Voxgate.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="<key, or anything without keys>")
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello there.", response_format="wav") as response:
        for data in response.iter_bytes():
            ...

Only the body differs from `POST /v1/tts`: everything else (the API key, the
concurrency slots, the audio cap, the engine, the errors, streaming as audio is
made) is signaling/tts_http.py's `serve_speech`; OpenAI's formats are gateway/peerless/http_audio.py's
OPENAI_FORMATTERS. See docs/http-tts.md.
"""

from __future__ import annotations

from aiohttp import web

from ..engine.base import SynthesisOptions
from ..gateway.errors import GatewayError, checked_voice
from ..gateway.peerless.peerless_speech import format_names
from . import tts_http

FORMATS = format_names("openai")  # mp3, opus, aac, flac, wav, pcm (24 kHz, as OpenAI's is)
STREAM_FORMATS = ("audio", "sse")
# OpenAI's built-in voices. Apps send one of these whatever server they talk to,
# so each means the server's default voice, unless the server has a voice of that name.
OPENAI_VOICES = frozenset(
    ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse")
)
MAX_MODEL_CHARS = 256


def _voice(gw, value: object) -> str | None:
    if isinstance(value, dict):  # OpenAI's custom voice: {"id": "..."}
        value = value.get("id")
    if isinstance(value, str) and value in OPENAI_VOICES and value not in gw.engine.info.get("voices", []):
        return None
    if value is None:
        raise GatewayError("invalid_field", "'voice' is required: one of the server's voices, or an OpenAI voice name")
    return checked_voice(gw.engine, value)


def _speech_request(gw, body: dict) -> tts_http.SpeechRequest:
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and len(model) <= MAX_MODEL_CHARS):
        raise GatewayError("invalid_field", f"'model' must be a string of at most {MAX_MODEL_CHARS} characters")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError("invalid_field", "'instructions' must be a string")
    text = tts_http.checked_text(body.get("input"), "input", gw.settings.max_utterance_chars)
    fmt = body.get("response_format", "mp3")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise GatewayError("invalid_field", f"'response_format' must be one of {', '.join(FORMATS)}")
    stream_format = body.get("stream_format", "audio")
    if not isinstance(stream_format, str) or stream_format not in STREAM_FORMATS:
        raise GatewayError("invalid_field", f"'stream_format' must be one of {', '.join(STREAM_FORMATS)}")
    voice = _voice(gw, body.get("voice"))
    speed = tts_http.checked_rate(body.get("speed", 1.0), "speed")
    return tts_http.SpeechRequest(
        text, fmt, SynthesisOptions(voice=voice, rate=speed), "openai", sse=stream_format == "sse"
    )


async def handle_speech(request: web.Request) -> web.StreamResponse:
    return await tts_http.serve_speech(
        request, _speech_request, 'send {"model": "tts-1", "input": "...", "voice": "alloy", "response_format": "wav"}'
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", handle_speech)
