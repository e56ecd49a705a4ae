"""A stand-in for an OpenAI-compatible chat-completions server, on loopback, for the agent-loop tests."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web


async def serve_chat_completions(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    """`completions` answers POST /v1/chat/completions on a free loopback port: (runner, the base URL)."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1"
