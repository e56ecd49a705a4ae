"""Shared fixtures: real gateway servers on loopback.

`server_factory` starts `voxgate serve` as a separate process (the way users
run it) with ICE restricted to loopback, and waits until /readyz says ready.
The session-scoped `tone_server` and `piper_server` are shared by every test
that only needs a running gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.timing import group_of, is_serial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "artifacts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_offer_sdp() -> str:
    """A real offer from aiortc (audio recvonly + data channel), ICE on loopback."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    from voxgate.gateway.webrtc.ice import restrict_host_addresses

    async def make() -> str:
        restrict_host_addresses(["127.0.0.1"])
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="recvonly")
        pc.createDataChannel("control")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    return asyncio.run(make())


@contextlib.asynccontextmanager
async def in_process_gateway(**settings):
    """A tone-engine gateway in this test's own event loop, on loopback: (app, url). For tests that
    read the gateway's objects (peers, transports) while a real client talks to it."""
    from aiohttp import web

    from voxgate.config import Settings
    from voxgate.signaling.server import create_app

    app = create_app(Settings(**{"engine": "tone", "host": "127.0.0.1", "ice_host": ["127.0.0.1"], "web": False, **settings}))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


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

    def log_entries(self) -> list[dict]:
        """The JSON lines of the server's log so far (servers started with --log-json)."""
        self.log.flush()
        with open(self.log_path) as f:
            return [json.loads(line) for line in f if line.startswith("{")]

    async def wait_log(self, predicate, timeout: float = 10.0) -> dict:
        """The first JSON log entry that matches, once the server has written it."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.log_entries() if predicate(e)]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching log entry within {timeout} s in {self.log_path}")
            await asyncio.sleep(0.05)  # polls the file; the wait ends as soon as the line is there

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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its loadgroup scheduling)
def pytest_collection_modifyitems(config, items):
    """`timing` on the tests that measure time (tests/timing.py); an xdist group on every test."""
    for item in items:
        if is_serial(item.nodeid):
            item.add_marker(pytest.mark.timing)
        item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid)))


# Under CI a skipped test is a failure: a missing browser or extra must not turn
# a whole group of tests green by skipping it.
def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which counts as a failure: {reason}"


_collection_skips: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A whole module skipped at import (importorskip) cannot become a failed test;
    # it is remembered and fails the run at the end, with the rest still run.
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _collection_skips.append(f"{collector.nodeid}: {reason}")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    # Under xdist the workers collect: each sends its skipped modules back (pytest_sessionfinish).
    for line in getattr(node, "workeroutput", {}).get("collection_skips", []):
        if line not in _collection_skips:
            _collection_skips.append(line)


def pytest_terminal_summary(terminalreporter):
    for line in _collection_skips:
        terminalreporter.write_line(f"FAILED (skipped under CI=true) {line}", red=True)


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports and fails the run
        workeroutput["collection_skips"] = list(_collection_skips)
        return
    if _collection_skips and session.exitstatus == 0:
        session.exitstatus = 1
