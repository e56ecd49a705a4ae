"""One stream's requests to the engine pool (engine/cluster/remote.py is the client that
holds them): the units pending go out as one HTTP request (engine/cluster/pool_protocol.py)
with the stream's playout deadline, and the response's frames come back into the
stream, as many as its credit allows. A listed replica is tried first; one that
cannot be connected to hands the request to Serve's proxy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Protocol

import aiohttp
import numpy as np

from .. import proto
from ..base import WordTiming
from ..runtime.client import STREAM_WINDOW
from ..errors import EngineCrashed, EngineStreamError, EngineUnavailable
from ..runtime.codec import FRAME_HEAD, FrameError, frame_sizes, parse_header
from .pool_protocol import MAX_UNITS_PER_REQUEST, REPLICA_HEADER, STREAM_PATH, StreamRequest, check_chunk
from ..stream import TTSStream

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# A listed replica that does not answer a connection within this long is taken
# for unreachable from here (a firewall, a route, a dead node still listed), and
# the request goes through the proxy: a playing stream must not wait 5 s.
DIRECT_CONNECT_TIMEOUT_S = 1.0
# The longest wait for the next frame while the stream wants one: a replica
# serves urgent streams first, so a stream with audio to spare can wait seconds.
READ_TIMEOUT_S = 60.0

CRASHED_TEXT = "the engine pool's replica stopped unexpectedly; it is being restarted and the next utterance goes to a live replica"


class Replicas(Protocol):
    """Which replica a request goes to (engine/cluster/remote.py's PoolView)."""

    def take(self) -> str | None: ...  # None: none listed, send through the proxy

    def release(self, url: str) -> None: ...

    def drop(self, url: str, why: str) -> None: ...


class PoolClient(Protocol):
    """What a transport asks of the client that holds it (engine/cluster/remote.py's RemoteEngineClient)."""

    url: str  # Serve's proxy
    read_timeout_s: float
    requests_by_route: dict[str, int]  # requests sent "direct" to a replica, and through the "proxy"

    @property
    def http(self) -> aiohttp.ClientSession | None: ...  # None once closed

    def stream_of(self, sid: int) -> TTSStream | None: ...

    def finish(self, sid: int, error: Exception | None) -> None: ...

    @property
    def pool(self) -> Replicas: ...

    def replica_lost(self, replica: str | None) -> None: ...


class RemoteTransport:
    """One stream's requests to the pool: units out in order, frames in, within the stream's credit."""

    def __init__(
        self, client: PoolClient, sid: int, options: dict, start_in_s: float, held_s: float = 0.0,
        after: "RemoteTransport | None" = None,
    ) -> None:
        self.client = client
        self.sid = sid
        self.options = options
        self.opened_at = time.monotonic()
        # When the listener needs the first audio (monotonic), and what the gateway holds back.
        self.start_at = self.opened_at + max(0.0, float(start_in_s))
        self.held_s = max(0.0, float(held_s))
        # The stream its listener hears first: its deadline is this one's start, as in the
        # worker's Scheduler; let go of once it has ended and no longer moves (start()).
        self.after = after
        self.done = False  # every unit synthesized, or failed: what it sent still plays
        self.cancelled = False  # its listener hears no more of it
        self.units: deque = deque()
        self.ended = False
        self.credit = STREAM_WINDOW
        self.first_audio_at: float | None = None
        self.audio_s = 0.0
        self.replica: str | None = None
        self._wake = asyncio.Event()
        self._credit_given = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    # From the stream (via the client's StreamTransport methods)
    def push_unit(self, index: int, payload: str | list) -> None:
        self.units.append((index, payload))
        self._wake.set()

    def end_input(self) -> None:
        self.ended = True
        self._wake.set()

    def add_credit(self, chunks: int) -> None:
        self.credit += chunks
        self._credit_given.set()

    def cancel(self) -> None:
        self.cancelled = True
        if not self._task.done() and asyncio.current_task() is not self._task:
            self._task.cancel()  # closes the open response: the replica stops this stream

    def start(self) -> float:
        """When the listener needs this stream's first audio (monotonic)."""
        after = self.after
        if after is None:
            return self.start_at
        if after.cancelled:
            self.after = None  # its audio stops now
            return self.start_at
        start = max(self.start_at, after.deadline())
        if after.done and after.after is None:
            self.start_at, self.after = start, None  # it no longer moves: keep the time, not the stream
        return start

    def deadline(self) -> float:
        """When the listener runs out of audio (monotonic), as the worker reckons it: playout
        starts with the first audio, or at the start if later, and the gateway's listener has
        heard all of it but what the gateway holds back."""
        start = self.start()
        if self.first_audio_at is None:
            return start
        return max(start, self.first_audio_at) + self.audio_s - self.held_s

    def deadline_in(self) -> float:
        """Seconds until the listener runs out of audio: the deadline the replica schedules by."""
        return max(0.0, self.deadline() - time.monotonic())

    # The requests
    async def _run(self) -> None:
        stream = self.client.stream_of(self.sid)
        if stream is None:
            return
        try:
            while True:
                while not self.units and not self.ended:
                    self._wake.clear()
                    await self._wake.wait()
                if not self.units:
                    self.client.finish(self.sid, None)
                    return
                batch = [self.units.popleft() for _ in range(min(len(self.units), MAX_UNITS_PER_REQUEST))]
                await self._request(stream, batch)
        except (EngineCrashed, EngineStreamError, EngineUnavailable) as exc:
            self.client.finish(self.sid, exc)
        except Exception as exc:  # a bug here must end the stream, never leave its reader waiting
            log.exception("engine pool stream failed")
            self.client.finish(self.sid, EngineUnavailable(f"the engine pool stream failed: {type(exc).__name__}"))

    async def _request(self, stream: TTSStream, batch: list) -> None:
        """One request: straight to a replica when the pool lists them, else (or if
        that replica cannot be connected to, so nothing reached it) through the proxy."""
        client = self.client
        replica = client.pool.take()
        if replica is not None:
            try:
                await self._request_at(replica, stream, batch, direct=True)
                return
            except _NotConnected as exc:
                client.pool.drop(replica, str(exc))
            finally:
                client.pool.release(replica)
        await self._request_at(client.url, stream, batch)

    async def _request_at(self, base: str, stream: TTSStream, batch: list, direct: bool = False) -> None:
        http = self.client.http
        if http is None:
            raise EngineUnavailable("the engine is shutting down")
        playing = self.first_audio_at is not None
        body = StreamRequest(self.options, batch, self.deadline_in(), playing).encode()
        timeout = None
        if direct:
            timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=DIRECT_CONNECT_TIMEOUT_S)
        asked_at = time.monotonic()
        try:
            async with http.post(base + STREAM_PATH, data=body, timeout=timeout, allow_redirects=False,
                                 headers={"content-type": "application/json"}) as resp:
                if direct and resp.status not in (200, 400):
                    # Not the replica's answer to a stream (its port taken over, or it
                    # sheds load): nothing was synthesized, so the proxy may place it.
                    raise _NotConnected(f"answered {resp.status}")
                self.client.requests_by_route["direct" if direct else "proxy"] += 1
                self.replica = resp.headers.get(REPLICA_HEADER, self.replica)
                if resp.status == 400:
                    raise EngineStreamError((await resp.text())[:500])
                if resp.status != 200:
                    if playing:
                        self.client.replica_lost(self.replica)
                        raise EngineCrashed(CRASHED_TEXT)
                    raise EngineUnavailable(f"the engine pool answered {resp.status}; try again in a moment")
                try:
                    await self._read_frames(stream, resp)
                finally:
                    if not resp.content.at_eof():
                        resp.close()  # a cancelled stream: the connection goes, and with it the replica's work
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # A connection never made: nothing reached the replica. (A wait for a free
            # connection of this gateway's own pool says nothing about the replica.)
            if direct and not (isinstance(exc, aiohttp.ConnectionTimeoutError)
                               and time.monotonic() - asked_at >= CONNECT_TIMEOUT_S):
                raise _NotConnected(f"no connection ({type(exc).__name__})") from None
            # Not connected at all (the pool down, or every connection busy): nothing
            # crashed. Clients get plain words; the pool's address stays in the log.
            log.warning("cannot reach the engine pool at %s: %s", base, exc)
            if playing:
                self.client.replica_lost(self.replica)
                raise EngineCrashed(CRASHED_TEXT) from None
            raise EngineUnavailable("the engine pool cannot be reached; try again in a moment") from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, asyncio.IncompleteReadError,
                FrameError, asyncio.TimeoutError):
            self.client.replica_lost(self.replica)
            raise EngineCrashed(CRASHED_TEXT) from None
        except aiohttp.ClientConnectionError as exc:
            if playing:
                self.client.replica_lost(self.replica)
                raise EngineCrashed(CRASHED_TEXT) from None
            log.warning("engine pool connection at %s failed: %s", base, exc)
            raise EngineUnavailable("the engine pool cannot be reached; try again in a moment") from None

    async def _read_frames(self, stream: TTSStream, resp: aiohttp.ClientResponse) -> None:
        while True:
            while self.credit <= 0:  # the listener has STREAM_WINDOW chunks waiting: read no further
                self._credit_given.clear()
                await self._credit_given.wait()
            header, data = await asyncio.wait_for(_read_frame(resp.content), self.client.read_timeout_s)
            kind = header["kind"]
            if kind == "end":
                return
            if kind == "error":
                raise EngineStreamError(str(header.get("message", ""))[:500])
            n_pcm = len(data)
            pcm = np.frombuffer(data, dtype=np.int16) if n_pcm else None
            now = time.monotonic()
            if self.first_audio_at is None:
                self.first_audio_at = now
            chunk = chunk_message(self.sid, header, now, n_pcm)
            self.audio_s += (n_pcm // 2) / chunk.sample_rate
            self.credit -= 1
            stream.on_chunk(chunk, pcm)


class _NotConnected(Exception):
    """A listed replica could not be reached, or answered as no replica does: the request never reached its engine."""


async def _read_frame(content: aiohttp.StreamReader) -> tuple[dict, bytes]:
    """One frame: its sizes checked against the caps before either part is read."""
    n_head, n_pcm = frame_sizes(await content.readexactly(FRAME_HEAD.size))
    header = parse_header(await content.readexactly(n_head))
    return header, (await content.readexactly(n_pcm) if n_pcm else b"")


def chunk_message(sid: int, header: dict, received_at: float, n_pcm: int = 0) -> proto.Chunk:
    """A chunk frame's header as the Chunk a TTSStream takes; every field checked (check_chunk),
    since they came over a network."""
    fields = check_chunk(header, n_pcm)
    chunk = proto.Chunk(
        sid=sid, unit_index=fields.unit_index, sample_rate=fields.sample_rate, text=fields.text,
        words=[WordTiming(*w) for w in fields.words], unit_end=fields.unit_end, synth_s=fields.synth_s,
    )
    # The replica's clock is not ours: when its step began, in our time.
    chunk.synth_started_at = received_at - fields.synth_ago_s - chunk.synth_s
    return chunk
