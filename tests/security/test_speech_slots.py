"""Issue 53, finding 6: speech slots cannot be held for free.

Before, four POST /v1/audio/speech requests whose bodies were never read held all four global slots
for as long as the client liked (the write had no deadline), and four /v1/tts/ws contexts of one word
and a `flush` every few seconds did the same; another key got 503 every time. Now every HTTP speech
write has a deadline (--write-stall-s) and a context with no new text and no audio for
--tts-ws-context-idle-s ends with `context_idle`. bench/bench_speech_slots.py runs them at full size.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import aiohttp

from tests.conftest import in_process_gateway

from sec_helpers import http_json

KEYS = ["a1", "a2", "victim"]


class NeverReads:
    """A POST /v1/audio/speech whose body is never read: its receive buffer is 4 KB, and 300 s of
    pcm (9.6 MB at the tone engine's rate) is more than loopback's buffers take, so the server's
    writes wait (tests/security/test_tts_limits.py's Held, on OpenAI's route)."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = urlsplit(url), key

    async def __aenter__(self) -> "NeverReads":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.url.hostname, self.url.port))
        self.reader, self.writer = await asyncio.open_connection(sock=sock)
        body = json.dumps({"model": "tts-1", "voice": "alloy", "input": "a" * 8000, "response_format": "pcm"}).encode()
        self.writer.write((f"POST /v1/audio/speech HTTP/1.1\r\nHost: {self.url.netloc}\r\nX-API-Key: {self.key}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        status = await asyncio.wait_for(self.reader.readline(), 30)
        assert status.split()[1:2] == [b"200"], status
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.transport.abort()


async def speech_status(url: str, key: str) -> int:
    status, _, _ = await http_json("POST", url + "/v1/audio/speech", headers={"X-API-Key": key},
                                   body={"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "wav"})
    return status


async def until_served(url: str, key: str, within_s: float) -> float:
    """Seconds until `key`'s speech request succeeds (polled: the slots free on the server's clock)."""
    t0 = time.monotonic()
    while await speech_status(url, key) != 200:
        assert time.monotonic() - t0 < within_s, f"still refused after {within_s} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_never_reading_speech_clients_lose_their_slots_within_the_deadline():
    async with in_process_gateway(api_key=KEYS, write_stall_s=1.0) as (app, url):
        async with NeverReads(url, "a1"), NeverReads(url, "a1"), NeverReads(url, "a2"), NeverReads(url, "a2"):
            assert app["gateway"].tts_active == 4
            assert await speech_status(url, "victim") == 503
            # Cut one deadline after their writes stall (observed: about 1.2 s).
            waited = await until_served(url, "victim", within_s=15.0)
        assert waited < 15.0


async def test_a_tts_ws_context_that_only_flushes_gives_up_its_slot():
    async with in_process_gateway(api_key=KEYS, tts_ws_context_idle_s=1.0) as (app, url), \
            aiohttp.ClientSession() as http:
        ws_url = url.replace("http", "ws") + "/v1/tts/ws?key="
        sockets = [await http.ws_connect(ws_url + key) for key in ("a1", "a1", "a2", "a2")]
        for i, ws in enumerate(sockets):
            await ws.send_json({"type": "text", "context_id": f"c{i}", "text": "word"})
            await ws.send_json({"type": "flush", "context_id": f"c{i}"})
            while json.loads((await ws.receive(timeout=10)).data)["type"] != "audio":
                pass  # the context is open and has spoken its word
        assert app["gateway"].tts_active == 4
        assert await speech_status(url, "victim") == 503

        async def flush_and_read(i: int, ws) -> dict:
            while True:
                await ws.send_json({"type": "flush", "context_id": f"c{i}"})
                try:
                    message = json.loads((await ws.receive(timeout=0.3)).data)
                except asyncio.TimeoutError:
                    continue
                if message["type"] == "error":
                    return message

        errors = await asyncio.wait_for(asyncio.gather(*(flush_and_read(i, ws) for i, ws in enumerate(sockets))), 15)
        assert {e["code"] for e in errors} == {"context_idle"}, errors
        await until_served(url, "victim", within_s=5.0)
        for ws in sockets:
            await ws.close()
