"""Finding 10: TURN credentials only against a client token, bound to its session, short-lived.

Before, `GET /v1/ice-servers` handed TURN credentials valid for 3600 s to
anyone, even with `--api-key` and `--require-token`: an open relay.
"""

from __future__ import annotations

import time

import pytest

from sec_helpers import http_json

TURN = "turn:turn.example.com:3478"


@pytest.fixture(scope="module")
def turn_server(server_factory):
    return server_factory("tone", [
        "--ice-server", "stun:stun.example.com:3478", "--ice-server", TURN, "--ice-server", "turn:user:pass@relay.example.com:3478",
        "--turn-secret", "s3cret", "--api-key", "k", "--require-token",
    ])


async def test_no_token_no_turn(turn_server):
    status, body, _ = await http_json("GET", turn_server.url + "/v1/ice-servers")
    assert status == 200
    assert body == {"ice_servers": [{"urls": ["stun:stun.example.com:3478"]}]}, body


async def test_a_bad_token_is_refused(turn_server):
    status, body, _ = await http_json("GET", turn_server.url + "/v1/ice-servers?token=abc.def")
    assert status == 401 and body["error"]["code"] == "invalid_token"


async def test_a_client_token_gets_short_lived_credentials_for_its_session(turn_server):
    status, made, _ = await http_json("POST", turn_server.url + "/v1/sessions", headers={"X-API-Key": "k"})
    assert status == 201
    status, body, _ = await http_json(
        "GET", turn_server.url + "/v1/ice-servers", headers={"Authorization": f"Bearer {made['client_token']}"}
    )
    assert status == 200
    minted = [e for e in body["ice_servers"] if e["urls"] == [TURN]][0]
    expiry, user = minted["username"].split(":")
    assert user == made["session_id"]
    assert 0 < int(expiry) - time.time() <= 600 and body["ttl"] <= 600
