"""Audio files on loopback for a relay application's `play` (tests/relay/test_relay_play.py): an aiohttp
server with a WAV and an MP3 made here (numpy, PyAV's LAME), a file bigger than the size cap, an
endless stream, garbage with a WAV header, and an image; it counts the requests it gets."""

from __future__ import annotations

import asyncio
import io
import wave

import av
import numpy as np
from aiohttp import web

TONE_HZ = 200.0  # below every symbol of the tone engine (350 Hz and up): the play is told from speech by it


def tone(seconds: float, rate: int = 16000, hz: float = TONE_HZ) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * hz * t) * 12000).astype(np.int16)


def wav_file(pcm: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def mp3_file(pcm: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=rate)
        stream.layout = "mono"  # type: ignore[attr-defined]
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:  # type: ignore[attr-defined]
            container.mux(packet)
    return out.getvalue()


class AudioServer:
    def __init__(self, big_bytes: int = 1 << 20) -> None:
        self.files = {
            "/half.wav": wav_file(tone(0.5)),
            "/tone.mp3": mp3_file(tone(0.6)),
            "/big.wav": wav_file(tone(big_bytes / 32000 + 1)),
            "/garbage.wav": b"RIFF\x00\x00\x00\x00WAVEfmt " + np.random.default_rng(1).bytes(20000),
            "/image.png": b"\x89PNG\r\n\x1a\n" + bytes(2000),
        }
        self.requests: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/endless.wav", self.endless)
        app.router.add_get("/{name}", self.file)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def file(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        body = self.files.get(request.path)
        if body is None:
            raise web.HTTPNotFound()
        return web.Response(body=body, content_type="audio/wav" if request.path.endswith(".wav") else "audio/mpeg")

    async def endless(self, request: web.Request) -> web.StreamResponse:
        """A WAV with no end and no Content-Length: a live stream, or an application's mistake."""
        self.requests.append(request.path)
        resp = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        await resp.prepare(request)
        await resp.write(wav_file(tone(0.1))[:44])
        piece = tone(0.5).tobytes()
        try:
            while True:
                await resp.write(piece)
                await asyncio.sleep(0)
        except ConnectionError:  # the gateway hung up on it, as it should
            return resp
