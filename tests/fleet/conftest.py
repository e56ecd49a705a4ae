"""A fleet on loopback: Debian's real redis-server and real `voxgate serve` processes.

Redis runs without persistence (`--save '' --appendonly no`), so a restart
empties it, as a Redis pod that is rescheduled would be, and with a password,
as the shipped ones (deploy/) do. The gateways use the
tone engine: the tests are about routing, and received audio decodes back to
the exact text. Records live `TTL_S` seconds, short so that expiry is quick.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ARTIFACTS, ServerProcess, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
KEY, OTHER_KEY = "fleet-key-" + "a" * 24, "fleet-key-" + "b" * 24
TOKEN_SECRET = "fleet-token-secret-" + "c" * 24
REDIS_PASSWORD = "fleet-redis-password-" + "d" * 24
TTL_S = 3.0


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 10.0) -> None:
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log = open(os.path.join(ARTIFACTS, f"redis-{self.port}.log"), "a")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--requirepass", REDIS_PASSWORD],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(f"AUTH {REDIS_PASSWORD}\r\nPING\r\n".encode())
                    reply = b""
                    while len(reply) < 12 and (chunk := s.recv(32)):  # the two replies may come apart
                        reply += chunk
                    if reply.startswith(b"+OK\r\n+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server not answering on {self.port} after {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, decode_responses=True, password=REDIS_PASSWORD)


class FleetGateway(ServerProcess):
    """`voxgate serve` as a fleet member: its advertise URL names its own port."""

    def __init__(self, name: str, redis_url: str, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log_path = os.path.join(ARTIFACTS, f"fleet-{name}-{self.port}.log")
        cmd = [
            sys.executable, "-m", "voxgate.cli", "serve", "--port", str(self.port), "--ice-host", "127.0.0.1",
            "--engine", "tone", "--redis-url", redis_url, "--advertise-url", self.url,
            "--directory-ttl-s", str(TTL_S), *(extra or []),
        ]
        env = {**os.environ, "VOXGATE_API_KEY": f"{KEY},{OTHER_KEY}", "VOXGATE_TOKEN_SECRET": TOKEN_SECRET,
               "VOXGATE_REDIS_PASSWORD": REDIS_PASSWORD}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gateway_factory(redis_server):
    started: list[FleetGateway] = []

    def start(*names: str) -> list[FleetGateway]:
        gateways = [FleetGateway(name, redis_server.url) for name in names]
        started.extend(gateways)
        for gateway in gateways:
            gateway.wait_ready()
        return gateways

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="session")
def gateways(gateway_factory) -> list[FleetGateway]:
    # Started together: their engines load in parallel.
    return gateway_factory("a", "b", "doomed")


@pytest.fixture(scope="session")
def fleet(gateways) -> list[FleetGateway]:
    """Gateways A and B, sharing the directory."""
    return gateways[:2]


@pytest.fixture(scope="session")
def doomed(gateways) -> FleetGateway:
    """A third gateway, for the test that kills it."""
    return gateways[2]
