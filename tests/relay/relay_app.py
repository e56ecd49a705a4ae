"""A ConversationRelay application written from the vendors' documentation, on loopback: an aiohttp
WebSocket server that takes `setup`, answers each final `prompt` with the next scripted reply as
`text` tokens, and records every message (each checked against tests/relay/relay_schema.py).
`hostile` turns it into a misbehaving application (tests/relay/test_relay_hostile.py)."""

from __future__ import annotations

import asyncio
import json
import socket

import jsonschema
from aiohttp import WSMsgType, web

from tests.llm_standin import serve_openai_route
from tests.relay.relay_schema import RECEIVED


class RelayApp:
    def __init__(self, replies: list[list[str]] | None = None, *, end_on_digit: str | None = None,
                 handoff: dict | None = None, hostile: str | None = None, script: list[dict] | None = None) -> None:
        self.replies = list(replies or [])
        self.end_on_digit = end_on_digit
        self.handoff = handoff
        self.hostile = hostile
        self.script = script or []  # sent as they are, once `setup` came
        self.received: list[dict] = []
        self.invalid: list[str] = []  # schema violations
        self.headers: list[dict] = []
        self.changed = asyncio.Event()
        self.sockets: list[web.WebSocketResponse] = []
        self.tasks: list[asyncio.Task] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/relay", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"ws://127.0.0.1:{port}/relay"
        return self.url

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    def of_type(self, kind: str) -> list[dict]:
        return [m for m in self.received if m.get("type") == kind]

    async def wait(self, predicate, timeout: float = 20.0) -> None:
        async def until() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(until(), timeout)

    async def send(self, ws: web.WebSocketResponse, message: dict) -> None:
        await ws.send_str(json.dumps(message))

    async def reply(self, ws: web.WebSocketResponse, tokens: list[str]) -> None:
        for i, token in enumerate(tokens):
            await self.send(ws, {"type": "text", "token": token, "last": i == len(tokens) - 1})
            await asyncio.sleep(0.005)  # as an LLM streams
        if not self.replies and self.handoff is not None and self.end_on_digit is None:
            await self.send(ws, {"type": "end", "handoffData": json.dumps(self.handoff)})  # the last reply said, hang up

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        self.headers.append(dict(request.headers))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.append(ws)
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            message = json.loads(msg.data)
            try:
                jsonschema.validate(message, RECEIVED)
            except jsonschema.ValidationError as exc:
                self.invalid.append(f"{message}: {exc.message}")
            self.received.append(message)
            self.changed.set()
            kind = message.get("type")
            if kind == "setup" and self.script:
                for scripted in self.script:
                    await ws.send_str(scripted if isinstance(scripted, str) else json.dumps(scripted))
            if kind == "setup" and self.hostile == "deaf":
                await asyncio.sleep(3600)  # reads nothing more: pings go unanswered
            if kind == "setup" and self.hostile is not None:
                self.tasks.append(asyncio.ensure_future(self.misbehave(ws)))
            elif kind == "prompt" and message["last"] and self.replies:
                tokens = self.replies.pop(0)
                self.tasks.append(asyncio.ensure_future(self.reply(ws, tokens)))
            elif kind == "dtmf" and message["digit"] == self.end_on_digit:
                await self.send(ws, {"type": "sendDigits", "digits": "12#"})
                await self.send(ws, {"type": "text", "token": "Goodbye.", "last": True})
                await self.send(ws, {"type": "end", "handoffData": json.dumps(self.handoff)})
        return ws

    async def misbehave(self, ws: web.WebSocketResponse) -> None:
        if self.hostile == "flood":
            while not ws.closed:
                await self.send(ws, {"type": "text", "token": "spam ", "last": False})
                await asyncio.sleep(0)  # as fast as the connection takes them
        elif self.hostile == "huge":
            await self.send(ws, {"type": "text", "token": "x" * (10 * 1024 * 1024), "last": True})
        elif self.hostile == "close_mid_utterance":
            await self.send(ws, {"type": "text", "token": "Let me tell you a long story about", "last": False})
            await asyncio.sleep(0.5)
            await ws.close()


class SilentServer:
    """Takes TCP connections and never answers: an application that never completes the handshake."""

    def __init__(self) -> None:
        self.server: asyncio.AbstractServer | None = None
        self.connections = 0
        self.url = ""

    async def start(self) -> str:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            await reader.read(65536)
            await asyncio.sleep(3600)

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0, family=socket.AF_INET)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/relay"
        return self.url

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


async def stt_standin(texts: list[str]) -> tuple[web.AppRunner, str]:
    """An OpenAI-compatible /v1/audio/transcriptions server that answers each turn with the next of
    `texts` (then the last again): the relay's prompts, without a real recognizer in the loop."""
    queue = list(texts)

    async def transcriptions(request: web.Request) -> web.Response:
        await request.post()
        return web.json_response({"text": queue.pop(0) if len(queue) > 1 else queue[0]})

    return await serve_openai_route("/v1/audio/transcriptions", transcriptions)


async def _serve_hostile() -> None:
    """`python -m tests.relay.relay_app`: the hostile applications in a process of their own (a flood
    from the test's own event loop would starve the gateway it shares that loop with, which a real
    application's cannot); prints `ws://127.0.0.1:PORT` and serves /flood, /huge, /close_mid_utterance, /deaf."""
    app = web.Application()
    for mode in ("flood", "huge", "close_mid_utterance", "deaf"):
        app.router.add_get(f"/{mode}", RelayApp(hostile=mode).handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"ws://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_serve_hostile())
