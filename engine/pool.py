"""An engine pool on Ray Serve: one engine per replica, streamed to many gateways.

    voxgate engine serve --host 0.0.0.0 --port 8000      # a local pool, for development
    voxgate serve --engine-url http://pool:8000/         # a gateway that uses it

A replica hosts one engine and the same deadline scheduler as the local worker
(engine/worker.py): every request is one stream of that scheduler, so steps of
all the gateways' streams are ordered by playout deadline together, bounded
steps keep a long text from holding a core, and engines that batch (torch,
`max_batch`) batch same-size decoder windows across requests in one pass.
Requests and frames are in engine/pool_protocol.py.

A request's response is a generator: when the gateway closes the stream, Serve
cancels it, its `finally` cancels the scheduler stream, and the replica's work
on it stops within one step.

With Serve's direct ingress on (`start_local` turns it on; in a cluster, set
RAY_SERVE_ENABLE_DIRECT_INGRESS=1 on every node), each replica also listens
itself, and `GET /v1/replicas` lists those addresses as Serve's controller knows
them: gateways (engine/remote.py) send their streams there and skip the
proxy's hop, about 5 ms a request here (bench/bench_pool.py).

Ray is imported only inside `build_app`, `serve_forever` and the replica, so the gateway can
import this module's neighbours without the `[scale]` extra.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field, fields

from ..config import PoolSettings, threads_or_every_core
from ..logs import setup_logging
from . import proto
from .base import SynthesisOptions
from .capacity import calibrate
from .pool_protocol import (
    INFO_PATH, MAX_REPLICAS_LISTED, REPLICA_HEADER, REPLICAS_PATH, REPLICAS_REFRESH_S, STATS_PATH, STREAM_PATH, PoolProtocolError, StreamRequest,
    pack_frame, replica_url,
)
from .registry import create_engine
from .scheduler import Scheduler

log = logging.getLogger(__name__)

APP_NAME = "voxgate-engine"
DEPLOYMENT_NAME = "EnginePool"
# Chunks a request may have made ahead of what its response has handed on.
REQUEST_WINDOW = 3
SCALE_HINT = "the engine pool needs Ray Serve: pip install 'voxgate[scale]'"
# Ray Serve's switch for replicas that listen themselves (read when Ray's processes start).
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# How long a replica reuses its listing of the replicas: gateways ask every few
# seconds, and anyone on the pool's network may ask, so the controller is asked
# at most once per this.
REPLICAS_CACHE_S = 2.0
LISTING_TIMEOUT_S = 2.0
# Serve's gRPC ingress takes messages up to 2 GiB by default; a request body is
# at most MAX_REQUEST_BYTES and a frame a few MiB (pool_protocol's caps).
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
GRPC_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# A replica Serve stops keeps serving its own port this long (Serve's default is
# 30 s, for external load balancers): a gateway's 5 s refresh plus this
# replica's 2 s cache, so a gateway that reads its listing on time sends it no
# new stream it would cut (one whose refresh failed is refused, and uses the proxy).
DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAIN_S = REPLICAS_REFRESH_S + REPLICAS_CACHE_S + 1.0


def require_ray():
    """Ray and Serve, or a clear error naming the extra that brings them."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise RuntimeError(f"{SCALE_HINT} ({exc})") from None
    return ray, serve


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
        # steps: its load report (in /v1/stats) is the pool's budget for gateways (engine/capacity.py).
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
                    yield pack_frame(chunk_header(message), pcm)
                    self.scheduler.inbox.put(proto.Credit(sid, 1))
                elif isinstance(message, proto.StreamDone):
                    finished = True
                    yield pack_frame({"kind": "end"})
                    return
                elif isinstance(message, proto.StreamError):
                    finished = True
                    log.warning("engine refused a stream: %s", message.message)
                    yield pack_frame({"kind": "error", "message": message.message[:500]})
                    return
        finally:
            # Closed by the gateway (Serve cancels the generator) or done: either
            # way this stream's steps stop here.
            self._outboxes.pop(sid, None)
            if not finished:
                self.scheduler.inbox.put(proto.CancelStream(sid))

    def close(self) -> None:
        self.scheduler.inbox.put(proto.Shutdown())


def chunk_header(msg: proto.Chunk) -> dict:
    """A Chunk as a frame header. The replica's clock is not the gateway's: when
    the step began travels as how long ago it began."""
    return {
        "kind": "chunk", "sample_rate": msg.sample_rate, "text": msg.text,
        "words": [(w.text, float(w.start), float(w.end)) for w in msg.words],
        "unit_index": msg.unit_index, "unit_end": msg.unit_end, "synth_s": msg.synth_s,
        "synth_ago_s": max(0.0, time.monotonic() - msg.synth_started_at),
    }


