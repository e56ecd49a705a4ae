"""TURN for real: Debian's coturn on loopback, chromium relay-only, credentials minted by the gateway.

coturn runs with the REST-API secret (`use-auth-secret`) that the gateway gets
as --turn-secret; the page takes the credentials the gateway hands its client
token (`GET /v1/ice-servers`) and connects with `iceTransportPolicy: "relay"`
over one transport at a time. bench/bench_network.py --turn times first audio
against direct sessions.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import browser_call  # noqa: E402 - bench/ is on the path only now
import coturn  # noqa: E402

from tests.conftest import ServerProcess  # noqa: E402

playwright_sync = pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(browser_call.CHROMIUM), reason="needs Debian chromium at /usr/bin/chromium"),
    pytest.mark.skipif(not shutil.which("turnserver") and not os.path.exists(coturn.TURNSERVER),
                       reason="needs Debian coturn (apt install coturn)"),
]


@pytest.fixture(scope="module")
def turn():
    with coturn.Coturn() as server:
        yield server


@pytest.fixture(scope="module")
def turn_gateway(turn):
    # Stopped before coturn is: the gateway's own TURN allocations (aioice) are released on the way out,
    # which waits out retransmissions when the TURN server is already gone.
    server = ServerProcess("tone", ["--turn-secret", turn.secret, *sum((["--ice-server", u] for u in turn.urls()), [])])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chromium():
    with playwright_sync.sync_playwright() as p:
        # The TURN server's TLS certificate is self-signed.
        browser = browser_call.launch(p, ["--ignore-certificate-errors"])
        yield browser
        browser.close()


@pytest.mark.parametrize("transport", ["udp", "tcp", "tls"])
def test_a_relay_only_browser_hears_the_gateway_through_coturn(chromium, turn_gateway, turn, transport):
    made, servers = browser_call.turn_servers(turn_gateway.url, transport)
    assert servers and all(s["username"].split(":")[0].isdigit() for s in servers), servers
    result = browser_call.call(chromium, turn_gateway.url, ["One two three."], ice_servers=servers, policy="relay",
                               made_ahead=made, tail_ms=200, timeout_ms=15000)[0]
    local = result.pair["local"]
    assert local.get("candidateType") == "relay" and local.get("relayProtocol") == transport, result.pair
    assert local.get("address") == turn.host, result.pair
    assert result.stats["packetsReceived"] > 20 and result.first_audio_ms is not None, result.stats
    assert np.abs(result.pcm.astype(np.int32)).max() > 3000  # the tones, through the relay
