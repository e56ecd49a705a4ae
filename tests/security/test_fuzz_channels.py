"""Fuzzing the live transports: a real WebRTC data channel, a backend WebSocket,
and the Twilio Media Streams WebSocket, against a running `voxgate serve`.

Hypothesis makes message sequences (real messages with fields of every JSON
type, near-misses, garbage text and bytes, deep nesting, huge and hostile
text). After each sequence the connection must still answer a `ping`
(the session lives), no error may be `internal`, and at the end the server
must be healthy with no traceback in its log. Twilio streams get sequences of
Twilio-shaped frames with fields of the wrong types and values.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voxgate.rtc_client import RtcClient

from sec_helpers import http_json, log_text

SCALE = float(os.environ.get("VOXGATE_FUZZ_SCALE", "1"))
FUZZ = settings(
    max_examples=int(40 * SCALE), deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)
HOSTILE_TEXT = ["<" + "a." * 1900, "<a" + " " * 3900 + "x>", "[a](" * 900, "<" * 3900, '<prosody rate="nan">x</prosody>',
                '<break time="10s"/>' * 100, "\u202e\u0000\ud7ff" * 10]
texts = st.one_of(st.text(max_size=60), st.sampled_from(HOSTILE_TEXT))
ids = st.one_of(st.none(), st.sampled_from(["a", "b", "u1"]), st.text(max_size=8), json_values)
protocol_messages = st.one_of(
    st.builds(lambda t, i: {"type": "speak", "text": t, "id": i}, texts, ids),
    st.builds(lambda t, i: {"type": "text.delta", "text": t, "id": i}, texts, ids),
    st.builds(lambda i: {"type": "text.end", "id": i}, ids),
    st.just({"type": "cancel"}),
    st.builds(lambda v, r: {"type": "session.update", "voice": v, "rate": r},
              st.one_of(st.none(), st.sampled_from(["tone", "/etc/passwd.onnx", "joe"]), json_values), json_values),
    st.builds(lambda v: {"type": "session.update", "vad": v}, json_values),
    st.dictionaries(st.sampled_from(["type", "text", "id", "voice", "rate", "vad", "t"]), json_values, max_size=4),
)
frames = st.one_of(
    protocol_messages.map(json.dumps),
    st.text(max_size=200),
    st.binary(max_size=200),
    st.integers(1, 400).map(lambda n: '{"type": "ping", "t": ' + "[" * n + "]" * n + "}"),
    st.sampled_from(['{"type": "session.update", "rate": NaN}', '{"type": "speak", "text": "x", "id": Infinity}', "x" * 70000]),
)
sequences = st.lists(frames, min_size=1, max_size=8)

_pings = itertools.count(1)


@pytest.fixture(scope="module")
def fuzz_server(server_factory):
    return server_factory("tone", ["--max-messages-per-s", "100000"])


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def assert_clean(events: list[dict]) -> None:
    for event in events:
        assert not (event.get("type") == "error" and event.get("code") == "internal"), event


@pytest.fixture(scope="module")
def channel(fuzz_server, loop):
    client = RtcClient(fuzz_server.url)
    loop.run_until_complete(client.connect())
    yield client
    loop.run_until_complete(client.close())


@FUZZ
@given(sequence=sequences)
def test_data_channel(channel, loop, sequence):
    async def run() -> None:
        start = len(channel.event_log)
        for frame in sequence:
            if isinstance(frame, str) and len(frame.encode("utf-8", "surrogatepass")) > 65536:
                continue  # larger than an SCTP message aiortc sends; the server limit is tested below
            channel.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))
        token = next(_pings)
        channel.send({"type": "ping", "t": token})
        while True:
            event = await channel.wait_for("pong", timeout=30)
            if event.get("t") == token:
                break
        channel.send({"type": "cancel"})
        assert_clean([e for _, e in channel.event_log[start:]])

    loop.run_until_complete(run())


@pytest.fixture(scope="module")
def backend(fuzz_server, loop):
    async def open_ws():
        status, made, _ = await http_json("POST", fuzz_server.url + "/v1/sessions")
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(made["ws_url"], max_msg_size=0)
        return http, ws

    http, ws = loop.run_until_complete(open_ws())
    yield ws
    loop.run_until_complete(ws.close())
    loop.run_until_complete(http.close())


@FUZZ
@given(sequence=sequences)
def test_backend_websocket(backend, loop, sequence):
    async def run() -> None:
        for frame in sequence:
            if isinstance(frame, bytes):
                await backend.send_bytes(frame)
            else:
                await backend.send_str(frame)
        token = next(_pings)
        await backend.send_str(json.dumps({"type": "ping", "t": token}))
        seen = []
        while True:
            msg = await backend.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            event = json.loads(msg.data)
            seen.append(event)
            if event.get("type") == "pong" and event.get("t") == token:
                break
        await backend.send_str('{"type": "cancel"}')
        assert_clean(seen)

    loop.run_until_complete(run())


sids = st.one_of(st.just("MZfuzz"), st.text(max_size=12), json_values)
twilio_frames = st.one_of(
    st.builds(lambda s, c, f, p, t: {"event": "start", "start": {"streamSid": s, "callSid": c, "mediaFormat": f, "customParameters": p, "tracks": t}},
              sids, sids, st.one_of(json_values, st.just({"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1})),
              st.one_of(json_values, st.dictionaries(st.sampled_from(["voice", "session_id", "token", "x"]), json_values, max_size=3)),
              st.one_of(json_values, st.just(["inbound"]))),
    st.builds(lambda p, t: {"event": "media", "media": {"payload": p, "track": t}},
              st.one_of(st.binary(max_size=160).map(lambda b: __import__("base64").b64encode(b).decode()), json_values, st.text(max_size=20)),
              st.one_of(st.just("inbound"), json_values)),
    st.builds(lambda m: {"event": "mark", "mark": m}, json_values),
    st.builds(lambda d: {"event": "dtmf", "dtmf": d}, json_values),
    st.builds(lambda e: {"event": e}, st.one_of(st.sampled_from(["connected", "stop", "nope"]), json_values)),
    json_values,
)
twilio_sequences = st.lists(st.one_of(twilio_frames.map(json.dumps), st.text(max_size=80), st.binary(max_size=80)), min_size=1, max_size=8)


@FUZZ
@given(sequence=twilio_sequences)
def test_twilio_websocket(fuzz_server, loop, sequence):
    async def run() -> None:
        url = fuzz_server.url.replace("http://", "ws://") + "/v1/telephony/twilio"
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            for frame in sequence:
                if ws.closed:
                    break
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_str(frame)
            await ws.close()
            while True:
                msg = await ws.receive(timeout=30)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                event = json.loads(msg.data)
                assert not (event.get("event") == "error" and event.get("code") == "internal"), event

    loop.run_until_complete(run())


def test_the_server_is_healthy_and_its_log_clean_afterwards(fuzz_server, loop):
    async def run():
        status, body, _ = await http_json("GET", fuzz_server.url + "/readyz")
        assert status == 200 and body["ready"]

    loop.run_until_complete(run())
    log = log_text(fuzz_server)
    assert "Traceback" not in log and "Unhandled" not in log and "Error handling request" not in log, log[-4000:]
