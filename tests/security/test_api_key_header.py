"""Finding 13: a non-ASCII `X-API-Key` gets a JSON 401, not a 500 with a traceback."""

from __future__ import annotations

import json

import pytest

from sec_helpers import host_port, log_text, raw_request


@pytest.fixture(scope="module")
def keyed(server_factory):
    return server_factory("tone", ["--api-key", "k1"])


@pytest.mark.parametrize("value", ["ключ".encode(), b"\xff\xfe\x80", "k1é".encode("latin-1")])
@pytest.mark.parametrize("header", [b"X-API-Key", b"Authorization"])
def test_non_ascii_keys_are_refused_with_json(keyed, value, header):
    host, port = host_port(keyed.url)
    if header == b"Authorization":
        value = b"Bearer " + value
    head = b"GET /v1/sessions HTTP/1.1\r\nHost: " + f"{host}:{port}".encode() + b"\r\n" + header + b": " + value + b"\r\nConnection: close\r\n\r\n"
    status, body = raw_request(keyed.url, head, [])
    assert status == 401, body
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert "Traceback" not in log_text(keyed)
