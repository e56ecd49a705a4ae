"""Shared fixtures: real gateway servers on loopback.

`server_factory` starts `voxgate serve` as a separate process (the way users
run it) with ICE restricted to loopback, and waits until /readyz says ready.
The session-scoped `tone_server` and `piper_server` are shared by every test
that only needs a running gateway.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "artifacts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, engine: str, extra: list[str] | None = None, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.log_path = os.path.join(ARTIFACTS, f"server-{engine}-{self.port}.log")
        cmd = [
            sys.executable, "-m", "voxgate.cli", "serve",
            "--port", str(self.port), "--ice-host", "127.0.0.1", "--engine", engine,
            *(extra or []),
        ]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n{open(self.log_path).read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s; log:\n{open(self.log_path).read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def server_factory():
    servers: list[ServerProcess] = []

    def start(engine: str = "tone", extra: list[str] | None = None, env: dict | None = None) -> ServerProcess:
        server = ServerProcess(engine, extra, env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def tone_server(server_factory) -> ServerProcess:
    return server_factory("tone")


@pytest.fixture(scope="session")
def piper_server(server_factory) -> ServerProcess:
    return server_factory("piper")


@pytest.fixture(scope="session")
def artifacts_dir() -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    return ARTIFACTS
