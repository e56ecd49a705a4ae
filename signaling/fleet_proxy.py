"""Proxying a request about a session to the gateway of the fleet that holds it
(signaling/fleet.py decides which requests, and where): HTTP with the caller's own
credentials and a hop header, the answer capped and relayed with its status, and the
backend WebSocket relayed frame by frame both ways until either side closes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import aiohttp
from aiohttp import WSMsgType, web
from prometheus_client import Counter

from ..gateway.errors import GatewayError
from .errors import error_response

log = logging.getLogger(__name__)

HOP_HEADER = "X-Voxgate-Hop"
# Request headers the holder needs to answer as if it had been asked itself.
FORWARDED_HEADERS = ("Authorization", "X-API-Key", "Content-Type", "Origin", "User-Agent")
# The holder's response headers that mean something to the caller.
RETURNED_HEADERS = ("Content-Type", "Retry-After", "Allow")
MAX_PROXIED_RESPONSE_BYTES = 1 << 20
# Holders answer on the same network; an offer's answer waits for ICE gathering.
PROXY_TIMEOUT_S = 20.0
WS_HEARTBEAT_S = 20.0
WS_CLOSE_CODES_NOT_SENDABLE = (None, 1005, 1006, 1015)


class ProxyHost(Protocol):
    """What proxying uses of the fleet (signaling/fleet.py's Fleet, which calls it): the HTTP client
    to the other gateways, the outcome counter, the relayed sockets and their message cap."""

    proxied: Counter
    sockets: set[web.WebSocketResponse]
    max_ws_message: int

    @property
    def client(self) -> aiohttp.ClientSession: ...


def forward_headers(request: web.Request) -> dict[str, str]:
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
    # The caller's Host: the holder's host and same-origin checks see what this gateway saw.
    headers["Host"] = request.host
    headers[HOP_HEADER] = "1"
    forwarded_for = request.headers.get("X-Forwarded-For")
    remote = request.remote or "unknown"
    headers["X-Forwarded-For"] = f"{forwarded_for}, {remote}" if forwarded_for else remote
    return headers


def _unreachable(fleet: ProxyHost, label: str, owner: str, exc: BaseException) -> web.Response:
    fleet.proxied.labels(label, "owner_unreachable").inc()
    log.warning("gateway %s holding a session did not answer: %s", owner, type(exc).__name__)
    return error_response(GatewayError("owner_unreachable", "the gateway that holds this session did not answer; retry shortly", 502))


async def proxy_http(request: web.Request, fleet: ProxyHost, owner: str, label: str, body: bytes) -> web.Response:
    try:
        async with fleet.client.request(
            request.method, owner + str(request.rel_url), data=body or None, headers=forward_headers(request),
            allow_redirects=False, timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT_S),
        ) as resp:
            payload = await read_capped(resp.content, MAX_PROXIED_RESPONSE_BYTES)
            headers = {name: resp.headers[name] for name in RETURNED_HEADERS if name in resp.headers}
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _unreachable(fleet, label, owner, exc)
    fleet.proxied.labels(label, "proxied").inc()
    return web.Response(status=status, body=payload, headers=headers)


async def read_capped(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body, however many segments it comes in (one read() returns only
    what has arrived so far), refused past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.read(limit + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise aiohttp.ClientPayloadError(f"answer over {limit} bytes")


async def proxy_ws(request: web.Request, fleet: ProxyHost, owner: str) -> web.StreamResponse:
    downstream = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, max_msg_size=fleet.max_ws_message, decode_text=False)
    if not downstream.can_prepare(request).ok:
        # Not an upgrade: no socket to the holder (it would take the session's
        # writer role from the real backend while the caller gets its error).
        return await proxy_http(request, fleet, owner, "ws", b"")
    url = "ws" + owner[len("http"):] + str(request.rel_url)  # http -> ws, https -> wss
    try:
        # The handshake is bounded like any proxied request; the socket then lives as long as the session.
        upstream = await asyncio.wait_for(fleet.client.ws_connect(
            url, headers=forward_headers(request), heartbeat=WS_HEARTBEAT_S, max_msg_size=fleet.max_ws_message,
            timeout=aiohttp.ClientWSTimeout(ws_close=5.0), autoping=True,
        ), PROXY_TIMEOUT_S)
    except aiohttp.WSServerHandshakeError:
        # The holder refused the upgrade (unknown session, bad role): ask again
        # without it, and relay its JSON error as it wrote it.
        return await proxy_http(request, fleet, owner, "ws", b"")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _unreachable(fleet, "ws", owner, exc)
    fleet.proxied.labels("ws", "proxied").inc()
    # decode_text=False, as the local handler: a text frame that is not UTF-8
    # reaches the holder, which answers it with an error event.
    try:
        await downstream.prepare(request)
    except BaseException:
        await upstream.close()
        raise
    fleet.sockets.add(downstream)

    async def to_caller() -> None:
        async for msg in upstream:
            if msg.type == WSMsgType.TEXT:
                await downstream.send_str(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await downstream.send_bytes(msg.data)
            else:
                break

    async def to_holder() -> None:
        async for msg in downstream:
            if msg.type == WSMsgType.TEXT:
                await upstream.send_frame(msg.data if isinstance(msg.data, bytes) else msg.data.encode(), WSMsgType.TEXT)
            elif msg.type == WSMsgType.BINARY:
                await upstream.send_bytes(msg.data)
            else:
                break

    pumps = [asyncio.ensure_future(to_caller()), asyncio.ensure_future(to_holder())]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in pumps:
            pump.cancel()
        fleet.sockets.discard(downstream)
        code = upstream.close_code
        if not upstream.closed:
            await upstream.close()  # the caller left: the holder sees its backend go
        if not downstream.closed:
            if code in WS_CLOSE_CODES_NOT_SENDABLE:
                await downstream.close(code=1001, message=b"the gateway holding the session went away")
            else:
                await downstream.close(code=code, message=b"closed by the gateway holding the session")
    return downstream
