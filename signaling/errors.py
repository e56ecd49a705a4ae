"""HTTP errors as the API reports them: JSON `{"error": {"code", "message"}}` with a status,
and reading request bodies that may be refused with one."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..gateway.errors import GatewayError
from ..gateway.sessions.protocol import decode_json


def error_response(error: GatewayError) -> web.Response:
    """The one mapping from an error to what an HTTP client sees."""
    return web.json_response(
        {"error": {**error.detail, "code": error.code, "message": error.message}}, status=error.status,
        headers=error.headers or None,
    )


# The largest offer (SDP) and trickle candidate bodies a client may send.
MAX_OFFER_BYTES = 256 * 1024
MAX_CANDIDATE_BYTES = 8192

# A body that has not arrived in full after this long is refused (slow senders
# must not hold a request open, and a connection slot with it, for ever).
BODY_TIMEOUT_S = 30.0
# Request key of a body a middleware has read already (the fleet router reads an
# offer's body to find its session); handlers then read it from there.
READ_AHEAD = "voxgate.read_ahead"


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, however many TCP segments it arrives in, up to `limit` bytes.

    `request.content.read(n)` returns only what is buffered so far, so one call
    cut bodies short on real networks; this reads until the end of the body.
    """
    ahead = request.get(READ_AHEAD)
    if ahead is not None:
        if len(ahead) > limit:
            raise GatewayError("too_large", f"request body is over {limit} bytes", 413)
        return ahead
    if request.content_length is not None and request.content_length > limit:
        raise GatewayError("too_large", f"request body is over {limit} bytes", 413)
    chunks: list[bytes] = []
    size = 0

    async def read_all() -> None:
        nonlocal size
        while True:
            chunk = await request.content.read(limit + 1 - size)
            if not chunk:
                return
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise GatewayError("too_large", f"request body is over {limit} bytes", 413)

    try:
        await asyncio.wait_for(read_all(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise GatewayError("body_timeout", f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", 408) from None
    return b"".join(chunks)


async def read_json_object(request: web.Request, limit: int, hint: str = "", allow_empty: bool = False) -> dict:
    """The request body as a JSON object, refusing oversized, non-UTF-8 and non-JSON bodies."""
    raw = await read_body(request, limit)
    if allow_empty and not raw.strip():
        return {}
    body = decode_json(raw, "request body", hint)
    if not isinstance(body, dict):
        raise GatewayError("invalid_json", "request body must be a JSON object" + (f"; {hint}" if hint else ""))
    return body
