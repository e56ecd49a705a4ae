"""What a relay application may send is taken or refused with a documented `error` (docs/relay.md),
the conversation going on; and a relay URL on loopback or a private range is never connected to
without --relay-allow-private, by address or by a name that resolves there."""

from __future__ import annotations

import logging

import aiohttp

from tests.conftest import in_process_gateway
from tests.relay.relay_app import RelayApp
from tests.telephony.twilio_standin import TwilioStandIn

# The vendors' documented examples of what an application sends, and a few they would refuse too.
SCRIPT = [
    {"type": "play", "source": "https://example.com/audio/welcome.mp3", "loop": 1, "preemptible": False, "interruptible": True},
    {"type": "language", "ttsLanguage": "es-ES", "transcriptionLanguage": "es-ES"},
    {"type": "foo"},
    {"type": "text", "last": True},
    {"type": "text", "token": "Hello", "last": False, "colour": "red"},
    {"type": "sendDigits", "digits": "12x"},
    {"type": "end", "handoffData": {"not": "a string"}},
    {"type": "text", "token": "Hello", "last": False, "interruptible": True, "preemptible": False, "lang": "en-US"},
    {"type": "text", "token": " there.", "last": True},
    {"type": "sendDigits", "digits": "1234#"},
    {"type": "language", "ttsLanguage": "en-US"},
    {"type": "end", "handoffData": "{\"reason\": \"done\"}"},
]
REFUSED = ["this server fetches no audio (no --relay-play-origin)", "does not take 'es-ES'", "unknown type 'foo'", "needs a string 'token'",
           "has no field 'colour'", "'sendDigits.digits' must be", "'end.handoffData' must be a string"]


async def test_documented_messages_are_taken_or_refused_with_an_error_and_the_call_goes_on(caplog):
    app = RelayApp(script=SCRIPT)
    await app.start()
    try:
        async with in_process_gateway(relay_allow_private=True) as (_, url):
            phone = TwilioStandIn(url, call_sid="CAscript")
            await phone.connect()
            await phone.start({"relay_url": app.url})
            await phone.wait(lambda: phone.ws.closed, timeout=15)
            await phone.close()
    finally:
        await app.stop()
    errors = [m["description"] for m in app.of_type("error")]
    assert len(errors) == len(REFUSED), errors
    for description, expected in zip(errors, REFUSED):
        assert expected in description, (expected, description)
    assert app.invalid == []
    assert len(phone.received.media) > 20  # "Hello there." and the tones were played before the end
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "voxgate.gateway.backends.relay"]


async def test_loopback_and_private_relay_urls_need_relay_allow_private():
    app = RelayApp()
    await app.start()
    port = app.url.split(":")[2].split("/")[0]
    try:
        async with in_process_gateway(relay_apology="Sorry.") as (_, url):
            for i, target in enumerate([app.url, f"ws://localhost:{port}/relay", "ws://10.1.2.3/relay"]):
                phone = TwilioStandIn(url, stream_sid=f"MZprivate{i}", call_sid=f"CAprivate{i}")
                await phone.connect()
                await phone.start({"relay_url": target})
                await phone.wait(lambda phone=phone: phone.ws.closed, timeout=15)
                assert len(phone.received.media) > 3  # the apology
                await phone.close()
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/metrics") as resp:
                    metrics = await resp.text()
    finally:
        await app.stop()
    assert app.headers == []  # never reached
    assert 'voxgate_relay_connections_total{outcome="private"} 3.0' in metrics
