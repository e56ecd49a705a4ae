"""Finding 4: a session belongs to the API key that made it; any other key gets 404.

Before, with `--api-key k1 --api-key k2`, k2 listed k1's sessions (Twilio
call sids and DTMF digits included), watched their events, took the writer
role, cancelled, injected speech and deleted them.
"""

from __future__ import annotations

import aiohttp
import pytest

from sec_helpers import http_json


@pytest.fixture(scope="module")
def keyed_server(server_factory):
    return server_factory("tone", ["--api-key", "k1", "--api-key", "k2"])


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_another_key_cannot_see_drive_or_end_a_session(keyed_server):
    url = keyed_server.url
    status, made, _ = await http_json("POST", url + "/v1/sessions", headers=auth("k1"))
    assert status == 201
    sid = made["session_id"]
    session_url = f"{url}/v1/sessions/{sid}"

    status, body, _ = await http_json("GET", session_url, headers=auth("k2"))
    assert (status, body["error"]["code"]) == (404, "unknown_session")
    status, body, _ = await http_json("GET", url + "/v1/sessions", headers=auth("k2"))
    assert status == 200 and sid not in [s["session_id"] for s in body["sessions"]]
    async with aiohttp.ClientSession() as http:
        for role in ("writer", "watcher"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(f"{session_url.replace('http', 'ws')}/ws?role={role}", headers=auth("k2"))
            assert refused.value.status == 404
    status, body, _ = await http_json("DELETE", session_url, headers=auth("k2"))
    assert (status, body["error"]["code"]) == (404, "unknown_session")

    # The owner still has it all.
    status, body, _ = await http_json("GET", session_url, headers=auth("k1"))
    assert status == 200 and body["session_id"] == sid
    status, body, _ = await http_json("GET", url + "/v1/sessions", headers=auth("k1"))
    assert [s["session_id"] for s in body["sessions"]] == [sid]
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{session_url.replace('http', 'ws')}/ws", headers=auth("k1")) as ws:
            ready = await ws.receive_json(timeout=10)
            assert ready["type"] == "session.ready" and ready["role"] == "writer"
    status, body, _ = await http_json("DELETE", session_url, headers=auth("k1"))
    assert status == 200 and body["closed"] is True


async def test_sessions_made_without_a_key_belong_to_no_key(keyed_server):
    from voxgate.rtc_client import RtcClient

    async with RtcClient(keyed_server.url) as browser:  # an anonymous offer (no --require-token)
        for key in ("k1", "k2"):
            status, body, _ = await http_json("GET", f"{keyed_server.url}/v1/sessions/{browser.session_id}", headers=auth(key))
            assert status == 404
            status, body, _ = await http_json("GET", keyed_server.url + "/v1/sessions", headers=auth(key))
            assert browser.session_id not in [s["session_id"] for s in body["sessions"]]
