"""Finding 9: `POST /v1/tts` is bounded: total break time, audio per request, and concurrency.

Before, 2,000 characters of `<break time="10s"/>a` gave 1,000 s of audio
(32 MB of pcm, or 5 s of server CPU as opus), any number of requests ran at
once, and none of them counted against `--max-sessions`.
"""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import aiohttp

from voxgate.engine.text.tags import Pause, TagState

from sec_helpers import http_json

TONE_RATE = 16000  # the tone engine's sample rate; pcm is 2 bytes a sample
MAX_TOTAL_BREAK_MS = 30000  # engine/text/tags.py: all breaks of one stream together


async def audio_seconds(url: str, body: dict, headers: dict | None = None) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/tts", json={**body, "format": "pcm"}, headers=headers or {}) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.read()
    return len(data) / 2 / TONE_RATE


def test_breaks_of_one_stream_share_one_budget():
    from voxgate.engine.text import tags as tag_module

    assert tag_module.MAX_TOTAL_BREAK_MS == MAX_TOTAL_BREAK_MS
    tags = TagState()
    pauses = []
    for _ in range(20):
        pauses += [p.ms for p in tags.pieces('<break time="10s"/>a') if isinstance(p, Pause)]
    assert sum(pauses) == MAX_TOTAL_BREAK_MS


async def test_total_break_time_is_capped(tone_server):
    seconds = await audio_seconds(tone_server.url, {"text": '<break time="10s"/>a' * 20})
    # 20 letters are 0.8 s of tone audio; the breaks asked for 200 s.
    assert seconds <= MAX_TOTAL_BREAK_MS / 1000 + 2, seconds


async def test_audio_per_request_is_capped(server_factory):
    server = server_factory("tone", ["--tts-max-audio-s", "3"])
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/tts", json={"text": "a" * 500, "format": "pcm"}) as resp:
            assert resp.headers["X-Max-Audio-S"] == "3"
            data = await resp.read()
    assert len(data) / 2 / TONE_RATE <= 3.0  # the text alone is 20 s


class Held:
    """A /v1/tts request whose body is not read, so it keeps synthesizing (held open).

    Its socket's receive buffer is 4 KB, so the server's writes wait, as they
    would for a slow reader. The text is 8,000 characters: 300 s of tone at the
    default --tts-max-audio-s, 9.6 MB of pcm, more than loopback's send buffer
    can take (tcp_wmem's ceiling is 4 MB). With 2,000 characters (80 s, 2.5 MB)
    the kernel's autotuned send buffer sometimes took all of it, the request
    ended and freed its slot mid-test (seen twice on fresh clones).
    """

    def __init__(self, http, url, key):
        self.url, self.key = urlsplit(url), key

    async def __aenter__(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: it sets the window
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.url.hostname, self.url.port))
        self.reader, self.writer = await asyncio.open_connection(sock=sock)
        body = json.dumps({"text": "a" * 8000, "format": "pcm"}).encode()
        head = (
            f"POST /v1/tts HTTP/1.1\r\nHost: {self.url.netloc}\r\nX-API-Key: {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = await asyncio.wait_for(self.reader.readline(), 30)
        assert status.split()[1:2] == [b"200"], status
        return self

    async def __aexit__(self, *exc):
        self.writer.transport.abort()


async def test_concurrency_is_limited_per_key_and_in_total_and_takes_session_slots(server_factory):
    server = server_factory("tone", [
        "--api-key", "k1", "--api-key", "k2", "--api-key", "k3",
        "--tts-max-concurrent", "2", "--tts-max-concurrent-per-key", "1", "--max-sessions", "3",
    ])
    url = server.url
    async with aiohttp.ClientSession() as http:
        async with Held(http, url, "k1"):
            status, body, headers = await http_json("POST", url + "/v1/tts", body={"text": "Hi."}, headers={"X-API-Key": "k1"})
            assert (status, body["error"]["code"]) == (429, "too_many_requests") and headers["Retry-After"]
            async with Held(http, url, "k2"):
                status, body, _ = await http_json("POST", url + "/v1/tts", body={"text": "Hi."}, headers={"X-API-Key": "k3"})
                assert (status, body["error"]["code"]) == (503, "at_capacity")
                # Two requests synthesizing hold two of the three session slots.
                status, _, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "k3"})
                assert status == 201
                status, body, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "k3"})
                assert (status, body["error"]["code"]) == (503, "at_capacity")
        # Released when they end.
        for _ in range(50):
            status, _, _ = await http_json("POST", url + "/v1/tts", body={"text": "Hi."}, headers={"X-API-Key": "k1"})
            if status == 200:
                break
            await asyncio.sleep(0.1)  # the server notices the closed connection on its next write
        assert status == 200
