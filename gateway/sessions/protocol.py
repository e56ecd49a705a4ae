"""The session protocol: JSON objects with a `type`, the same on the data
channel and on backend WebSockets. See docs/protocol.md.

Parsing never raises anything but GatewayError, whose code and message go
back to the sender as an `error` event; the session carries on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ...config import RATE_RANGE, Settings
from ..errors import GatewayError

CLIENT_TYPES = ("speak", "text.delta", "text.end", "cancel", "session.update", "ping")
MAX_DEPTH = 8


@dataclass
class Limits:
    """Per-message limits; the defaults are the flags' (voxgate/config.py)."""

    max_message_bytes: int = Settings.max_message_bytes
    max_text_chars: int = Settings.max_text_chars
    max_messages_per_s: float = Settings.max_messages_per_s
    # Events a listener leaves unread (a data channel's bufferedAmount) before its session closes.
    max_buffered_bytes: int = Settings.max_channel_buffer_kb * 1024


class RateLimiter:
    """A token bucket: bursts of up to one second's allowance, then the steady rate."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.updated = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def _depth(value, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()] or [level + 1])
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value] or [level + 1])
    return level


def _reject_constant(name: str) -> None:
    # Python's json accepts NaN and Infinity; JSON does not, and they break arithmetic downstream.
    raise ValueError(f"{name} is not JSON")


def decode_json(raw: str | bytes, what: str, hint: str = "", max_bytes: int | None = None) -> object:
    """One JSON text from a client (a message, a frame, a request body) as Python values. Over
    `max_bytes`, not UTF-8, or not JSON (NaN and Infinity included, which Python's parser takes)
    is a GatewayError that names `what`, with `hint` (what to send) after a JSON error; the
    caller checks the value is the object it expects."""
    if max_bytes is not None:
        size = len(raw.encode("utf-8", "surrogatepass")) if isinstance(raw, str) else len(raw)
        if size > max_bytes:
            raise GatewayError("message_too_large", f"{what} is {size} bytes; the limit is {max_bytes}")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise GatewayError("invalid_utf8", f"{what} is not valid UTF-8 text") from None
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise GatewayError("invalid_json", f"{what} is not JSON" + (f"; {hint}" if hint else "")) from None


def parse(raw: str | bytes, limits: Limits) -> dict:
    """Decode and validate one client message."""
    msg = decode_json(raw, "message", "send one JSON object with a 'type'", limits.max_message_bytes)
    if not isinstance(msg, dict):
        raise GatewayError("invalid_message", "message must be a JSON object with a 'type'")
    if _depth(msg) > MAX_DEPTH:
        raise GatewayError("invalid_message", f"message nests deeper than {MAX_DEPTH} levels")
    kind = msg.get("type")
    mid = msg.get("id")
    if mid is not None and not (isinstance(mid, str) and 0 < len(mid) <= 128):
        raise GatewayError("invalid_field", "'id' must be a string of 1 to 128 characters")
    if not isinstance(kind, str):
        raise GatewayError("invalid_message", "message needs a string 'type'", id=mid)
    if kind not in CLIENT_TYPES:
        raise GatewayError("unknown_type", f"unknown message type {kind[:40]!r}; expected one of {', '.join(CLIENT_TYPES)}", id=mid)
    if kind in ("speak", "text.delta"):
        text = msg.get("text")
        if not isinstance(text, str):
            raise GatewayError("invalid_field", f"'{kind}' needs a string 'text'", id=mid)
        if len(text) > limits.max_text_chars:
            raise GatewayError("text_too_long", f"text has {len(text)} characters; the limit per message is {limits.max_text_chars}", id=mid)
        if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            raise GatewayError("invalid_utf8", "text holds unpaired surrogates", id=mid)
        if msg.get("voice") is not None and not isinstance(msg["voice"], str):
            raise GatewayError("invalid_field", "'voice' must be a string", id=mid)
    if kind == "text.end" and mid is None and "id" in msg:
        raise GatewayError("invalid_field", "'id' must be a string", id=mid)
    if kind == "session.update":
        for key in ("voice",):
            if key in msg and msg[key] is not None and not isinstance(msg[key], str):
                raise GatewayError("invalid_field", f"'{key}' must be a string", id=mid)
        if "rate" in msg:
            rate = msg["rate"]
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not RATE_RANGE[0] <= rate <= RATE_RANGE[1]:
                raise GatewayError("invalid_field", f"'rate' must be a number from {RATE_RANGE[0]} to {RATE_RANGE[1]}", id=mid)
        if "words" in msg and not isinstance(msg["words"], bool):
            raise GatewayError("invalid_field", "'words' must be true or false (audio.words events)", id=mid)
        vad = msg.get("vad")
        if vad is not None and not isinstance(vad, dict):
            raise GatewayError("invalid_field", "'vad' must be an object such as {\"enabled\": true}", id=mid)
        barge_in = msg.get("barge_in")
        if barge_in is not None and not isinstance(barge_in, dict):
            raise GatewayError("invalid_field", "'barge_in' must be an object such as {\"min_interrupt_ms\": 400}", id=mid)
        stt = msg.get("stt")
        if stt is not None and not isinstance(stt, dict):
            raise GatewayError("invalid_field", "'stt' must be an object such as {\"enabled\": false}", id=mid)
    return msg
