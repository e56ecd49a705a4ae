"""The session protocol (gateway/sessions/protocol.py): each rule of `parse`, the error event, the rate limiter.

tests/fuzz/test_fuzz_protocol.py throws arbitrary input at the parser; these
name each rule once, so a broken rule fails with its own name.
"""

from __future__ import annotations

import json

import pytest

from voxgate.gateway.errors import GatewayError
from voxgate.gateway.sessions.protocol import CLIENT_TYPES, MAX_DEPTH, Limits, RateLimiter, parse

LIMITS = Limits(max_message_bytes=200, max_text_chars=20)


def code_of(raw) -> str:
    with pytest.raises(GatewayError) as info:
        parse(raw, LIMITS)
    assert info.value.message
    return info.value.code


@pytest.mark.parametrize("kind", CLIENT_TYPES)
def test_every_client_type_parses(kind):
    msg = {"type": kind, "text": "hi"} if kind in ("speak", "text.delta") else {"type": kind}
    assert parse(json.dumps(msg), LIMITS) == msg
    assert parse(json.dumps(msg).encode(), LIMITS) == msg


def test_size_is_counted_in_utf8_bytes_not_characters():
    text = "é" * 12  # 12 characters, 24 bytes
    padded = json.dumps({"type": "ping", "t": text + "x" * (200 - 40)}, ensure_ascii=False)
    assert len(padded) <= 200 < len(padded.encode())
    assert code_of(padded) == "message_too_large"


@pytest.mark.parametrize("raw,code", [
    (b"\xff\xfe{}", "invalid_utf8"),
    ("{not json", "invalid_json"),
    ('{"type": "ping", "t": NaN}', "invalid_json"),
    ("[1, 2]", "invalid_message"),
    ('{"text": "no type"}', "invalid_message"),
    ('{"type": "shout"}', "unknown_type"),
    ('{"type": "speak"}', "invalid_field"),
    ('{"type": "speak", "text": 5}', "invalid_field"),
    ('{"type": "speak", "text": "' + "x" * 21 + '"}', "text_too_long"),
    ('{"type": "speak", "text": "\\ud800"}', "invalid_utf8"),
    ('{"type": "ping", "id": ""}', "invalid_field"),
    ('{"type": "ping", "id": 7}', "invalid_field"),
    ('{"type": "session.update", "voice": 3}', "invalid_field"),
    ('{"type": "session.update", "rate": true}', "invalid_field"),
    ('{"type": "session.update", "rate": 4.5}', "invalid_field"),
    ('{"type": "session.update", "rate": 0.2}', "invalid_field"),
    ('{"type": "session.update", "vad": true}', "invalid_field"),
])
def test_each_rule_has_its_code(raw, code):
    assert code_of(raw) == code


def test_nesting_deeper_than_the_limit_is_refused_and_at_the_limit_is_fine():
    def nested(levels: int) -> str:
        return '{"type": "ping", "t": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"

    assert parse(nested(MAX_DEPTH), Limits())["type"] == "ping"
    with pytest.raises(GatewayError) as info:
        parse(nested(MAX_DEPTH + 1), Limits())
    assert info.value.code == "invalid_message"


def test_rate_bounds_are_inclusive():
    assert parse('{"type": "session.update", "rate": 0.25}', LIMITS)["rate"] == 0.25
    assert parse('{"type": "session.update", "rate": 4}', LIMITS)["rate"] == 4


def test_the_error_event_carries_the_utterance_id_only_when_known():
    with pytest.raises(GatewayError) as info:
        parse('{"type": "speak", "id": "u1"}', LIMITS)
    assert info.value.event() == {"type": "error", "code": "invalid_field", "message": info.value.message, "id": "u1"}
    assert "id" not in GatewayError("x", "y").event()


def test_rate_limiter_allows_a_second_of_burst_then_refills_at_the_rate():
    limiter = RateLimiter(10)
    assert sum(limiter.allow() for _ in range(15)) == 10
    limiter.updated -= 0.5  # half a second passes
    assert sum(limiter.allow() for _ in range(15)) == 5
    limiter.updated -= 60  # a long pause refills to one second's worth, no more
    assert sum(limiter.allow() for _ in range(30)) == 10
