"""A pool replica's engine and scheduler (engine/cluster/pool.py deploys it): the worker's
deadline scheduler (engine/runtime/scheduler.py) driven from a thread, every request one of
its streams, and each stream's frames (engine/cluster/pool_protocol.py) handed to the
request that asked for them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from ...config import PoolSettings, threads_or_every_core
from .. import proto
from ..base import SynthesisOptions
from ..runtime.capacity import calibrate
from ..runtime.codec import pack
from .pool_protocol import StreamRequest
from ..registry import create_engine
from ..runtime.scheduler import Scheduler

log = logging.getLogger(__name__)

# Chunks a request may have made ahead of what its response has handed on.
REQUEST_WINDOW = 3


@dataclass
class PoolConfig:
    """A deployment's settings; the defaults are `voxgate engine serve`'s (voxgate/config.py)."""

    engine: str = PoolSettings.engine
    voice: str | None = PoolSettings.voice
    voice_dir: str | None = PoolSettings.voice_dir
    device: str = PoolSettings.device
    parallel: int = 0  # synthesis steps at once per replica; 0: one per CPU the replica has
    threads: int = 0  # intra-op threads per step; 0: every CPU the replica has
    num_cpus: float = PoolSettings.replica_cpus
    num_gpus: float = PoolSettings.num_gpus  # a fraction shares one GPU between replicas
    min_replicas: int = PoolSettings.min_replicas
    max_replicas: int = PoolSettings.max_replicas
    # Streams a replica aims to serve at once (autoscaling) and takes at most.
    target_ongoing_requests: int = PoolSettings.target_ongoing_requests
    max_ongoing_requests: int = PoolSettings.max_ongoing_requests
    log_level: str = PoolSettings.log_level
    # More keyword arguments for the engine's constructor (the cosyvoice2 model, say).
    engine_options: dict = field(default_factory=dict)


@dataclass
class OpenRequest:
    """One HTTP request, as the scheduler thread takes it: a stream opened, its units, its end."""

    sid: int
    request: StreamRequest


class PoolScheduler(Scheduler):
    """The worker's scheduler, with streams that resume playback: a request for a
    stream the listener already hears is ranked by its deadline, not as a first window."""

    def open_request(self, item: OpenRequest) -> None:
        sid, request = item.sid, item.request
        self.handle(proto.OpenStream(sid, request.options, REQUEST_WINDOW, request.start_in_s))
        stream = self.streams[sid]
        if request.playing:
            # deadline() = first_sent_at + audio_s: when the listener runs dry.
            stream.first_sent_at = stream.start_at
            stream.chunks_sent = 1
        for index, payload in request.units:
            self.handle(proto.PushUnit(sid, index, payload))
        self.handle(proto.EndInput(sid))


class EngineHost:
    """One engine and its scheduler, driven from a thread; streams are async generators of frames."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        cores = threads_or_every_core(config.num_cpus)  # the replica's CPUs; under one: every core
        options = {**config.engine_options, "voice": config.voice, "device": config.device, "voice_dir": config.voice_dir,
                   "threads": config.threads or cores}
        self.engine = create_engine(config.engine, **options)
        t0 = time.perf_counter()
        self.engine.load()
        self.info = self.engine.info()
        self.info["load_s"] = time.perf_counter() - t0
        self.info["pid"] = os.getpid()
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        self._ids = itertools.count(1)
        self._outboxes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        parallel = config.parallel or cores
        # What synthesis costs on this replica's cores, measured now and kept current by its
        # steps: its load report (in /v1/stats) is the pool's budget for gateways (engine/runtime/capacity.py).
        self.cost = calibrate(self.engine, parallel)
        self.info["synthesis_cost"] = self.cost.per_audio_s
        self.last_load: proto.Load | None = None
        self.scheduler = PoolScheduler(self.engine, send=self._send, parallel=parallel, cost=self.cost)
        # The last request's deadline as the replica saw it (tests read it from /v1/stats).
        self.requests = 0
        self.last_start_in_s: float | None = None
        self.last_playing: bool | None = None
        self._thread = threading.Thread(target=self._run, name="pool-scheduler", daemon=True)
        self._thread.start()

    def _send(self, message: proto.FromWorker, pcm=None) -> None:
        """From the scheduler thread: a stream's Chunk, StreamDone or StreamError, to its request;
        the scheduler's load report, kept for /v1/stats."""
        if isinstance(message, proto.Load):
            self.last_load = message
            return
        target = self._outboxes.get(getattr(message, "sid", None))
        if target is None:
            return
        loop, box = target
        try:
            loop.call_soon_threadsafe(box.put_nowait, (message, pcm))
        except RuntimeError:
            pass  # the request's loop is gone

    def _run(self) -> None:
        self.scheduler.serve(self._handle)
        self.engine.close()

    def _handle(self, item) -> bool:
        if isinstance(item, OpenRequest):
            self.scheduler.open_request(item)
            return True
        return self.scheduler.handle(item)

    def stats(self) -> dict:
        counters = dict(self.scheduler.counters)
        load = self.last_load
        return dict(counters, streams=len(self.scheduler.streams), requests=self.requests,
                    last_start_in_s=self.last_start_in_s,
                    last_playing=self.last_playing, replica=self.replica_id,
                    # What it carries and can carry, in listeners at 1x real time (null until the first report).
                    load=None if load is None else {
                        "capacity": load.capacity if math.isfinite(load.capacity) else None,
                        "speaking": load.speaking, "waiting": load.waiting, "cost": load.cost,
                        "underruns": load.underruns,
                    })

    async def stream(self, request: StreamRequest):
        """The frames of one request, ending with an `end` or `error` frame."""
        SynthesisOptions.from_dict(request.options)  # refuses a bad rate before any work
        sid = next(self._ids)
        box: asyncio.Queue = asyncio.Queue()
        self._outboxes[sid] = (asyncio.get_running_loop(), box)
        self.requests += 1
        self.last_start_in_s = request.start_in_s
        self.last_playing = request.playing
        self.scheduler.inbox.put(OpenRequest(sid, request))
        finished = False
        try:
            while True:
                message, pcm = await box.get()
                if isinstance(message, proto.Chunk):
                    yield pack(message, pcm)
                    self.scheduler.inbox.put(proto.Credit(sid, 1))
                elif isinstance(message, proto.StreamDone):
                    finished = True
                    yield pack(message)
                    return
                elif isinstance(message, proto.StreamError):
                    finished = True
                    log.warning("engine refused a stream: %s", message.message)
                    yield pack(proto.StreamError(sid, message.message[:500]))
                    return
        finally:
            # Closed by the gateway (Serve cancels the generator) or done: either
            # way this stream's steps stop here.
            self._outboxes.pop(sid, None)
            if not finished:
                self.scheduler.inbox.put(proto.CancelStream(sid))

    def close(self) -> None:
        self.scheduler.inbox.put(proto.Shutdown())
