"""A Python client for voice-bot backends: the session API plus its WebSocket.

    async with VoxgateSession("http://127.0.0.1:8080", api_key=KEY) as session:
        print(session.client_token)          # hand this to the browser for /v1/offer
        outcome = await session.say_stream(llm_tokens())
        if outcome.interrupted:
            truncate_context(outcome.played_text)

`say_stream` sends the first clause as soon as it is complete, so speech can
start early, then coalesces tokens into batches of about `batch_s` (100 ms):
the server's segmenter decides the sentence units either way, and batching
saves one WebSocket message per token.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Iterable
from urllib.parse import urlencode

import aiohttp
import numpy as np

from .gateway.caller.caller_audio import FRAME_HEADER

# A long call's events kept in `history`, and those left for `wait_for` unread: past either, the oldest go.
MAX_HISTORY = 10000
MAX_UNREAD = 1000

# A clause is complete at these marks once something follows them (or at once
# for a closing mark at the end of a token: ".", "!", "?" followed by nothing
# more in this token are flushed too, the server's segmenter handles "$29.").
_CLAUSE_END = re.compile(r"[,.;:!?\u2014\u3002\uff0c\uff01\uff1f](?:[\"')\]]*)(?:\s|$)")


class VoxgateError(Exception):
    """An HTTP error from the session API, or an error event about one utterance."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


@dataclass
class Outcome:
    """How an utterance ended."""

    id: str
    interrupted: bool
    text: str = ""  # all of it (done) or what was sent
    played_text: str = ""  # what the listener heard
    played_ms: int = 0
    reason: str | None = None  # 'cancel' or 'barge_in' when interrupted


@dataclass
class CallerFrame:
    """20 ms of the caller's audio: 320 samples of 16 kHz mono PCM16 (little-endian bytes)."""

    seq: int  # the session's frame count: a gap means frames were lost on the way
    capture_ms: int  # when its first sample was captured, on the session's clock (the clock of every `at_ms`)
    pcm: bytes

    def samples(self) -> np.ndarray:
        """The PCM as a numpy int16 array."""
        return np.frombuffer(self.pcm, dtype="<i2")


async def coalesce(tokens: AsyncIterable[str], batch_s: float = 0.1) -> AsyncIterator[str]:
    """Text pieces to send: the first clause as soon as it is complete, then
    whatever arrived, at most every `batch_s` (pending text never waits longer)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read() -> None:
        try:
            async for token in tokens:
                if token:
                    queue.put_nowait(token)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
            return
        queue.put_nowait(done)

    reader = asyncio.ensure_future(read())
    pending = ""
    pending_since = 0.0
    first_clause = False
    try:
        while True:
            timeout = None if not pending else max(0.0, pending_since + batch_s - time.monotonic())
            try:
                item = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                yield pending
                pending = ""
                continue
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            if not pending:
                pending_since = time.monotonic()
            pending += item
            if not first_clause and _CLAUSE_END.search(pending):
                first_clause = True
                yield pending
                pending = ""
        if pending:
            yield pending
    finally:
        reader.cancel()


async def _as_async(tokens: AsyncIterable[str] | Iterable[str]) -> AsyncIterator[str]:
    if hasattr(tokens, "__aiter__"):
        async for token in tokens:
            yield token
    else:
        for token in tokens:
            yield token


async def list_sessions(base_url: str, *, api_key: str | None = None,
                        http: aiohttp.ClientSession | None = None) -> list[dict]:
    """The open sessions this API key made (`GET /v1/sessions`; without keys, those made without
    one: every session of a server that has none), each as `VoxgateSession.state()` shows one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    own = http is None
    client = aiohttp.ClientSession() if http is None else http
    try:
        async with client.get(base_url.rstrip("/") + "/v1/sessions", headers=headers) as resp:
            data = await resp.json(content_type=None) if resp.content_type == "application/json" else None
            if resp.status >= 400:
                err = data.get("error", {}) if isinstance(data, dict) else {}
                raise VoxgateError(err.get("code", "http_error"), err.get("message", resp.reason or ""), resp.status)
            return list((data or {}).get("sessions", []))
    finally:
        if own:
            await client.close()


