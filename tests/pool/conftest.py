"""One real Ray Serve engine pool (tone engine, one replica, 2 CPUs) for every pool test.

Ray's startup dominates these tests, so the pool is started once for this
folder and shared (package scope: Ray is shut down before the rest of the suite
runs); tests that kill its replica wait for Serve to replace it.
Without the `[scale]` extra the tests skip, which fails the run under CI=true.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
import json

import pytest

from tests.conftest import ServerProcess, free_port

ray = pytest.importorskip("ray", reason='the engine pool tests need Ray Serve: pip install ".[scale]" in the clone')
serve = pytest.importorskip("ray.serve")

from voxgate.engine.cluster.pool import APP_NAME, PoolConfig, start_local  # noqa: E402
from voxgate.engine.cluster.pool_protocol import STATS_PATH  # noqa: E402


class Pool:
    def __init__(self, url: str, grpc_address: str) -> None:
        self.url = url
        self.grpc_address = grpc_address  # Serve's gRPC proxy

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + STATS_PATH.lstrip("/"), timeout=10) as resp:
            return json.loads(resp.read())

    async def wait_stats(self, predicate, timeout: float = 20.0) -> dict:
        """The replica's counters once they satisfy `predicate` (polled: they live in another process)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = await asyncio.to_thread(self.stats)
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"replica stats never matched within {timeout} s: {stats}")
            await asyncio.sleep(0.05)

    def replica_actors(self) -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::") and APP_NAME in a["name"]]

    def kill_replica(self) -> str:
        """Kill the replica actor as a crash would; Serve's controller starts a new one."""
        (name,) = self.replica_actors()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name


@pytest.fixture(scope="package")
def pool():
    port, grpc_port = free_port(), free_port()
    # parallel=1: the tone engine is instant; one step at a time keeps the order simple to reason about.
    start_local(PoolConfig(engine="tone", num_cpus=1, parallel=1), "127.0.0.1", port, num_cpus=2, grpc_port=grpc_port)
    yield Pool(f"http://127.0.0.1:{port}/", f"127.0.0.1:{grpc_port}")
    # Ray's shutdown alone ends Serve's processes with it. serve.shutdown() first would wait
    # out the replicas' draining period (engine.cluster.pool.DRAIN_S, 8 s) for gateways long gone.
    ray.shutdown()


@pytest.fixture(scope="package")
def pool_gateway(pool):
    """A real gateway process (`voxgate serve --engine-url`) that synthesizes on the pool."""
    server = ServerProcess("tone", extra=["--engine-url", pool.url])
    yield server
    server.stop()
