"""Property tests: the protocol parser and a Session under arbitrary input.

`parse` turns any bytes or text into a valid message or a GatewayError with
a code and a message, never another exception. A Session fed arbitrary
sequences of messages (valid, half-valid and garbage, with microphone noise
in between) never raises, never answers `internal`, and ends every utterance
it accepted exactly once: `utterance.done` or `utterance.interrupted`.

The Session runs in-process with the real tone engine worker. Its output is
pulled by a loop that takes frames as fast as the encoder makes them instead
of the 20 ms pacer (the pacer has its own tests), so each example takes
milliseconds of speech time rather than seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import string
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voxgate.engine.runtime.client import EngineClient, EngineConfig
from voxgate.gateway.errors import GatewayError
from voxgate.gateway.sessions.protocol import CLIENT_TYPES, Limits, parse
from voxgate.gateway.sessions.session import Session, SessionOptions

LIMITS = Limits(max_message_bytes=512, max_text_chars=40)
# VOXGATE_FUZZ_SCALE=10 runs ten times the examples (a longer hunt than CI's).
SCALE = float(os.environ.get("VOXGATE_FUZZ_SCALE", "1"))

# ---------------------------------------------------------------------------
# parse


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=60),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=30,
)
field_names = st.sampled_from(["type", "text", "id", "voice", "rate", "vad", "t", "x"])


@st.composite
def message_like(draw) -> dict:
    """Objects close to real messages: a real or near type, fields of any JSON type."""
    msg = draw(st.dictionaries(field_names, json_values, max_size=5))
    if draw(st.booleans()):
        msg["type"] = draw(st.one_of(st.sampled_from(CLIENT_TYPES), st.text(max_size=12)))
    return msg


def deep(n: int) -> str:
    return '{"type": "ping", "t": ' + "[" * n + "]" * n + "}"


raw_inputs = st.one_of(
    st.binary(max_size=700),
    st.text(max_size=700),
    message_like().map(json.dumps),
    message_like().map(lambda m: json.dumps(m).encode("utf-8")),
    json_values.map(json.dumps),
    st.integers(0, 3000).map(deep),
    # Python's json accepts these; JSON does not have them.
    st.sampled_from(['{"type": "session.update", "rate": NaN}', '{"type": "speak", "text": "x", "id": Infinity}']),
)


@settings(max_examples=int(400 * SCALE), deadline=None)
@given(raw=raw_inputs)
def test_parse_returns_a_valid_message_or_a_protocol_error(raw):
    try:
        msg = parse(raw, LIMITS)
    except GatewayError as exc:
        assert isinstance(exc.code, str) and exc.code and isinstance(exc.message, str) and exc.message
        event = exc.event()
        assert event["type"] == "error"
        json.dumps(event)  # it must go back to the sender as JSON
        return
    assert isinstance(msg, dict) and msg["type"] in CLIENT_TYPES
    assert msg.get("id") is None or (isinstance(msg["id"], str) and 0 < len(msg["id"]) <= 128)
    if msg["type"] in ("speak", "text.delta"):
        assert isinstance(msg["text"], str) and len(msg["text"]) <= LIMITS.max_text_chars
        msg["text"].encode("utf-8")  # no lone surrogates
    if msg["type"] == "session.update" and "rate" in msg:
        assert 0.25 <= msg["rate"] <= 4.0


@pytest.mark.parametrize("raw", [b"\xff\xfe", "\ud800", '"just a string"', "[]", "{}", '{"type": 5}', "x" * 600, deep(5000)])
def test_parse_named_corner_cases(raw):
    with pytest.raises(GatewayError):
        parse(raw, LIMITS)


# ---------------------------------------------------------------------------
# Session


IDS = ["a", "b", "c"]
short_text = st.text(alphabet=string.ascii_letters + " ,.!?é", max_size=12)


def _msg(kind: str, **fields) -> str:
    return json.dumps({"type": kind, **{k: v for k, v in fields.items() if v is not None}})


ids = st.one_of(st.none(), st.sampled_from(IDS))
steps = st.one_of(
    st.builds(lambda t, i: ("msg", _msg("speak", text=t, id=i)), short_text, ids),
    st.builds(lambda t, i: ("msg", _msg("text.delta", text=t, id=i)), short_text, ids),
    st.builds(lambda i: ("msg", _msg("text.end", id=i)), ids),
    st.just(("msg", _msg("cancel"))),
    st.just(("msg", _msg("ping", t=1))),
    st.builds(lambda m: ("msg", json.dumps({**m, "type": "session.update"})),
              st.dictionaries(st.sampled_from(["voice", "rate", "vad"]), json_values, max_size=3)),
    st.builds(lambda v: ("msg", json.dumps({"type": "session.update", "vad": v})),
              st.dictionaries(st.sampled_from(["enabled", "aggressiveness", "min_speech_ms", "hangover_ms"]), json_values, max_size=3)),
    raw_inputs.map(lambda r: ("msg", r)),
    st.integers(1, 25).map(lambda n: ("noise", n)),  # n x 20 ms of loud noise on the microphone
    st.integers(1, 30).map(lambda n: ("frames", n)),  # let the output take n frames
    st.just(("yield", 0)),
)


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def __call__(self, event: dict) -> None:
        json.dumps(event)  # every event must be sendable
        self.events.append(event)

    def count(self, kind: str) -> Counter:
        return Counter(e.get("id") for e in self.events if e["type"] == kind)

    def terminal(self) -> Counter:
        return self.count("utterance.done") + self.count("utterance.interrupted")


@pytest.fixture(scope="module")
def engine_loop():
    """One event loop and one tone engine worker for every example of the module."""
    loop = asyncio.new_event_loop()
    engine = EngineClient(EngineConfig(engine="tone", parallel=2))
    loop.run_until_complete(engine.start())
    yield loop, engine
    loop.run_until_complete(engine.close())
    loop.close()


async def _drive(engine: EngineClient, script: list[tuple[str, object]]) -> tuple[Session, Recorder]:
    options = SessionOptions(limits=LIMITS, max_queued_utterances=4, max_utterance_chars=60)
    session = Session(engine, options=options)
    rec = Recorder()
    session.add_listener("peer", rec)
    session.attach_output("opus")
    rng = np.random.default_rng(0)
    frames = 0

    async def take(n: int) -> None:
        nonlocal frames
        for _ in range(n):
            frame = session.playout.next_frame()
            assert isinstance(frame, bytes) and frame
            frames += 1
            await asyncio.sleep(0)

    for kind, arg in script:
        if kind == "msg":
            session.handle_message(arg, "peer")
        elif kind == "noise":
            session.caller.on_inbound_audio((rng.standard_normal(320 * arg) * 8000).astype(np.int16), session.clock.ms())
        elif kind == "frames":
            await take(arg)
        else:
            await asyncio.sleep(0)
        # Never more ends than starts, at any moment.
        queued, ended = rec.count("utterance.queued"), rec.terminal()
        assert all(ended[k] <= queued[k] for k in ended), (queued, ended)

    # End whatever is still open, then let everything play out.
    for uid in {e["id"] for e in rec.events if e["type"] == "utterance.queued"}:
        session.handle_message(_msg("text.end", id=uid), "peer")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15.0
    while session.queue.utterances or session.playout.queue:
        assert loop.time() < deadline, f"utterances never finished: {[u.id for u in session.queue.utterances]}"
        await take(20)
        await asyncio.sleep(0.001)
    await session.close("done")
    await asyncio.sleep(0)
    return session, rec


@settings(max_examples=int(40 * SCALE), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=st.lists(steps, max_size=25))
def test_session_survives_any_message_sequence_and_ends_each_utterance_once(engine_loop, script):
    loop, engine = engine_loop
    session, rec = loop.run_until_complete(asyncio.wait_for(_drive(engine, script), 60))
    internal = [e for e in rec.events if e["type"] == "error" and e["code"] == "internal"]
    assert internal == [], f"internal errors for {script!r}: {internal}"
    assert all(e["type"] != "error" or (e["code"] and e["message"]) for e in rec.events)
    assert rec.count("utterance.queued") == rec.terminal()
    assert rec.events[-1]["type"] == "session.closed"
    assert session.output.feeder is None or session.output.feeder.task.done()
    # Every engine stream the session opened was finished or cancelled.
    loop.run_until_complete(asyncio.sleep(0.05))
    assert engine.active_streams == 0


async def _one(engine: EngineClient, raw: str) -> list[dict]:
    session = Session(engine, options=SessionOptions(limits=LIMITS))
    rec = Recorder()
    session.add_listener("peer", rec)
    session.handle_message(raw, "peer")
    await session.close("done")
    return rec.events


@pytest.mark.parametrize("raw", [
    '{"type": "session.update", "vad": {"aggressiveness": "2"}}',
    '{"type": "session.update", "vad": {"min_speech_ms": [1]}}',
    '{"type": "session.update", "vad": {"hangover_ms": null}}',
    '{"type": "session.update", "rate": 1e400}',
])
def test_bad_session_updates_are_field_errors(engine_loop, raw):
    loop, engine = engine_loop
    events = loop.run_until_complete(_one(engine, raw))
    kinds = [(e["type"], e.get("code")) for e in events if e["type"] != "session.closed"]
    assert kinds in ([("session.updated", None)], [("error", "invalid_field")]), kinds


def test_nan_and_infinity_are_not_json(engine_loop):
    loop, engine = engine_loop
    for raw in ('{"type": "session.update", "rate": NaN}', '{"type": "speak", "text": "x", "n": -Infinity}'):
        events = loop.run_until_complete(_one(engine, raw))
        assert [e.get("code") for e in events if e["type"] == "error"] == ["invalid_json"]


@pytest.mark.parametrize("field", ["aggressiveness", "min_speech_ms", "hangover_ms"])
def test_non_finite_vad_numbers_are_field_errors(engine_loop, field):
    loop, engine = engine_loop
    # 1e400 is valid JSON that Python reads as infinity; the literal Infinity is not JSON at all.
    events = loop.run_until_complete(_one(engine, '{"type": "session.update", "vad": {"%s": 1e400}}' % field))
    assert [e.get("code") for e in events if e["type"] == "error"] == ["invalid_field"]
    events = loop.run_until_complete(_one(engine, json.dumps({"type": "session.update", "vad": {field: float("inf")}})))
    assert [e.get("code") for e in events if e["type"] == "error"] == ["invalid_json"]


def test_vad_enabled_must_be_a_boolean(engine_loop):
    loop, engine = engine_loop
    events = loop.run_until_complete(_one(engine, '{"type": "session.update", "vad": {"enabled": "false"}}'))
    updated = [e for e in events if e["type"] == "session.updated"]
    assert not updated or updated[0]["vad"]["enabled"] is False