class VoxgateSession:
    """Creates (or attaches to) a session and holds its backend WebSocket."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        session_id: str | None = None,
        voice: str | None = None,
        role: str = "writer",
        end_on_exit: bool | None = None,
        caller_audio: bool = False,
        caller_audio_buffer: int = 500,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.session_id = session_id
        self.voice = voice
        self.role = role
        # A session this client made ends with it, unless told otherwise.
        self.end_on_exit = end_on_exit
        self.info: dict = {}  # the POST /v1/sessions answer when this client made the session
        self.ready: dict = {}  # the session.ready event; 'role' says whether we may write
        self.history: list[dict] = []  # every event, oldest first (the last MAX_HISTORY at most)
        # The reason of the server's session.closed, once it sent one: the session has ended. While
        # None after the connection closed, the session may live on (reconnect with session_id).
        self.ended: str | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse[bool] | None = None
        self._reader: asyncio.Task | None = None
        self._queue: asyncio.Queue = asyncio.Queue()  # for wait_for
        self._subscribers: list[asyncio.Queue] = []
        self._outcomes: dict[str, asyncio.Future] = {}
        # With caller_audio: the caller's audio frames, the newest `caller_audio_buffer` kept
        # until read; `frames_lost` counts the gaps in their sequence numbers, here or on the way.
        self.caller_audio = caller_audio
        self._frames: collections.deque = collections.deque(maxlen=caller_audio_buffer)
        self._frame_ready = asyncio.Event()
        self._last_seq: int | None = None
        self.frames_lost = 0
        self._prefix = "b" + secrets.token_hex(3)
        self._count = 0
        self._created = False

    # Lifecycle
    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def client_token(self) -> str | None:
        return self.info.get("client_token")

    @property
    def join_url(self) -> str | None:
        """The bundled page's address that joins this session (docs/web.md), when this client made it."""
        if not self.client_token or not self.session_id:
            return None
        return f"{self.base_url}/?{urlencode({'session_id': self.session_id, 'token': self.client_token})}"

    async def __aenter__(self) -> "VoxgateSession":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        self._http = aiohttp.ClientSession(headers=self.headers)
        try:
            if self.session_id is None:
                body = {"voice": self.voice} if self.voice else {}
                self.info = await self._request("POST", "/v1/sessions", json=body)
                self.session_id = self.info["session_id"]
                self._created = True
            url = self.base_url + f"/v1/sessions/{self.session_id}/ws"
            try:
                params = {"role": self.role, **({"audio": "pcm16"} if self.caller_audio else {})}
                self._ws = await self._http.ws_connect(url, params=params, heartbeat=20.0)
            except aiohttp.WSServerHandshakeError as exc:
                raise VoxgateError("ws_refused", f"the session WebSocket was refused ({exc.status})", exc.status) from None
            self._reader = asyncio.ensure_future(self._read())
            self.ready = await self.wait_for("session.ready")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        end = self.end_on_exit if self.end_on_exit is not None else self._created
        if self._ws is not None and not self._ws.closed:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
        if end and self._http is not None and self.session_id is not None:
            try:
                await self._request("DELETE", f"/v1/sessions/{self.session_id}")
            except (VoxgateError, aiohttp.ClientError):
                pass  # already gone
        if self._http is not None:
            await self._http.close()
        for future in self._outcomes.values():
            if not future.done():
                future.set_exception(VoxgateError("session_closed", "the session connection closed"))

    async def _request(self, method: str, path: str, **kwargs) -> dict:
        assert self._http is not None
        async with self._http.request(method, self.base_url + path, **kwargs) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = None
            if resp.status >= 400:
                err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
                raise VoxgateError(err.get("code", "http_error"), err.get("message", resp.reason or ""), resp.status)
            return data

    async def state(self) -> dict:
        """The session's state: peers, codec, utterances, writer, watchers."""
        return await self._request("GET", f"/v1/sessions/{self.session_id}")

    # Events
    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                self._on_frame(msg.data)
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            event = json.loads(msg.data)
            if event.get("type") == "session.closed":
                self.ended = str(event.get("reason"))
            self.history.append(event)
            if len(self.history) > MAX_HISTORY:
                del self.history[: MAX_HISTORY // 2]
            if self._queue.qsize() >= MAX_UNREAD:
                self._queue.get_nowait()  # nobody waits for events this old
            self._queue.put_nowait(event)
            for queue in self._subscribers:
                queue.put_nowait(event)
            self._settle(event)
        self._frame_ready.set()  # wake a caller_frames() reader: nothing more will come
        # Said here, not by the server: `connection_lost` tells the two apart (the server's came first, if it sent one).
        closed = {"type": "session.closed", "reason": "connection closed", "connection_lost": self.ended is None}
        for queue in [self._queue, *self._subscribers]:
            queue.put_nowait(closed)
        for future in self._outcomes.values():
            if not future.done():
                future.set_exception(VoxgateError("session_closed", "the session connection closed"))

    def _settle(self, event: dict) -> None:
        future = self._outcomes.get(event.get("id") or "")
        if future is None or future.done():
            return
        kind = event.get("type")
        if kind == "utterance.done":
            future.set_result(Outcome(event["id"], False, event.get("text", ""), event.get("text", ""), event.get("audio_ms", 0)))
        elif kind == "utterance.interrupted":
            future.set_result(
                Outcome(event["id"], True, "", event.get("played_text", ""), event.get("played_ms", 0), event.get("reason"))
            )
        elif kind == "error":
            future.set_exception(VoxgateError(event.get("code", "error"), event.get("message", "")))
        if future.done():
            self._outcomes.pop(event["id"], None)

    def _on_frame(self, data: bytes) -> None:
        if len(data) < FRAME_HEADER.size:
            return
        seq, capture_ms = FRAME_HEADER.unpack_from(data)
        if self._last_seq is not None:
            self.frames_lost += (seq - self._last_seq - 1) % (1 << 32)
        self._last_seq = seq
        if len(self._frames) == self._frames.maxlen:
            self.frames_lost += 1  # this reader is too slow: the oldest frame goes
        self._frames.append(CallerFrame(seq, capture_ms, bytes(data[FRAME_HEADER.size:])))
        self._frame_ready.set()

    async def caller_frames(self) -> AsyncIterator[CallerFrame]:
        """The caller's audio, frame by frame, until the session's connection closes
        (needs `caller_audio=True`)."""
        if not self.caller_audio:
            raise VoxgateError("no_caller_audio", "make the VoxgateSession with caller_audio=True to receive the caller's audio")
        while True:
            while self._frames:
                yield self._frames.popleft()
            if self._reader is None or self._reader.done():
                return
            self._frame_ready.clear()
            await self._frame_ready.wait()

    def events(self) -> AsyncIterator[dict]:
        """Every event from this call on, until the session closes."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)  # now, not at the first iteration

        async def iterate() -> AsyncIterator[dict]:
            try:
                while True:
                    event = await queue.get()
                    yield event
                    if event.get("type") == "session.closed":
                        return
            finally:
                self._subscribers.remove(queue)

        return iterate()

    async def wait_for(self, kind: str, *, id: str | None = None, timeout: float = 30.0) -> dict:
        """The next event of this type (and id); events of other types are skipped."""
        async def next_match() -> dict:
            while True:
                event = await self._queue.get()
                if event.get("type") == kind and (id is None or event.get("id") == id):
                    return event
                if event.get("type") == "session.closed" and kind != "session.closed":
                    raise VoxgateError("session_closed", f"the session closed while waiting for {kind}")

        return await asyncio.wait_for(next_match(), timeout)

    # Sending
    async def send(self, message: dict) -> None:
        if self._ws is None or self._ws.closed:
            raise VoxgateError("session_closed", "the session connection is closed")
        await self._ws.send_str(json.dumps(message))

    def new_id(self) -> str:
        self._count += 1
        return f"{self._prefix}-{self._count}"

    def _expect(self, uid: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._outcomes[uid] = future
        return future

    async def say(self, text: str, *, id: str | None = None, wait: bool = True) -> Outcome | str:
        """A whole utterance; returns its Outcome (or its id when wait=False). An `error`
        the server answers it with raises VoxgateError with its code."""
        uid = id or self.new_id()
        future = self._expect(uid)
        try:
            await self.send({"type": "speak", "id": uid, "text": text})
        except BaseException:
            self._forget(uid, future)
            raise
        if not wait:
            self._forget(uid, future)  # nobody awaits it: its events are in `history` and `events()`
            return uid
        return await self._finish(uid, future)

    async def say_stream(
        self, tokens: AsyncIterable[str] | Iterable[str], *, id: str | None = None, wait: bool = True, batch_s: float = 0.1
    ) -> Outcome | str:
        """Speak LLM tokens as they come. Stops reading tokens if the listener
        interrupts; the Outcome says what was heard.

        If `tokens` raises (an LLM failing mid-reply), the utterance is ended with
        `text.end`: what was sent is spoken, and what is queued after it plays; then
        the source's own exception is raised here. The same if this task is cancelled."""
        uid = id or self.new_id()
        future = self._expect(uid)
        sent = []
        try:
            async for piece in coalesce(_as_async(tokens), batch_s):
                if future.done():
                    break  # interrupted (or refused): the rest would not be spoken
                await self.send({"type": "text.delta", "id": uid, "text": piece})
                sent.append(piece)
        except BaseException:
            still_open = bool(sent) and not future.done()
            self._forget(uid, future)
            if still_open and self._ws is not None and not self._ws.closed:
                try:
                    await self.send({"type": "text.end", "id": uid})
                except (VoxgateError, ConnectionError, RuntimeError):
                    pass  # the connection went meanwhile: the server ends it for us (docs/protocol.md)
            raise
        if not future.done():
            await self.send({"type": "text.end", "id": uid})
        if not wait:
            self._forget(uid, future)
            return uid
        outcome = await self._finish(uid, future)
        if outcome.interrupted:
            outcome.text = "".join(sent)
        return outcome

    def _forget(self, uid: str, future: asyncio.Future) -> None:
        """An utterance's future that nobody will await: no outcome lands on it, and an
        error that did is taken, so asyncio does not report it as never retrieved."""
        if self._outcomes.get(uid) is future:
            del self._outcomes[uid]
        if future.done():
            if not future.cancelled():
                future.exception()
        else:
            future.cancel()

    async def _finish(self, uid: str, future: asyncio.Future) -> Outcome:
        try:
            return await future
        finally:
            self._outcomes.pop(uid, None)

    async def cancel(self) -> None:
        await self.send({"type": "cancel"})

    async def update(self, **fields) -> dict:
        """Change the session's settings: the `session.updated` event, or VoxgateError
        with the server's code (`unknown_voice`, `invalid_field`, `read_only`...)."""
        return await self._ask({"type": "session.update", **fields}, "session.updated")

    async def _ask(self, message: dict, answer: str, timeout: float = 30.0) -> dict:
        """Send a message the server answers with one event of type `answer` or an `error`
        about no utterance (no `id`, no caller turn's span): the event, or the error raised."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)  # before the message goes, so the answer cannot be missed

        async def reply() -> dict:
            while True:
                event = await queue.get()
                kind = event.get("type")
                if kind == answer:
                    return event
                if kind == "error" and "id" not in event and "start_ms" not in event:
                    raise VoxgateError(str(event.get("code", "error")), str(event.get("message", "")))
                if kind == "session.closed":
                    raise VoxgateError("session_closed", f"the session closed before {answer}: {event.get('reason')}")

        try:
            await self.send(message)
            return await asyncio.wait_for(reply(), timeout)
        finally:
            self._subscribers.remove(queue)

    async def end(self) -> None:
        """End the session for everyone attached to it."""
        await self._request("DELETE", f"/v1/sessions/{self.session_id}")


BackendClient = VoxgateSession
