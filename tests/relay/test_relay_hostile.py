"""Hostile ConversationRelay applications cost their own conversation only.

Five phone calls through the Twilio bridge name their application with `<Parameter name="relay_url">`:
one floods tokens, one sends a 10 MB message, one never answers the handshake, one closes in the
middle of an utterance, one stops reading (its pings go unanswered). Each caller hears the short apology and the call ends; each failure is one
log line (no traceback) and one count in /metrics. Meanwhile a sixth call, relayed to a
well-behaved application, keeps its speech flowing at 20 ms a frame.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time

import aiohttp

from tests.conftest import in_process_gateway
from tests.relay.relay_app import RelayApp, SilentServer
from tests.telephony.twilio_standin import TwilioStandIn

GREETING = "This call keeps talking while five other applications misbehave at the same time as it does."
HOSTILE = {"flood": "flood", "huge": "garbage", "silent": "timeout", "close_mid_utterance": "closed", "deaf": "unresponsive"}


async def test_hostile_applications_end_only_their_own_call(caplog):
    caplog.set_level(logging.INFO, logger="voxgate.gateway.backends.relay")
    hostile = await asyncio.create_subprocess_exec(sys.executable, "-m", "tests.relay.relay_app",
                                                   stdout=asyncio.subprocess.PIPE)
    assert hostile.stdout is not None
    base = (await asyncio.wait_for(hostile.stdout.readline(), 30)).decode().strip()
    urls = {mode: f"{base}/{mode}" for mode in HOSTILE}
    silent = SilentServer()
    good = RelayApp()
    urls["silent"] = await silent.start()
    good_url = await good.start()
    phones: dict[str, TwilioStandIn] = {}
    try:
        async with in_process_gateway(relay_allow_private=True, relay_connect_timeout_s=1.0, relay_read_timeout_s=1.0,
                                      relay_apology="Sorry.") as (_, url):
            calm = TwilioStandIn(url, stream_sid="MZcalm", call_sid="CAcalm")
            await calm.connect()
            await calm.start({"relay_url": good_url, "welcomeGreeting": GREETING})
            await calm.wait(lambda: len(calm.received.media) > 5)
            for i, mode in enumerate(HOSTILE):
                phones[mode] = TwilioStandIn(url, stream_sid=f"MZhostile{i}", call_sid=f"CAhostile{i}")
                await phones[mode].connect()
                await phones[mode].start({"relay_url": urls[mode]})
            attacked = time.perf_counter()  # the calls' own setup (the stand-ins share this loop) is not the point
            for phone in phones.values():
                await phone.wait(lambda phone=phone: phone.ws.closed, timeout=15)
            during = [t for t, _ in calm.received.media if t > attacked]
            await calm.wait(lambda: any(m.get("event") == "mark" and m["mark"]["name"].endswith(":end")
                                        for _, m in calm.received.messages), timeout=15)
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/metrics") as resp:
                    metrics = await resp.text()
            calm_open = not calm.ws.closed
            await calm.close()
            for phone in phones.values():
                await phone.close()
    finally:
        hostile.kill()
        await hostile.wait()
        await good.stop()
        await silent.stop()
    # Every hostile caller heard the apology (media) before its call ended.
    for mode, phone in phones.items():
        assert len(phone.received.media) >= 5, mode
    # One warning line each, no traceback, naming what went wrong.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "voxgate.gateway.backends.relay"]
    assert sorted(re.search(r"relay (\w+):", r.getMessage()).group(1) for r in warnings) == sorted(HOSTILE.values())
    assert all(r.exc_info is None for r in warnings)
    for outcome in HOSTILE.values():
        assert f'voxgate_relay_connections_total{{outcome="{outcome}"}} 1.0' in metrics, outcome
    # The calm call went on, its frames 20 ms apart while the others failed, and is still up.
    gaps = [b - a for a, b in zip(during, during[1:])]
    # Twelve frame periods: observed 0.055-0.093 s; before the connection was dropped instead of closed,
    # a flooding application's close stalled the loop for 0.45-0.55 s.
    assert len(gaps) > 50 and max(gaps) < 0.25, max(gaps)
    assert calm_open and good.invalid == [] and silent.connections == 1
