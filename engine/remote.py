"""The gateway's side of the engine pool: EngineClient's interface over Serve's HTTP ingress.

    client = RemoteEngineClient("http://pool:8000/", EngineConfig())
    await client.start()                     # fetches the pool's voices
    stream = client.stream(options)          # the same TTSStream as the local worker's

Streams are the local client's `TTSStream` (engine/stream.py: text pipeline,
unit numbering, chunk text joining); only the transport differs. This client
is the streams' `StreamTransport` (send_unit, end_input, cancel, credit), as
the local client is; where that one writes each message to the worker's pipe,
this one hands it to the stream's `RemoteTransport`, which sends the units that
are pending as one HTTP request (engine/pool_protocol.py) with the stream's
playout deadline, and reads the response's frames into the stream, as many as
the stream's credit allows.

Where the pool lists its replicas' own addresses (Serve's direct ingress,
`GET /v1/replicas`), each request goes straight to the replica with the fewest
of this gateway's requests, skipping the proxy's hop; the listing is refreshed
every few seconds, a replica that cannot be connected to is dropped from it, and
that request goes through the proxy instead.

A replica that dies mid-stream cuts its responses short (no `end` frame): those
streams end with EngineCrashed, as with the local worker; Serve replaces the
replica and the next utterance goes to a live one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import aiohttp
import numpy as np

from . import proto
from .base import WordTiming
from .client import STREAM_WINDOW, EngineClient, EngineConfig
from .errors import EngineCrashed, EngineStreamError, EngineUnavailable
from .pool_protocol import (
    FRAME_HEAD, INFO_PATH, MAX_REPLICAS_LISTED, MAX_UNITS_PER_REQUEST, REPLICA_HEADER, REPLICAS_PATH, REPLICAS_REFRESH_S, STATS_PATH, STREAM_PATH, PoolProtocolError,
    StreamRequest, check_chunk, check_info, check_load, frame_sizes, parse_header, parse_replicas,
)
from .stream import TTSStream

log = logging.getLogger(__name__)

# Connections to the pool at once, for every stream of this gateway together.
MAX_CONNECTIONS = 512
CONNECT_TIMEOUT_S = 5.0
# A listed replica that does not answer a connection within this long is taken
# for unreachable from here (a firewall, a route, a dead node still listed), and
# the request goes through the proxy: a playing stream must not wait 5 s.
DIRECT_CONNECT_TIMEOUT_S = 1.0
# A replica that could not be reached is not tried again for this long, even if
# the next listing still names it.
FAILED_HOLD_S = 30.0
# The largest answer read from the pool's GET endpoints (its info lists voices).
MAX_JSON_BYTES = 256 * 1024
# The longest wait for the next frame while the stream wants one: a replica
# serves urgent streams first, so a stream with audio to spare can wait seconds.
READ_TIMEOUT_S = 60.0
# Replica ids remembered to count each lost replica once.
MAX_LOST_REPLICAS = 64

# A pool's load read longer ago than this counts as unknown; each read waits this long at most.
LOAD_STALE_S = 3 * REPLICAS_REFRESH_S
LOAD_TIMEOUT_S = 2.0


@dataclass
class PoolLoad:
    """The pool's replicas together: listeners they can keep speaking (inf: one not measured
    yet) and keep speaking now, for every gateway that uses them."""

    capacity: float
    speaking: float
    replicas: int
    read_at: float


CRASHED_TEXT = "the engine pool's replica stopped unexpectedly; it is being restarted and the next utterance goes to a live replica"


class RemoteEngineClient(EngineClient):
    """EngineClient's interface with a Ray Serve engine pool (engine/pool.py) instead of a worker process."""

    def __init__(self, url: str, config: EngineConfig | None = None, read_timeout_s: float = READ_TIMEOUT_S,
                 direct: bool = True) -> None:
        super().__init__(config)
        self.url = url.rstrip("/")
        self.read_timeout_s = read_timeout_s
        self.direct = direct
        self._http: aiohttp.ClientSession | None = None
        self._transports: dict[int, RemoteTransport] = {}
        # Streams that ended lately, oldest first, for OpenStream.after (at most proto.MAX_ENDED).
        self._ended: "OrderedDict[int, RemoteTransport]" = OrderedDict()
        self._is_ready = False
        self._lost_replicas: deque = deque(maxlen=MAX_LOST_REPLICAS)
        # The replicas' own base URLs (empty: everything goes through self.url, Serve's proxy).
        self.replicas: list[str] = []
        self._inflight: dict[str, int] = {}
        self._turn = 0
        self._refresher: asyncio.Future | None = None
        # Replicas that could not be reached, and until when they are left out.
        self._failed: dict[str, float] = {}
        # Requests sent straight to a replica, and through the proxy.
        self.requests_by_route = {"direct": 0, "proxy": 0}
        # What the replicas carry and can carry (their /v1/stats "load"), added up, and when read.
        self._pool_load: PoolLoad | None = None
        self._load_watch: asyncio.Future | None = None

    # Lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS),
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S),
        )
        deadline = time.monotonic() + self.config.start_timeout
        delay = 0.1
        while True:
            try:
                self.info = check_info(await self._get_json(INFO_PATH))
                break
            except PoolProtocolError as exc:  # it answered, with what no engine says: waiting will not help
                await self._http.close()
                raise EngineUnavailable(f"the engine pool at {self.url} answered /v1/info out of range: {exc}") from None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                if time.monotonic() + delay > deadline:
                    await self._http.close()
                    raise EngineUnavailable(
                        f"the engine pool at {self.url} did not answer within {self.config.start_timeout:.0f} s "
                        f"({type(exc).__name__}); start it with `voxgate engine serve` or fix --engine-url"
                    ) from None
                await asyncio.sleep(delay)  # the pool may still be deploying
                delay = min(delay * 2, 2.0)
        if self.direct and not self._closing:
            await self.refresh_replicas()
            self._refresher = asyncio.ensure_future(self._refresh_forever())
        if not self._closing:
            await self.refresh_load()
            self._load_watch = asyncio.ensure_future(self._watch_load())
        self._is_ready = True
        self._started = True

    async def close(self) -> None:
        self._closing = True
        self._is_ready = False
        if self._refresher is not None:
            self._refresher.cancel()
        if self._load_watch is not None:
            self._load_watch.cancel()
        self._fail_all(EngineUnavailable("the engine is shutting down"))
        for transport in list(self._transports.values()):
            transport.cancel()
        if self._http is not None:
            await self._http.close()

    @property
    def ready(self) -> bool:
        return self._is_ready

    @property
    def worker_pid(self) -> int | None:
        return None  # the engine runs in the pool's replicas

    async def worker_stats(self, timeout: float = 5.0) -> dict:
        """The scheduler counters of the replica that answers (one of the pool's)."""
        return await asyncio.wait_for(self._get_json(STATS_PATH), timeout)

    async def _get_json(self, path: str, base: str | None = None, timeout_s: float = 10.0) -> dict:
        assert self._http is not None
        async with self._http.get((base or self.url) + path, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                  allow_redirects=False) as resp:
            if resp.status != 200:
                raise ValueError(f"{path} answered {resp.status}")
            body = await resp.content.read(MAX_JSON_BYTES + 1)
        if len(body) > MAX_JSON_BYTES:
            raise ValueError(f"{path} answered over {MAX_JSON_BYTES} bytes")
        try:
            data = json.loads(body)
        except RecursionError:  # nested past Python's limit: refused like any bad answer
            raise ValueError(f"{path} answered JSON nested too deep") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} answered no object")
        return data

    # What the pool carries: the gateway's admission plans with it (gateway/admission.py)
    def pool_load(self) -> "PoolLoad | None":
        """The replicas' load added up, if read within the last few refreshes; else None."""
        load = self._pool_load
        if load is None or time.monotonic() - load.read_at > LOAD_STALE_S:
            return None
        return load

    async def refresh_load(self) -> None:
        """Read every listed replica's load (or, with none listed, the one the proxy picks)."""
        bases = list(self.replicas) or [self.url]

        async def one(base: str) -> dict | None:
            try:
                load = (await self._get_json(STATS_PATH, base, LOAD_TIMEOUT_S)).get("load")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None
            return load if isinstance(load, dict) else None

        loads = [load for load in await asyncio.gather(*(one(base) for base in bases)) if load is not None]
        if not loads:
            return
        capacity = speaking = 0.0
        counted = 0
        for load in loads:
            try:
                cap, spk = check_load(load)
            except PoolProtocolError as exc:  # that replica's report is left out, the others still count
                log.warning("engine pool: a replica's load report refused: %s", exc)
                continue
            capacity = math.inf if cap is None else capacity + cap  # None: a replica that has not measured yet
            speaking += spk
            counted += 1
        if counted:
            self._pool_load = PoolLoad(capacity, speaking, counted, time.monotonic())

    async def _watch_load(self) -> None:
        while not self._closing:
            await asyncio.sleep(REPLICAS_REFRESH_S)
            try:
                await self.refresh_load()
            except Exception:  # whatever a replica answers, the next read still happens
                log.exception("engine pool load not read")

    # The replicas' own addresses
    async def refresh_replicas(self) -> None:
        """Read the pool's listing of its replicas (through the proxy). A pool
        without direct ingress, or an older one, lists none; a failed read keeps
        the last listing, since the replicas may be fine while the proxy is not."""
        try:
            listed = parse_replicas(await self._get_json(REPLICAS_PATH))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            if isinstance(exc, ValueError) and "answered 404" in str(exc):
                self.replicas = []  # a pool that predates the listing
            log.debug("engine pool replica listing not read: %s", exc)
            return
        now = time.monotonic()
        self._failed = {url: until for url, until in self._failed.items() if until > now}
        listed = [url for url in listed if url not in self._failed]
        if listed != self.replicas:
            log.info("engine pool: %d replica(s) reached directly", len(listed))
        self.replicas = listed
        self._inflight = {url: n for url, n in self._inflight.items() if url in listed or n}

    async def _refresh_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(REPLICAS_REFRESH_S)
            try:
                await self.refresh_replicas()
            except Exception:  # whatever a listing does, the next one is still read
                log.exception("engine pool replica listing failed")

    def _pick_replica(self) -> str | None:
        """The listed replica with the fewest of this gateway's requests open, ties taken in turn."""
        if not self.replicas:
            return None
        start = self._turn % len(self.replicas)
        self._turn += 1
        ring = self.replicas[start:] + self.replicas[:start]
        return min(ring, key=lambda url: self._inflight.get(url, 0))

    def _drop_replica(self, url: str, why: str) -> None:
        """Leave a replica out for FAILED_HOLD_S: its requests go through the proxy."""
        if url in self.replicas:
            log.warning("engine pool replica %s: %s; sending through the proxy for %.0f s", url, why, FAILED_HOLD_S)
            self.replicas = [u for u in self.replicas if u != url]
        if url in self._failed or len(self._failed) < MAX_REPLICAS_LISTED:
            self._failed[url] = time.monotonic() + FAILED_HOLD_S

    # EngineClient.stream() opens a stream with OpenStream: here, its transport.
    def _send(self, message: proto.ToWorker) -> None:
        if isinstance(message, proto.OpenStream):
            self._transports[message.sid] = RemoteTransport(
                self, message.sid, message.options, message.start_in_s, message.held_s,
                self._before(message.after),
            )

    def _before(self, sid: int | None) -> "RemoteTransport | None":
        """The transport of OpenStream.after: still open, or ended lately."""
        if sid is None:
            return None
        return self._transports.get(sid) or self._ended.get(sid)

    # StreamTransport: what a TTSStream asks of this client
    def send_unit(self, sid: int, index: int, payload: proto.UnitPayload) -> None:
        transport = self._transports.get(sid)
        if transport is not None:
            transport.push_unit(index, payload)

    def end_input(self, sid: int) -> None:
        transport = self._transports.get(sid)
        if transport is not None:
            transport.end_input()

    def cancel(self, sid: int) -> None:
        self._streams.pop(sid, None)
        transport = self._transports.pop(sid, None)
        if transport is not None:
            transport.cancel()

    def credit(self, sid: int, chunks: int) -> None:
        transport = self._transports.get(sid)
        if transport is not None:
            transport.add_credit(chunks)

    def _finish(self, sid: int, error: Exception | None) -> None:
        """A stream's last word, from its transport: done, or failed with `error`."""
        transport = self._transports.pop(sid, None)
        if transport is not None:
            transport.done = True  # finished or failed: a stream queued behind it follows its audio
            self._ended[sid] = transport
            while len(self._ended) > proto.MAX_ENDED:
                self._ended.popitem(last=False)
        stream = self._streams.pop(sid, None)
        if stream is None:
            return
        if error is None:
            stream.on_done()
        else:
            stream.on_error(error)

    def _replica_lost(self, replica: str | None) -> None:
        if replica is not None and replica in self._lost_replicas:
            return
        self._lost_replicas.append(replica)
        self.restarts += 1
        log.error("engine pool replica %s stopped mid-stream", replica or "?")
        for listener in self.listeners:
            listener("restart", {"replica": replica})


