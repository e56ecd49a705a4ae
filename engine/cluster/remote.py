"""The gateway's side of the engine pool: EngineClient's interface over Serve's HTTP ingress.

    client = RemoteEngineClient("http://pool:8000/", EngineConfig())
    await client.start()                     # fetches the pool's voices
    stream = client.stream(options)          # the same TTSStream as the local worker's

Streams are the local client's `TTSStream` (engine/stream.py: text pipeline,
unit numbering, chunk text joining); only the transport differs. This client
is the streams' `StreamTransport` (send_unit, end_input, cancel, credit), as
the local client is; where that one writes each message to the worker's pipe,
this one hands it to the stream's `RemoteTransport`, which sends the units that
are pending as one HTTP request (engine/cluster/pool_protocol.py) with the stream's
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
from typing import Awaitable, Callable

import aiohttp

from .. import proto
from ..runtime.client import EngineClient, EngineConfig
from ..errors import EngineUnavailable
from .pool_protocol import (
    INFO_PATH, MAX_REPLICAS_LISTED, REPLICAS_PATH, REPLICAS_REFRESH_S, STATS_PATH, PoolProtocolError, check_info,
    check_load, parse_replicas,
)
from .remote_stream import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, RemoteTransport
from ..stream import TTSStream

log = logging.getLogger(__name__)

# Connections to the pool at once, for every stream of this gateway together.
MAX_CONNECTIONS = 512
# A replica that could not be reached is not tried again for this long, even if
# the next listing still names it.
FAILED_HOLD_S = 30.0
# The largest answer read from the pool's GET endpoints (its info lists voices).
MAX_JSON_BYTES = 256 * 1024
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




class RemoteEngineClient(EngineClient):
    """EngineClient's interface with a Ray Serve engine pool (engine/cluster/pool.py) instead of a worker process."""

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
        # The replicas' own addresses and their load, as this gateway sees them.
        self.pool = PoolView(self.url, self._get_json)
        self._refresher: asyncio.Future | None = None
        # Requests sent straight to a replica, and through the proxy.
        self.requests_by_route = {"direct": 0, "proxy": 0}

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
            await self.pool.refresh_replicas()
        if not self._closing:
            await self.pool.refresh_load()
            self._refresher = asyncio.ensure_future(self.pool.watch(self.direct))
        self._is_ready = True
        self._started = True

    async def close(self) -> None:
        self._closing = True
        self._is_ready = False
        if self._refresher is not None:
            self._refresher.cancel()
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

    def pool_load(self) -> "PoolLoad | None":
        """What the pool carries, for the gateway's admission (gateway/load/admission.py): `PoolView.load`."""
        return self.pool.load()

    # EngineClient.stream() opens a stream with OpenStream: here, its transport.
    def _send(self, message: proto.ToWorker) -> None:
        if isinstance(message, proto.OpenStream):
            # The transport of OpenStream.after: still open, or ended lately.
            after = message.after
            before = None if after is None else (self._transports.get(after) or self._ended.get(after))
            self._transports[message.sid] = RemoteTransport(
                self, message.sid, message.options, message.start_in_s, message.held_s, before,
            )

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

    # What a stream's RemoteTransport asks of this client (remote_stream.PoolClient)
    @property
    def http(self) -> aiohttp.ClientSession | None:
        """The HTTP client to the pool, from `start` until `close` (None before)."""
        return self._http

    def stream_of(self, sid: int) -> TTSStream | None:
        """The open stream `sid`, if it is still open."""
        return self._streams.get(sid)

    def finish(self, sid: int, error: Exception | None) -> None:
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

    def replica_lost(self, replica: str | None) -> None:
        """A replica died mid-stream: counted once as a restart, and the listeners told."""
        if replica is not None and replica in self._lost_replicas:
            return
        self._lost_replicas.append(replica)
        self.restarts += 1
        log.error("engine pool replica %s stopped mid-stream", replica or "?")
        for listener in self.listeners:
            listener("restart", {"replica": replica})


class PoolView:
    """What one gateway knows of the pool: its replicas' own addresses (which to send a request
    to, and which to leave out for a while) and the load they report, read every few seconds."""

    def __init__(self, url: str, get_json: Callable[..., Awaitable[dict]]) -> None:
        self.url = url  # Serve's proxy
        self._get_json = get_json
        # The replicas' own base URLs (empty: everything goes through the proxy).
        self.replicas: list[str] = []
        self._inflight: dict[str, int] = {}
        self._turn = 0
        # Replicas that could not be reached, and until when they are left out.
        self._failed: dict[str, float] = {}
        # What the replicas carry and can carry (their /v1/stats "load"), added up, and when read.
        self.load_read: PoolLoad | None = None

    async def watch(self, direct: bool) -> None:
        """Read the listing (with `direct`) and the load every REPLICAS_REFRESH_S, until cancelled."""
        while True:
            await asyncio.sleep(REPLICAS_REFRESH_S)
            for read in ((self.refresh_replicas,) if direct else ()) + (self.refresh_load,):
                try:
                    await read()
                except Exception:  # whatever the pool answers, the next read still happens
                    log.exception("engine pool %s failed", read.__name__)

    def load(self) -> "PoolLoad | None":
        """The replicas' load added up, if read within the last few refreshes; else None."""
        load = self.load_read
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
            self.load_read = PoolLoad(capacity, speaking, counted, time.monotonic())

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

    def take(self) -> str | None:
        """The listed replica with the fewest of this gateway's requests open, ties taken in turn,
        counted as open until `release` (None: none listed, use the proxy at `url`)."""
        if not self.replicas:
            return None
        start = self._turn % len(self.replicas)
        self._turn += 1
        ring = self.replicas[start:] + self.replicas[:start]
        replica = min(ring, key=lambda url: self._inflight.get(url, 0))
        self._inflight[replica] = self._inflight.get(replica, 0) + 1
        return replica

    def release(self, url: str) -> None:
        """A request that `take` counted has ended."""
        self._inflight[url] -= 1

    def drop(self, url: str, why: str) -> None:
        """Leave a replica out for FAILED_HOLD_S: its requests go through the proxy."""
        if url in self.replicas:
            log.warning("engine pool replica %s: %s; sending through the proxy for %.0f s", url, why, FAILED_HOLD_S)
            self.replicas = [u for u in self.replicas if u != url]
        if url in self._failed or len(self._failed) < MAX_REPLICAS_LISTED:
            self._failed[url] = time.monotonic() + FAILED_HOLD_S
