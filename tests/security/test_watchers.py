"""Issue 53, finding 5: backend WebSockets (watchers) on a session are bounded.

Before, any number of `?audio=pcm16` watchers could attach to one session; 250 of them made 26 % of
every session's frames late, and another tenant's POST /v1/sessions got `503 late_frames`. Now
--max-watchers-per-session and --max-watchers-per-key refuse more with 429 `watcher_limit`, and a
backend that takes none of the caller's audio for --write-stall-s is disconnected rather than fed.
bench/bench_watchers.py measures the late frames at full size.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import in_process_gateway

from sec_helpers import http_json


async def test_watchers_past_the_limits_are_refused():
    async with in_process_gateway(api_key=["k", "other"], max_watchers_per_session=3, max_watchers_per_key=4) as (_, url), \
            aiohttp.ClientSession(headers={"X-API-Key": "k"}) as http:
        ws_url = url.replace("http", "ws")
        sids = []
        for _ in range(2):
            status, made, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "k"})
            assert status == 201
            sids.append(made["session_id"])
        first = [await http.ws_connect(f"{ws_url}/v1/sessions/{sids[0]}/ws?role=watcher&audio=pcm16") for _ in range(3)]
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"{ws_url}/v1/sessions/{sids[0]}/ws?role=watcher&audio=pcm16")
        assert refused.value.status == 429
        # The key's fourth is on its other session; a fifth anywhere is over the key's limit.
        second = await http.ws_connect(f"{ws_url}/v1/sessions/{sids[1]}/ws?role=watcher")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"{ws_url}/v1/sessions/{sids[1]}/ws?role=watcher")
        assert refused.value.status == 429
        status, body, _ = await http_json("GET", f"{url}/v1/sessions/{sids[1]}/ws", headers={"X-API-Key": "k"})
        assert (status, body["error"]["code"]) == (429, "watcher_limit")
        # Another key is not held back by the first.
        status, made, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "other"})
        async with aiohttp.ClientSession(headers={"X-API-Key": "other"}) as other:
            ws = await other.ws_connect(f"{ws_url}/v1/sessions/{made['session_id']}/ws?role=watcher")
            await ws.close()
        # One that leaves frees its place.
        await first[0].close()
        again = await http.ws_connect(f"{ws_url}/v1/sessions/{sids[0]}/ws?role=watcher")
        for ws in [*first[1:], second, again]:
            await ws.close()


class NeverTakes:
    """A backend's socket whose sends never complete: the client reads nothing."""

    def __init__(self) -> None:
        self.aborted = asyncio.Event()

    async def send_str(self, data: str) -> None:
        await asyncio.Event().wait()

    async def send_bytes(self, data: bytes) -> None:
        await asyncio.Event().wait()

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        return True


async def test_a_backend_that_takes_none_of_the_callers_audio_is_disconnected_not_fed():
    async with in_process_gateway(caller_audio_buffer_ms=100, write_stall_s=0.5) as (app, _):
        gw = app["gateway"]
        session = gw.create_session()
        socket = NeverTakes()
        link = gw.attach_backend(session, socket, "watcher", True, abort=socket.aborted.set)
        frame = b"\0" * 644
        for _ in range(5):  # its 100 ms buffer
            session.caller.audio.taps[link.name](frame)
        link._on_audio(frame)  # full: dropped, and behind from now
        assert not socket.aborted.is_set()
        link._behind_since -= 1.0  # as if it had stayed behind for a second
        link._on_audio(frame)
        await asyncio.wait_for(socket.aborted.wait(), 1)
        assert link.name not in session.caller.audio.taps  # no frame's work is spent on it any more
        await link.detach()
        await session.close("test over")
