"""Finding 16 (and the page headers of 17): the server answers only to its own host names.

Before, the origin check compared the Origin with the Host header, which DNS
rebinding controls: a page at http://attacker.example:8080, its name
re-pointed at 127.0.0.1, was "same origin" for a keyless local gateway.
"""

from __future__ import annotations

from sec_helpers import host_port


def get(url: str, path: str, host: str, origin: str | None = None, method: str = "GET") -> tuple[int, bytes, bytes]:
    extra = f"Origin: {origin}\r\n" if origin else ""
    body = b"{}" if method == "POST" else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    import socket

    h, p = host_port(url)
    with socket.create_connection((h, p), timeout=20) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_end = data.index(b"\r\n\r\n")
    return int(data.split(b" ", 2)[1]), data[:head_end], data[head_end + 4 :]


def test_a_rebound_host_name_is_refused(tone_server):
    _, port = host_port(tone_server.url)
    evil = f"attacker.example:{port}"
    status, _, body = get(tone_server.url, "/v1/sessions", evil)
    assert status == 421 and b"host_not_allowed" in body
    status, _, body = get(tone_server.url, "/v1/sessions", evil, origin=f"http://{evil}", method="POST")
    assert status == 421 and b"host_not_allowed" in body
    status, _, _ = get(tone_server.url, "/", evil)
    assert status == 421


def test_loopback_names_and_probes_are_answered(tone_server):
    _, port = host_port(tone_server.url)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        status, _, _ = get(tone_server.url, "/v1/sessions", host)
        assert status == 200, host
    status, _, _ = get(tone_server.url, "/healthz", "10.1.2.3:8080")  # a kubelet probes by address
    assert status == 200


def test_configured_host_names(server_factory):
    server = server_factory("tone", ["--allowed-host", "voice.example.com"])
    _, port = host_port(server.url)
    assert get(server.url, "/v1/sessions", "voice.example.com")[0] == 200
    assert get(server.url, "/v1/sessions", f"127.0.0.1:{port}")[0] == 421


def test_the_page_carries_security_headers(tone_server):
    _, port = host_port(tone_server.url)
    status, head, _ = get(tone_server.url, "/", f"127.0.0.1:{port}")
    assert status == 200
    head = head.decode().lower()
    assert "content-security-policy: default-src 'self'" in head and "frame-ancestors 'none'" in head
    assert "x-frame-options: deny" in head and "x-content-type-options: nosniff" in head
