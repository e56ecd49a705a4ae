"""Debian's coturn on a loopback address, with the REST-API shared secret Voxgate's --turn-secret mints for.

It listens on 127.0.0.2, not 127.0.0.1: the gateway's own aioice never offers
127.0.0.1 on its own and tests offer it through --ice-host, so a second
loopback address keeps the TURN server's sockets and relayed addresses apart
from the gateway's host candidate. `--allow-loopback-peers` lets it relay to
the gateway there (coturn refuses loopback peers by default). TLS uses a
self-signed certificate made with openssl at start.

docs/deploy.md holds the matching configuration for a real deployment.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

TURNSERVER = "/usr/bin/turnserver"
HOST = "127.0.0.2"
REALM = "voxgate.test"


def _free_port(host: str, kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Coturn:
    """`turnserver` as a child process; `urls()` are the ICE server URLs to give the gateway."""

    def __init__(self, secret: str | None = None, host: str = HOST) -> None:
        self.host = host
        self.secret = secret or secrets.token_hex(16)
        self.port = _free_port(host)
        self.tls_port = _free_port(host)
        self.dir = tempfile.mkdtemp(prefix="coturn-")
        self.log_path = os.path.join(self.dir, "turnserver.log")
        self.proc: subprocess.Popen | None = None

    def urls(self) -> list[str]:
        return [f"turn:{self.host}:{self.port}?transport=udp", f"turn:{self.host}:{self.port}?transport=tcp",
                f"turns:{self.host}:{self.tls_port}?transport=tcp"]

    def start(self, timeout_s: float = 10.0) -> Coturn:
        cert, key = os.path.join(self.dir, "cert.pem"), os.path.join(self.dir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=voxgate.test",
                        "-addext", f"subjectAltName=IP:{self.host}", "-keyout", key, "-out", cert],
                       check=True, capture_output=True, timeout=30)
        # A relay port range of its own, so parallel runs on one machine do not collide.
        low = 20000 + (self.port % 200) * 200
        self.proc = subprocess.Popen(
            [TURNSERVER, "-n", "--listening-ip", self.host, "--relay-ip", self.host,
             "--listening-port", str(self.port), "--tls-listening-port", str(self.tls_port),
             "--min-port", str(low), "--max-port", str(low + 199),
             "--use-auth-secret", "--static-auth-secret", self.secret, "--realm", REALM,
             "--allow-loopback-peers", "--no-cli", "--no-dtls", "--fingerprint",
             "--cert", cert, "--pkey", key, "--pidfile", os.path.join(self.dir, "turnserver.pid"),
             "--log-file", self.log_path, "--simple-log", "--no-stdout-log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"turnserver exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                socket.create_connection((self.host, self.tls_port), timeout=0.5).close()
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)  # turnserver opens its listeners a few ms after it starts
        raise RuntimeError(f"turnserver did not listen within {timeout_s} s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Coturn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
