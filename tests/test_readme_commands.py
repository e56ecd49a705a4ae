"""The README's own commands, as a new user runs them: `voxgate serve` with the embedded voice, then
`voxgate probe` against it; what the server says at start; a port in use; a probe that cannot connect."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
from aiohttp import ClientSession, web

from tests.conftest import ROOT, ServerProcess, free_port

README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def set_up_command() -> list[str]:
    """The command of the README's set-up that starts the server (after `pip install . &&`)."""
    [line] = re.findall(r"^pip install \. && (voxgate serve.*)$", README, flags=re.M)
    return shlex.split(line)


def probe_command() -> list[str]:
    """The command the README gives to check that a running server works."""
    [span] = re.findall(r"`(voxgate probe [^`]+)`", README)
    return shlex.split(span)


class ReadmeServer(ServerProcess):
    """`voxgate serve` exactly as the README starts it, on a free port instead of 8080."""

    def __init__(self) -> None:
        command = set_up_command()
        assert command == ["voxgate", "serve"], command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(ROOT, "artifacts", f"server-readme-{self.port}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log = open(self.log_path, "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("VOXGATE_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "voxgate.cli", *command[1:], "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()


@pytest.fixture(scope="module")
def readme_server():
    server = ReadmeServer()
    yield server
    server.stop()


def test_the_readme_probe_succeeds_against_the_readme_server(readme_server):
    command = probe_command()
    assert command[2] == "http://127.0.0.1:8080", command
    command[2] = readme_server.url
    done = subprocess.run([sys.executable, "-m", "voxgate.cli", *command[1:], "--quiet"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"sessions +2 connected, 0 failed", done.stdout), done.stdout
    assert "no connection within" not in open(readme_server.log_path).read()


def test_start_up_says_where_what_and_what_to_open_in_a_few_lines(readme_server):
    lines = open(readme_server.log_path).read().splitlines()
    info = [line.split(": ", 1)[1] for line in lines if " INFO " in line]
    url = readme_server.url
    assert info[:5] == [
        f"listening on {url}",
        "media (ICE) offered on 127.0.0.1 (loopback, since HTTP listens on loopback; --ice-host ADDR offers another)",
        info[2],
        info[3],
        f"open {url}/ in a browser",
    ], info
    assert re.fullmatch(r"voice joe on the piper engine on CPU, loaded in \d+\.\d s", info[2]), info[2]
    assert info[3].startswith("fast paths: engine: streaming inside sentences") and "int8" in info[3], info[3]
    assert "RTP packets from templates" in info[3] and "encoding on the event loop" in info[3], info[3]
    assert re.search(r"(\d+) of \1 aiortc fast paths active \(aiortc 1\.16", info[3]), info[3]
    # Nothing else at start-up: the voice's internals (the prior's checks, the graphs) are at debug.
    assert not [line for line in lines if " WARNING " in line or " ERROR " in line or "Traceback" in line], lines


def test_a_port_in_use_is_said_before_the_voice_loads(readme_server):
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "voxgate.cli", "serve", "--port", str(readme_server.port),
                           "--log-level", "DEBUG"], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{readme_server.port}: Address already in use" in done.stderr, done.stderr
    # No engine worker started: at debug it would have said so, and the voice would have loaded.
    assert "engine" not in done.stderr.replace("Choose another", ""), done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 30, elapsed


async def test_the_probe_says_why_a_session_did_not_start(tone_server):
    """A server whose answer offers no ICE candidate (the issue's default server): the probe's
    failure names the cause instead of an empty TimeoutError. A stand-in strips the candidates
    from the offer and the answer on their way to and from a real gateway."""

    async def offer(request: web.Request) -> web.Response:
        body = await request.json()
        body["sdp"] = strip_candidates(body["sdp"])
        async with ClientSession() as http:
            async with http.post(tone_server.url + "/v1/offer", json=body) as resp:
                answer = await resp.json()
        answer["sdp"] = strip_candidates(answer["sdp"])
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/offer", offer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "voxgate.cli", "probe", f"http://127.0.0.1:{port}", "--timeout-s", "3", "--quiet",
            "--json", os.path.join(ROOT, "artifacts", f"probe-no-candidates-{port}.json"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await runner.cleanup()
    assert proc.returncode == 1, out.decode() + err.decode()
    report = json.load(open(os.path.join(ROOT, "artifacts", f"probe-no-candidates-{port}.json")))
    [failure] = report["figures"]["sessions"]["failures"]
    assert "the server's answer offered no ICE candidate" in str(failure) and "--ice-host" in str(failure), failure
    assert "offered no ICE candidate" in out.decode(), out.decode()


def strip_candidates(sdp: str) -> str:
    return "".join(line + "\r\n" for line in sdp.splitlines() if not line.startswith("a=candidate:"))


def test_log_level_reaches_the_engine_worker(server_factory):
    server = server_factory("tone", ["--log-level", "DEBUG", "--log-json"])
    entries = server.log_entries()
    worker = [e for e in entries if e["logger"] == "voxgate.engine.runtime.worker"]
    assert worker and worker[0]["level"] == "DEBUG" and "engine tone loaded" in worker[0]["message"], entries
