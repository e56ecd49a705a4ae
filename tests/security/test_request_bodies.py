"""Finding 8: request bodies are read whole, however the network splits them.

Before, `request.content.read(n)` returned what was buffered so far, so a valid
body sent in two TCP writes 0.3 s apart got 400 `invalid_json` (and a 239 kB
offer failed in ordinary use). Each request here goes over a raw socket, its
body in two writes with a pause between them.
"""

from __future__ import annotations

import json

from tests.conftest import loopback_offer_sdp

from sec_helpers import host_port, raw_request


def split_post(url: str, path: str, body: bytes, first: int | None = None, pause_s: float = 0.3):
    host, port = host_port(url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    cut = first if first is not None else len(body) // 2
    return raw_request(url, head, [body[:cut], body[cut:]], pause_s)


def test_tts_body_in_two_writes(tone_server):
    status, data = split_post(tone_server.url, "/v1/tts", json.dumps({"text": "Hello there.", "format": "pcm"}).encode())
    assert status == 200, data[:300]


def test_session_body_in_two_writes(tone_server):
    status, data = split_post(tone_server.url, "/v1/sessions", json.dumps({"voice": "tone"}).encode())
    assert status == 201, data[:300]


def test_large_offer_in_two_writes(tone_server):
    sdp = loopback_offer_sdp()
    # Padded past 200 kB with attribute lines a parser skips, like a big real offer.
    padding = "".join(f"a=x-pad:{i:06d}{'p' * 90}\r\n" for i in range(2200))
    sdp = sdp.replace("a=mid:0\r\n", "a=mid:0\r\n" + padding, 1)
    body = json.dumps({"sdp": sdp, "type": "offer"}).encode()
    assert len(body) > 200_000
    status, data = split_post(tone_server.url, "/v1/offer", body, first=64 * 1024)
    assert status == 200, data[:300]
    assert json.loads(data)["type"] == "answer"


def test_each_route_keeps_its_size_limit(tone_server):
    status, data = split_post(tone_server.url, "/v1/sessions", json.dumps({"voice": "tone", "pad": "x" * 9000}).encode())
    assert status == 413 and json.loads(data)["error"]["code"] == "too_large"
