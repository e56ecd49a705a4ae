"""`--stt-url URL`: any OpenAI-compatible `/v1/audio/transcriptions` endpoint (gateway/caller/stt.py's recognizer).

Whisper servers (faster-whisper-server, whisper.cpp's server), vLLM and hosted
APIs all take the same request: a multipart form with the turn as a WAV file
(16 kHz mono PCM16), `model` (--stt-model) and `response_format=json`, and
answer `{"text": "..."}`. URL is the API's base (`http://host:8000/v1`) or the
endpoint itself. Whatever the server answers is hostile input: a status other
than 200, a body over MAX_RESPONSE_BYTES, or anything but a JSON object with a
string `text` is a failed turn (`stt_failed`), never an exception elsewhere.
The time a request may take is the service's (--stt-timeout-s), which cancels it.
Redirects are not followed, so the API key (--stt-api-key) is sent to that URL only.
"""

from __future__ import annotations

import io
import json
import wave

import aiohttp
import numpy as np

from ..errors import SttError

MAX_RESPONSE_BYTES = 256 * 1024  # a transcript of --stt-max-turn-s's longest turn is a few KiB
ENDPOINT = "audio/transcriptions"


def endpoint_url(url: str) -> str:
    """The transcriptions endpoint for a base URL (`.../v1`) or the endpoint itself."""
    url = url.rstrip("/")
    return url if url.endswith("/" + ENDPOINT) else f"{url}/{ENDPOINT}"


def wav_bytes(pcm: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(pcm, dtype="<i2").tobytes())
    return out.getvalue()


class OpenAITranscriptions:
    name = "openai"
    threaded = False

    def __init__(self, url: str, *, model: str, api_key: str | None = None) -> None:
        self.url = endpoint_url(url)
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: aiohttp.ClientSession | None = None

    async def recognize_async(self, pcm: np.ndarray) -> str:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        form = aiohttp.FormData()
        form.add_field("file", wav_bytes(pcm), filename="turn.wav", content_type="audio/wav")
        form.add_field("model", self.model)
        form.add_field("response_format", "json")
        try:
            # No redirects: the API key goes to --stt-url and nowhere else (a 3xx is a failed turn).
            async with self._http.post(self.url, data=form, headers=self._headers, allow_redirects=False) as resp:
                body = await _read_bounded(resp)
                if resp.status != 200:
                    raise SttError("stt_failed", f"the recognizer at --stt-url answered HTTP {resp.status}")
        except aiohttp.ClientError as exc:
            raise SttError("stt_failed", f"the recognizer at --stt-url could not be reached: {type(exc).__name__}") from None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise SttError("stt_failed", "the recognizer at --stt-url answered something that is not JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise SttError("stt_failed", "the recognizer at --stt-url answered JSON without a string 'text'")
        return data["text"]

    def recognize(self, pcm: np.ndarray) -> str:  # pragma: no cover - not threaded
        raise NotImplementedError

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


async def _read_bounded(resp: aiohttp.ClientResponse) -> bytes:
    if (resp.content_length or 0) > MAX_RESPONSE_BYTES:
        raise SttError("stt_failed", f"the recognizer at --stt-url answered more than {MAX_RESPONSE_BYTES} bytes")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        body += chunk
        if len(body) > MAX_RESPONSE_BYTES:
            raise SttError("stt_failed", f"the recognizer at --stt-url answered more than {MAX_RESPONSE_BYTES} bytes")
    return bytes(body)