class ReplicaListing:
    """The addresses of the pool's replicas where they listen themselves (Serve's
    direct ingress), read from Serve's controller and cached for REPLICAS_CACHE_S.

    Serve has no public call for these addresses in Ray 2.60 (its HAProxy
    integration reads them the same way), so this reads the controller's
    `get_target_groups`; if a Ray upgrade changes it, the listing is empty, the
    log says why, and gateways keep using the proxy. The controller is looked up
    once, off the event loop, and each read is bounded by LISTING_TIMEOUT_S."""

    def __init__(self) -> None:
        self._at = -math.inf
        self._value: dict = {"replicas": []}
        self._lock: asyncio.Lock | None = None
        self._controller = None

    async def get(self) -> dict:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._at >= REPLICAS_CACHE_S:
                try:
                    self._value = await asyncio.wait_for(self._read(), LISTING_TIMEOUT_S)
                except Exception as exc:  # Ray's private API moved, or the controller is slow: the proxy still works
                    log.warning("cannot list the replicas' own addresses (%s: %s); gateways use Serve's proxy",
                                type(exc).__name__, exc)
                    self._value = {"replicas": [], "reason": type(exc).__name__}
                self._at = time.monotonic()
        return self._value

    async def _read(self) -> dict:
        import ray
        from ray import serve
        from ray.serve._private.common import RequestProtocol
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        if self._controller is None:  # a blocking call to Ray's GCS: not on the loop that streams frames
            self._controller = await asyncio.to_thread(ray.get_actor, SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller = self._controller
        app = serve.get_replica_context().app_name
        groups, http = await asyncio.gather(controller.get_target_groups.remote(app), controller.get_http_config.remote())
        bind = _literal_ip(http.host)
        replicas = []
        for group in groups:
            if group.protocol != RequestProtocol.HTTP or group.app_name != app:
                continue
            for target in group.targets:
                # Without direct ingress (or before a replica runs) Serve lists its proxies here instead.
                if not target.name.startswith("SERVE_REPLICA::"):
                    continue
                # A replica listens where Serve's HTTP options say; the node's address only when that is every address.
                host = target.ip if bind is None or bind.is_unspecified else str(bind)
                replicas.append({"url": replica_url(host, target.port, group.route_prefix), "id": target.name})
        return {"replicas": replicas[:MAX_REPLICAS_LISTED]}


def _literal_ip(host: str | None):
    try:
        return ipaddress.ip_address(host or "")
    except ValueError:
        return None


class PoolIngress:
    """The Serve deployment's class: HTTP in, a streamed body of frames out."""

    def __init__(self, config: PoolConfig) -> None:
        setup_logging(config.log_level)
        self.host = EngineHost(config)
        self.listing = ReplicaListing()

    # Serve's gRPC ingress (start_local's grpc_port): the same bytes as over HTTP.
    async def Stats(self, request: bytes) -> "RawMessage":
        return RawMessage(json.dumps(self.host.stats()).encode())

    async def Stream(self, request: bytes):
        """A StreamRequest body in, frames out; a bad request is one `error` frame."""
        try:
            stream_request = StreamRequest.decode(bytes(request))
            SynthesisOptions.from_dict(stream_request.options)
        except (PoolProtocolError, ValueError, TypeError) as exc:
            yield RawMessage(pack_frame({"kind": "error", "message": str(exc)[:500]}))
            return
        async for frame in self.host.stream(stream_request):
            yield RawMessage(frame)

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        path = request.url.path.rstrip("/")
        root = request.scope.get("root_path", "").rstrip("/")  # the app's route prefix, when it is not "/"
        if root and path.startswith(root):
            path = path[len(root):]
        if request.method == "GET" and path == INFO_PATH:
            return JSONResponse(self.host.info)
        if request.method == "GET" and path == STATS_PATH:
            return JSONResponse(self.host.stats())
        if request.method == "GET" and path == REPLICAS_PATH:
            return JSONResponse(await self.listing.get())
        if request.method != "POST" or path != STREAM_PATH:
            return JSONResponse({"error": "not_found", "message": f"use POST {STREAM_PATH}"}, status_code=404)
        try:
            body = await _read_capped(request)
            stream_request = StreamRequest.decode(body)
            SynthesisOptions.from_dict(stream_request.options)
        except (PoolProtocolError, ValueError, TypeError) as exc:
            return JSONResponse({"error": "bad_request", "message": str(exc)}, status_code=400)
        return StreamingResponse(
            self.host.stream(stream_request), media_type="application/octet-stream",
            headers={REPLICA_HEADER: self.host.replica_id},
        )

    def __del__(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            host.close()


GRPC_SERVICE = "voxgate.EnginePool"
GRPC_SERVICER = "voxgate.engine.pool:add_EnginePoolServicer_to_server"


class RawMessage:
    """What a Serve replica hands back over gRPC: it calls SerializeToString on each message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data


def add_EnginePoolServicer_to_server(servicer, server) -> None:  # noqa: N802 (the name gRPC codegen would give)
    """The pool's gRPC service for Serve's `grpc_servicer_functions`, written by hand
    instead of generated: requests and responses are raw bytes (no serializers), the
    same StreamRequest body and frames as the HTTP ingress.

        /voxgate.EnginePool/Stats   b""            -> the replica's stats as JSON
        /voxgate.EnginePool/Stream  StreamRequest  -> frames, one message each
    """
    import grpc

    handlers = {
        "Stats": grpc.unary_unary_rpc_method_handler(servicer.Stats),
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))


async def _read_capped(request) -> bytes:
    from .pool_protocol import MAX_REQUEST_BYTES

    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_REQUEST_BYTES:
            raise PoolProtocolError(f"request body over {MAX_REQUEST_BYTES} bytes")
    return bytes(body)


def build_app(config: PoolConfig):
    """The Serve application: one deployment, autoscaled on ongoing requests."""
    _, serve = require_ray()
    actor_options: dict = {"num_cpus": config.num_cpus}
    if config.num_gpus:
        actor_options["num_gpus"] = config.num_gpus
    deployment = serve.deployment(
        PoolIngress,
        name=DEPLOYMENT_NAME,
        ray_actor_options=actor_options,
        max_ongoing_requests=config.max_ongoing_requests,
        autoscaling_config={
            "min_replicas": config.min_replicas,
            "max_replicas": max(config.min_replicas, config.max_replicas),
            "target_ongoing_requests": config.target_ongoing_requests,
        },
        # A replica killed mid-speech is replaced quickly; its streams end at the gateways.
        health_check_period_s=2.0,
    )
    return deployment.bind(config)


def app_builder(args: dict):
    """For Serve config files (KubeRay's serveConfigV2): `import_path:
    voxgate.engine.pool:app_builder` with `args` naming PoolConfig fields. A
    config file's `deployments:` entry may override the replica options."""
    known = {f.name for f in fields(PoolConfig)}
    unknown = sorted(set(args or {}) - known)
    if unknown:
        raise ValueError(f"unknown engine pool args {unknown}; use {sorted(known)}")
    return build_app(PoolConfig(**(args or {})))


def start_local(config: PoolConfig, host: str, port: int, num_cpus: int | None = None,
                name: str = APP_NAME, route_prefix: str = "/", direct_ingress: bool = True,
                grpc_port: int | None = None, num_gpus: int | None = None) -> None:
    """Start (or join) a local Ray, start Serve's HTTP proxy on host:port and deploy the pool.

    With `direct_ingress`, each replica also listens on host (Serve picks ports
    from 30000 up) and gateways reach it without the proxy's hop. Ray's processes
    read the switch when they start, so it applies only to a Ray this call starts.
    With `grpc_port`, Serve's gRPC proxy listens there too (and each replica on a
    port from 40000 up, with direct ingress); bench/bench_pool.py compares the two.
    `num_gpus` tells a Ray this call starts how many GPUs it has (None: Ray detects them)."""
    ray, serve = require_ray()
    if not ray.is_initialized():
        os.environ[DIRECT_INGRESS_ENV] = "1" if direct_ingress else "0"
        os.environ.setdefault(DRAIN_ENV, str(DRAIN_S))
        os.environ.setdefault(GRPC_MAX_MESSAGE_ENV, str(GRPC_MAX_MESSAGE_BYTES))
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    grpc_options = {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]} if grpc_port else None
    serve.start(http_options={"host": host, "port": port}, grpc_options=grpc_options)
    serve.run(build_app(config), name=name, route_prefix=route_prefix)


def serve_forever(config: PoolConfig, host: str, port: int, num_cpus: int | None = None,
                  direct_ingress: bool = True) -> None:
    """`voxgate engine serve`: a local pool until interrupted."""
    ray, serve = require_ray()
    start_local(config, host, port, num_cpus, direct_ingress=direct_ingress)
    print(f"voxgate engine pool ({config.engine}) on http://{host}:{port}/ ; Ctrl-C stops it", flush=True)
    stop = threading.Event()
    try:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()

