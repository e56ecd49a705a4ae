"""Stand-ins for OpenAI-compatible servers on loopback: chat completions for the agent-loop tests, and
any one route (audio transcriptions for the relay and bridge tests)."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web


async def serve_chat_completions(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    """`completions` answers POST /v1/chat/completions on a free loopback port: (runner, the base URL)."""
    return await serve_openai_route("/v1/chat/completions", completions)


async def serve_openai_route(
    path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    """`handler` answers POST `path` (under /v1) on a free loopback port: (runner, the base URL, .../v1)."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1"
