"""A client of `GET /v1/tts/ws` that carries several contexts on one connection.

Framework-free (aiohttp only): the LiveKit plugin speaks through it, and so can
tests and benchmarks. One reader task takes the server's messages and hands each
to its context's bounded queue; a message for a context nobody reads any more is
dropped. When the connection ends, every open context gets a `ConnectionLost`.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlencode, urlsplit, urlunsplit

import aiohttp

# Messages waiting for one context's reader. A full queue holds the connection's
# reader back (so the server's own bounded queue paces synthesis); a context
# that is closed is drained at once, so an abandoned one never holds it.
CONTEXT_QUEUE = 256
READY_TIMEOUT_S = 10.0


class TTSWebSocketError(Exception):
    """The server refused the connection or a context: `code` is its error code
    (or the HTTP status, as text, for a refused handshake)."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


class ConnectionLost(TTSWebSocketError):
    def __init__(self, message: str = "the /v1/tts/ws connection closed") -> None:
        super().__init__("connection_lost", message)


def ws_url(base_url: str, query: dict[str, str]) -> str:
    """http(s)://host:port[/prefix] (or ws(s)://) to the socket's address with its query."""
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"the gateway's URL must be http(s):// or ws(s)://, not {base_url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/tts/ws"):
        path += "/v1/tts/ws"
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


class Context:
    """One context's messages, in order: iterate it until `done` or `cancelled`
    (both are yielded, then iteration ends); an `error` for it is raised."""

    def __init__(self, conn: "TTSWebSocket", context_id: str) -> None:
        self.conn = conn
        self.id = context_id
        self.queue: asyncio.Queue = asyncio.Queue(CONTEXT_QUEUE)
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item["type"] in ("done", "cancelled"):
            self.finished = True
        elif item["type"] == "error":
            self.finished = True
            raise TTSWebSocketError(str(item.get("code")), str(item.get("message")))
        return item

    async def send_text(self, text: str) -> None:
        await self.conn.send({"type": "text", "context_id": self.id, "text": text})

    async def flush(self) -> None:
        await self.conn.send({"type": "flush", "context_id": self.id})

    async def end(self) -> None:
        await self.conn.send({"type": "end", "context_id": self.id})

    async def cancel(self) -> None:
        await self.conn.send({"type": "cancel", "context_id": self.id})

    def close(self) -> None:
        """Stop receiving this context's messages (cancel it first if it may still speak)."""
        self.conn._contexts.pop(self.id, None)
        while not self.queue.empty():
            self.queue.get_nowait()


class TTSWebSocket:
    """One `/v1/tts/ws` connection. `await connect()`, then `context(id)` for each
    utterance; `ready` is the server's first message (sample_rate, format, voice,
    max_contexts)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, format: str = "pcm16",
                 sample_rate: int | None = None, voice: str | None = None, words: bool = True,
                 session: aiohttp.ClientSession | None = None) -> None:
        query = {"format": format, "words": "true" if words else "false"}
        if sample_rate is not None:
            query["sample_rate"] = str(int(sample_rate))
        if voice is not None:
            query["voice"] = voice
        self.url = ws_url(base_url, query)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = session
        self._own_session = session is None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._contexts: dict[str, Context] = {}
        self._reader: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()
        self.ready: dict = {}
        self.closed = False

    async def connect(self, timeout: float = READY_TIMEOUT_S) -> "TTSWebSocket":
        if self._session is None:
            self._session = aiohttp.ClientSession()
        session = self._session

        async def open_socket():
            return await session.ws_connect(self.url, headers=self.headers, autoping=True, heartbeat=None)

        try:
            ws = await asyncio.wait_for(open_socket(), timeout)
            self._ws = ws
        except aiohttp.WSServerHandshakeError as exc:
            await self._close_session()
            raise TTSWebSocketError(str(exc.status), exc.message or "handshake refused", exc.status) from None
        except BaseException:
            await self._close_session()
            raise
        try:
            first = await ws.receive(timeout=timeout)
            if first.type != aiohttp.WSMsgType.TEXT:
                raise ConnectionLost(f"expected the server's ready message, got {first.type.name}")
            ready = json.loads(first.data)
            if ready.get("type") == "error":
                raise TTSWebSocketError(str(ready.get("code")), str(ready.get("message")))
            if ready.get("type") != "ready":
                raise ConnectionLost(f"expected the server's ready message, got {ready.get('type')!r}")
        except BaseException:
            await self.close()
            raise
        self.ready = ready
        self._reader = asyncio.ensure_future(self._read(ws))
        return self

    @property
    def sample_rate(self) -> int:
        return int(self.ready["sample_rate"])

    def context(self, context_id: str) -> Context:
        if self.closed:
            raise ConnectionLost()
        if context_id in self._contexts:
            raise ValueError(f"context {context_id!r} is open already")
        ctx = Context(self, context_id)
        self._contexts[context_id] = ctx
        return ctx

    async def send(self, message: dict) -> None:
        if self.closed or self._ws is None or self._ws.closed:
            raise ConnectionLost()
        async with self._send_lock:
            try:
                await self._ws.send_str(json.dumps(message, separators=(",", ":")))
            except (ConnectionError, RuntimeError) as exc:
                raise ConnectionLost(f"sending failed: {exc}") from None

    async def _read(self, ws) -> None:
        reason = "the server closed the connection"
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                cid = data.get("context_id")
                if cid is None:
                    if data.get("type") == "error":  # about the connection, not one context
                        reason = f"{data.get('code')}: {data.get('message')}"
                    continue
                ctx = self._contexts.get(cid)
                if ctx is not None:
                    await ctx.queue.put(data)
        except Exception as exc:  # a broken connection ends every context below
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.closed = True
            for ctx in list(self._contexts.values()):
                if not ctx.queue.full():
                    ctx.queue.put_nowait(ConnectionLost(reason))
                else:  # its reader is behind: the loss replaces the oldest message
                    ctx.queue.get_nowait()
                    ctx.queue.put_nowait(ConnectionLost(reason))

    async def close(self) -> None:
        self.closed = True
        if self._ws is not None and not self._ws.closed:
            await self._ws.close()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        await self._close_session()

    async def _close_session(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
