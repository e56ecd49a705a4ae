"""Bad input gets a clear error and never harms the session, other sessions or the server."""

import asyncio
import json

import aiohttp
import pytest

from voxgate.rtc_client import RtcClient

BAD_OFFERS = [
    (b"not json at all", 400, "invalid_json"),
    (b"\xff\xfe\x00garbage", 400, "invalid_utf8"),
    (b"[1, 2, 3]", 400, "invalid_json"),
    (json.dumps({"type": "offer"}).encode(), 400, "invalid_sdp"),
    (json.dumps({"sdp": 42, "type": "offer"}).encode(), 400, "invalid_sdp"),
    (json.dumps({"sdp": "v=0\r\nthis is not sdp", "type": "offer"}).encode(), 400, "invalid_sdp"),
    (json.dumps({"sdp": "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 0\r\n", "type": "offer"}).encode(), 400, "invalid_sdp"),
    (json.dumps({"sdp": "x", "type": "answer"}).encode(), 400, "invalid_sdp"),
    (json.dumps({"sdp": "v=0\r\n" + "a=x\r\n" * 100000, "type": "offer"}).encode(), 413, "too_large"),
]


@pytest.mark.parametrize("body,status,code", BAD_OFFERS, ids=[c for _, _, c in BAD_OFFERS])
async def test_malformed_offers_get_json_errors(tone_server, body, status, code):
    async with aiohttp.ClientSession() as http:
        async with http.post(tone_server.url + "/v1/offer", data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
            assert error["code"] == code and error["message"]
        async with http.get(tone_server.url + "/healthz") as resp:
            assert resp.status == 200


BAD_MESSAGES = [
    ("not json", "invalid_json"),
    (b"\xc3\x28 invalid utf-8", "invalid_utf8"),
    ("[1,2]", "invalid_message"),
    ('{"no": "type"}', "invalid_message"),
    ('{"type": "dance"}', "unknown_type"),
    ('{"type": "speak"}', "invalid_field"),
    ('{"type": "speak", "text": 12}', "invalid_field"),
    ('{"type": "speak", "text": "x", "id": 5}', "invalid_field"),
    ('{"type": "session.update", "rate": "fast"}', "invalid_field"),
    ('{"type": "session.update", "voice": "nobody"}', "unknown_voice"),
    # A voice on a message that starts an utterance applies to it, so it is checked, never ignored.
    ('{"type": "speak", "text": "x", "voice": "nobody"}', "unknown_voice"),
    ('{"type": "text.delta", "text": "x", "voice": 7}', "invalid_field"),
    ('{"type": "session.update", "vad": {"aggressiveness": 9}}', "invalid_field"),
    ('{"type": "text.end", "id": "never-started"}', "unknown_utterance"),
    ('{"type": "speak", "text": "' + "a" * 5000 + '"}', "text_too_long"),
    ("x" * 70000, "message_too_large"),
    ('{"type": "speak", "text": "x", "deep": ' + "[" * 50 + "]" * 50 + "}", "invalid_message"),
]


async def test_bad_data_channel_messages_get_error_events_and_the_session_lives_on(tone_server):
    async with RtcClient(tone_server.url) as client, RtcClient(tone_server.url) as bystander:
        bystander.send({"type": "speak", "text": "The other session keeps talking through all of this.", "id": "b"})
        for raw, code in BAD_MESSAGES:
            client.send(raw)
            error = await client.wait_for("error", timeout=5)
            assert error["code"] == code, (raw[:60], error)
            assert error["message"]
        client.send({"type": "speak", "text": "Still alive.", "id": "ok", "voice": "tone"})
        done = await client.wait_for("utterance.done", id="ok", timeout=20)
        assert done["audio_ms"] > 0
        # One utterance, one voice: a voice on a later piece is refused.
        client.send({"type": "text.delta", "text": "Streaming ", "id": "s"})
        client.send({"type": "text.delta", "text": "on.", "id": "s", "voice": "tone"})
        error = await client.wait_for("error", timeout=5)
        assert (error["code"], error["id"]) == ("invalid_field", "s") and "voice" in error["message"]
        await bystander.wait_for("utterance.done", id="b", timeout=20)
        assert not [e for _, e in bystander.event_log if e["type"] == "error"]


async def test_a_flood_of_messages_is_rate_limited_and_every_message_answered(tone_server):
    async with RtcClient(tone_server.url) as client:
        for i in range(500):
            client.send('{"type": "ping", "t": %d}' % i)
        answers = [await client.wait_for_any(("pong", "error"), timeout=10) for _ in range(500)]
        limited = [a for a in answers if a["type"] == "error"]
        assert limited and all(a["code"] == "rate_limited" for a in limited)
        assert len(answers) - len(limited) >= 200  # a second's allowance got through
        await asyncio.sleep(1.1)  # the bucket refills
        client.send({"type": "speak", "text": "After the flood.", "id": "f"})
        await client.wait_for("utterance.done", id="f", timeout=20)


async def test_crafted_stun_datagrams_are_dropped_inside_their_session(caplog):
    """aioice raises struct.error out of asyncio's datagram callback for a STUN attribute of the
    wrong length: without containment the loop logs a traceback per datagram, for anyone who
    can reach a session's port. Each is dropped, logged once, and the session lives on."""
    import logging
    import socket
    import struct

    from aioice import stun

    from tests.conftest import in_process_gateway

    attribute = struct.pack("!HH", 0x000D, 2) + b"\x00\x01\x00\x00"  # LIFETIME is 4 bytes, not 2
    crafted = struct.pack("!HHI12s", 0x0001, len(attribute), stun.COOKIE, b"x" * 12) + attribute
    with pytest.raises(struct.error):
        stun.parse_message(crafted)  # what aioice meets; it catches only ValueError

    caplog.set_level(logging.WARNING)
    async with in_process_gateway() as (app, url):
        async with RtcClient(url) as client:
            peer = app["gateway"].peers[client.session_id]
            connection = next(t.sender.transport for t in peer.pc.getTransceivers()).transport._connection
            targets = [p.transport.get_extra_info("sockname")[:2] for p in connection._protocols]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
                for _ in range(20):
                    for target in targets:
                        attacker.sendto(crafted, target)
            for _ in range(3):  # pings answered after the datagrams: they were read by then
                client.send({"type": "ping", "t": 1})
                await client.wait_for("pong", timeout=5)
            client.send({"type": "speak", "text": "Still here.", "id": "s"})
            await client.wait_for("utterance.done", id="s", timeout=30)
        assert "Exception in callback" not in caplog.text
        assert caplog.text.count("dropped a datagram aioice could not handle") == 1
