"""A relayed conversation's end POSTed to its status callback (`action`, gateway/backends/relay_status.py), as
Twilio posts to `<Connect action>`: the application's `end` with its handoffData, a relay that failed,
a caller who hung up; signed when the session has an auth token; one retry, one log line when it
fails; and never sent to a private address without --relay-allow-private."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging

import aiohttp
from aiohttp import web

from tests.conftest import free_port, in_process_gateway
from tests.relay.relay_app import RelayApp
from tests.telephony.twilio_standin import TwilioStandIn


class CallbackServer:
    """Takes the callbacks on loopback: /ok answers 204, /broken 500."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict, dict]] = []  # (path, form, headers)
        self.arrived = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{name}", self.take)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def take(self, request: web.Request) -> web.Response:
        form = dict(await request.post())
        self.posts.append((request.path, {k: str(v) for k, v in form.items()}, dict(request.headers)))
        self.arrived.set()
        return web.Response(status=500 if request.path == "/broken" else 204)

    async def wait(self, count: int) -> None:
        async def until() -> None:
            while len(self.posts) < count:
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(until(), 10)


def signature(token: str, url: str, form: dict) -> str:
    """Twilio's documented signature of a form POST, written here rather than taken from the gateway."""
    data = url + "".join(k + form[k] for k in sorted(form))
    return base64.b64encode(hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()).decode()


async def test_the_end_reaches_the_status_callback_with_how_and_why(caplog):
    callbacks = CallbackServer()
    await callbacks.start()
    app = RelayApp(script=[{"type": "text", "token": "Bye.", "last": True},
                           {"type": "end", "handoffData": '{"queue": "billing"}'}])
    await app.start()
    quiet = RelayApp()
    await quiet.start()
    try:
        async with in_process_gateway(relay_allow_private=True, relay_apology="") as (_, url):
            # The application ends it, handing off; the session was made with an auth token, so it is signed.
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/sessions", json={"relay": {
                        "url": app.url, "action": callbacks.url + "/ok", "authToken": "tok"}}) as resp:
                    made = await resp.json()
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/sessions/{made['session_id']}") as resp:
                    shown = (await resp.json())["relay"]
            phone = TwilioStandIn(url, call_sid="CAended")
            await phone.connect()
            await phone.start({"session_id": made["session_id"], "token": made["client_token"], "from": "+1555"})
            await callbacks.wait(1)
            await phone.close()
            # The application cannot be reached: failed.
            phone = TwilioStandIn(url, stream_sid="MZfailed", call_sid="CAfailed")
            await phone.connect()
            await phone.start({"relay_url": f"ws://127.0.0.1:{free_port()}/relay", "action": callbacks.url + "/ok"})
            await callbacks.wait(2)
            await phone.close()
            # The caller hangs up: completed. A callback that answers 500 is tried twice and logged once.
            phone = TwilioStandIn(url, stream_sid="MZhangup", call_sid="CAhangup")
            await phone.connect()
            await phone.start({"relay_url": quiet.url, "statusCallback": callbacks.url + "/broken"})
            await quiet.wait(lambda: quiet.of_type("setup"))
            await phone.stop()
            await callbacks.wait(4)
            await phone.close()
            await asyncio.sleep(0.2)  # the warning is logged after the second answer
    finally:
        await app.stop()
        await quiet.stop()
        await callbacks.stop()
    (path, ended, headers), (_, failed, _), (_, hung_up, _), (again, _, _) = callbacks.posts
    assert path == "/ok" and ended["SessionStatus"] == "ended" and ended["HandoffData"] == '{"queue": "billing"}'
    assert ended["CallSid"] == "CAended" and ended["SessionId"] == "VX" + made["session_id"]
    assert ended["From"] == "+1555" and ended["CallStatus"] == "completed" and ended["AccountSid"] == ""
    assert shown["action"] == callbacks.url + "/ok"
    assert headers["X-Twilio-Signature"] == signature("tok", callbacks.url + "/ok", ended)
    assert failed["SessionStatus"] == "failed" and failed["ErrorMessage"].startswith("connect:")
    assert "HandoffData" not in failed and failed["CallSid"] == "CAfailed"
    assert hung_up["SessionStatus"] == "completed" and "ErrorMessage" not in hung_up and again == "/broken"
    assert int(hung_up["SessionDuration"]) >= 0 and "X-Twilio-Signature" not in callbacks.posts[2][2]
    warnings = [r.getMessage() for r in caplog.records if r.name == "voxgate.gateway.backends.relay_status"]
    assert len(warnings) == 1 and "failed: HTTP 500" in warnings[0], warnings


async def test_the_status_callback_passes_the_outbound_guard(caplog):
    callbacks = CallbackServer()
    await callbacks.start()
    try:
        async with in_process_gateway(relay_apology="") as (_, url):
            phone = TwilioStandIn(url, call_sid="CAguard")
            await phone.connect()
            await phone.start({"relay_url": "ws://127.0.0.1:9/relay", "action": callbacks.url + "/ok"})
            await phone.wait(lambda: phone.ws.closed, timeout=10)
            await phone.close()
            for _ in range(100):
                if any(r.name == "voxgate.gateway.backends.relay_status" for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
    finally:
        await callbacks.stop()
    assert callbacks.posts == []  # never reached
    [warning] = [r.getMessage() for r in caplog.records if r.name == "voxgate.gateway.backends.relay_status"]
    assert "private address" in warning and r"--relay-allow-private" in warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info]  # one line, no traceback
