"""An engine pool on Ray Serve: one engine per replica, streamed to many gateways.

    voxgate engine serve --host 0.0.0.0 --port 8000      # a local pool, for development
    voxgate serve --engine-url http://pool:8000/         # a gateway that uses it

A replica hosts one engine and the same deadline scheduler as the local worker
(engine/runtime/scheduler.py; the replica's side is engine/cluster/pool_host.py): every request is one stream of that scheduler, so steps of
all the gateways' streams are ordered by playout deadline together, bounded
steps keep a long text from holding a core, and engines that batch (torch,
`max_batch`) batch same-size decoder windows across requests in one pass.
Requests and frames are in engine/cluster/pool_protocol.py.

A request's response is a generator: when the gateway closes the stream, Serve
cancels it, its `finally` cancels the scheduler stream, and the replica's work
on it stops within one step.

With Serve's direct ingress on (`start_local` turns it on; in a cluster, set
RAY_SERVE_ENABLE_DIRECT_INGRESS=1 on every node), each replica also listens
itself, and `GET /v1/replicas` lists those addresses as Serve's controller knows
them: gateways (engine/cluster/remote.py) send their streams there and skip the
proxy's hop, about 5 ms a request here (bench/bench_pool.py).

This module is the deployment and its launcher; the HTTP ingress is
engine/cluster/pool_ingress.py, the gRPC shim engine/cluster/pool_grpc.py, and the read of
Serve's controller engine/cluster/pool_replicas.py, through Ray's private API in engine/cluster/ray_internals.py.

Ray is imported only inside `build_app`, `serve_forever` and the replica, so the gateway can
import this module's neighbours without the `[scale]` extra.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import fields

from . import ray_internals
from .pool_grpc import GRPC_SERVICE, GRPC_SERVICER
from .pool_host import PoolConfig
from .pool_ingress import PoolIngress
from .pool_protocol import REPLICAS_REFRESH_S, STATS_PATH
from .pool_replicas import REPLICAS_CACHE_S

# What callers (voxgate/cli.py, tests, benchmarks) take from here.
__all__ = [
    "APP_NAME", "DEPLOYMENT_NAME", "GRPC_SERVICE", "STATS_PATH", "PoolConfig", "PoolIngress", "app_builder",
    "build_app", "serve_forever", "start_local",
]

log = logging.getLogger(__name__)

APP_NAME = "voxgate-engine"
DEPLOYMENT_NAME = "EnginePool"
SCALE_HINT = 'the engine pool needs Ray Serve: pip install ".[scale]" (in the voxgate clone)'
# Ray Serve's switch for replicas that listen themselves (read when Ray's processes start).
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
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
    voxgate.engine.cluster.pool:app_builder` with `args` naming PoolConfig fields. A
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
    listing = ray_internals.summary(ray_internals.check()) if direct_ingress else "direct ingress off"
    print(f"voxgate engine pool ({config.engine}) on http://{host}:{port}/ ; {listing}; Ctrl-C stops it", flush=True)
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