class RemoteTransport:
    """One stream's requests to the pool: units out in order, frames in, within the stream's credit."""

    def __init__(
        self, client: RemoteEngineClient, sid: int, options: dict, start_in_s: float, held_s: float = 0.0,
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
        stream = self.client._streams.get(self.sid)
        if stream is None:
            return
        try:
            while True:
                while not self.units and not self.ended:
                    self._wake.clear()
                    await self._wake.wait()
                if not self.units:
                    self.client._finish(self.sid, None)
                    return
                batch = [self.units.popleft() for _ in range(min(len(self.units), MAX_UNITS_PER_REQUEST))]
                await self._request(stream, batch)
        except (EngineCrashed, EngineStreamError, EngineUnavailable) as exc:
            self.client._finish(self.sid, exc)
        except Exception as exc:  # a bug here must end the stream, never leave its reader waiting
            log.exception("engine pool stream failed")
            self.client._finish(self.sid, EngineUnavailable(f"the engine pool stream failed: {type(exc).__name__}"))

    async def _request(self, stream: TTSStream, batch: list) -> None:
        """One request: straight to a replica when the pool lists them, else (or if
        that replica cannot be connected to, so nothing reached it) through the proxy."""
        client = self.client
        replica = client._pick_replica()
        if replica is not None:
            client._inflight[replica] = client._inflight.get(replica, 0) + 1
            try:
                await self._request_at(replica, stream, batch, direct=True)
                return
            except _NotConnected as exc:
                client._drop_replica(replica, str(exc))
            finally:
                client._inflight[replica] -= 1
        await self._request_at(client.url, stream, batch)

    async def _request_at(self, base: str, stream: TTSStream, batch: list, direct: bool = False) -> None:
        http = self.client._http
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
                        self.client._replica_lost(self.replica)
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
                self.client._replica_lost(self.replica)
                raise EngineCrashed(CRASHED_TEXT) from None
            raise EngineUnavailable("the engine pool cannot be reached; try again in a moment") from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, asyncio.IncompleteReadError,
                PoolProtocolError, asyncio.TimeoutError):
            self.client._replica_lost(self.replica)
            raise EngineCrashed(CRASHED_TEXT) from None
        except aiohttp.ClientConnectionError as exc:
            if playing:
                self.client._replica_lost(self.replica)
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
