"""The ConversationRelay protocol's messages, as Twilio's and Telnyx's public documentation
describes them: what Voxgate sends the application (`setup`, `prompt`, `dtmf`, `interrupt`,
`error`) and the checks on what the application sends back (`text`, `play`, `sendDigits`,
`language`, `end`). gateway/backends/relay.py acts on them; docs/relay.md lists every field, honoured
or not.

Checking never raises anything but RelayMessageError, whose text goes back to the application
as an `error` message's `description`; the conversation carries on (as the vendors do).
"""

from __future__ import annotations

from typing import Any

from ..sessions.protocol import MAX_DEPTH, _depth

# What the application may send, and the fields each takes (others are refused by name).
APP_TYPES: dict[str, tuple[str, ...]] = {
    "text": ("token", "last", "interruptible", "preemptible", "lang"),
    "play": ("source", "loop", "preemptible", "interruptible", "lang"),
    "sendDigits": ("digits",),
    "language": ("ttsLanguage", "transcriptionLanguage"),
    "end": ("handoffData",),
}
DTMF_DIGITS = "0123456789*#ABCDabcdw"
MAX_DIGITS = 64
MAX_LANGUAGE_CHARS = 35  # BCP 47 tags are short; anything longer is not one
MAX_HANDOFF_CHARS = 16384
MAX_SOURCE_CHARS = 2048
MAX_LOOPS = 1000  # 0 plays until interrupted; --relay-play-max-s bounds every play, loops included


class RelayMessageError(ValueError):
    """A message from the application that cannot be taken; str() is the `error` description."""


# Voxgate -> application
def setup(*, session_id: str, call_sid: str, from_: str, to: str, direction: str, call_type: str,
          custom_parameters: dict[str, str]) -> dict:
    """The first message on the connection. Fields Voxgate cannot know (account, parent call,
    caller name, forwarding) are empty strings, as the vendors send an unknown field."""
    return {
        "type": "setup",
        "sessionId": session_id,
        "accountSid": "",
        "parentCallSid": "",
        "callSid": call_sid,
        "from": from_,
        "to": to,
        "forwardedFrom": "",
        "callType": call_type,
        "callerName": "",
        "direction": direction,
        "callStatus": "in-progress",
        "customParameters": custom_parameters,
    }


def prompt(text: str, lang: str, last: bool) -> dict:
    return {"type": "prompt", "voicePrompt": text, "lang": lang, "last": last}


def dtmf(digit: str) -> dict:
    return {"type": "dtmf", "digit": digit}


def interrupt(heard: str, duration_ms: int) -> dict:
    return {"type": "interrupt", "utteranceUntilInterrupt": heard, "durationUntilInterruptMs": int(duration_ms)}


def error(description: str) -> dict:
    return {"type": "error", "description": description}


# Application -> Voxgate
def _bool(msg: dict, name: str, default: bool) -> bool:
    value = msg.get(name, default)
    if not isinstance(value, bool):
        raise RelayMessageError(f"Invalid message: '{msg['type']}.{name}' must be true or false")
    return value


def _language(msg: dict, name: str) -> str | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LANGUAGE_CHARS or not all(
            c.isascii() and (c.isalnum() or c in "-_") for c in value):
        raise RelayMessageError(f"Invalid message: '{msg['type']}.{name}' must be a language tag such as en-US")
    return value


def check(msg: Any) -> dict:
    """One decoded message from the application, checked; its fields as the vendors name them,
    with the defaults they document filled in."""
    if not isinstance(msg, dict):
        raise RelayMessageError("Invalid message: a message must be a JSON object with a 'type'")
    if _depth(msg) > MAX_DEPTH:
        raise RelayMessageError(f"Invalid message: nests deeper than {MAX_DEPTH} levels")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in APP_TYPES:
        shown = kind[:40] if isinstance(kind, str) else type(kind).__name__
        raise RelayMessageError(f"Invalid message: unknown type {shown!r}; expected one of {', '.join(APP_TYPES)}")
    unknown = sorted(set(msg) - {"type", *APP_TYPES[kind]})
    if unknown:
        raise RelayMessageError(f"Invalid message: '{kind}' has no field {unknown[0][:40]!r}")
    if kind == "text":
        token = msg.get("token")
        if not isinstance(token, str):
            raise RelayMessageError("Invalid message: 'text' needs a string 'token'")
        if any(0xD800 <= ord(c) <= 0xDFFF for c in token):
            raise RelayMessageError("Invalid message: 'text.token' holds unpaired surrogates")
        return {"type": kind, "token": token, "last": _bool(msg, "last", False),
                "interruptible": _bool(msg, "interruptible", True), "preemptible": _bool(msg, "preemptible", False),
                "lang": _language(msg, "lang")}
    if kind == "play":
        source = msg.get("source")
        if not isinstance(source, str) or not 0 < len(source) <= MAX_SOURCE_CHARS:
            raise RelayMessageError(f"Invalid message: 'play' needs a string 'source' of at most {MAX_SOURCE_CHARS} characters")
        loops = msg.get("loop", 1)
        if isinstance(loops, bool) or not isinstance(loops, int) or not 0 <= loops <= MAX_LOOPS:
            raise RelayMessageError(f"Invalid message: 'play.loop' must be an integer from 0 (until interrupted) to {MAX_LOOPS}")
        return {"type": kind, "source": source, "loop": loops, "interruptible": _bool(msg, "interruptible", True),
                "preemptible": _bool(msg, "preemptible", False), "lang": _language(msg, "lang")}
    if kind == "sendDigits":
        digits = msg.get("digits")
        if not isinstance(digits, str) or not 0 < len(digits) <= MAX_DIGITS or any(c not in DTMF_DIGITS for c in digits):
            raise RelayMessageError(f"Invalid message: 'sendDigits.digits' must be 1 to {MAX_DIGITS} of {DTMF_DIGITS}")
        return msg
    if kind == "language":
        tts, stt = _language(msg, "ttsLanguage"), _language(msg, "transcriptionLanguage")
        if tts is None and stt is None:
            raise RelayMessageError("Invalid message: 'language' needs ttsLanguage, transcriptionLanguage or both")
        return {"type": kind, "ttsLanguage": tts, "transcriptionLanguage": stt}
    # end: handoffData is a string (the vendors' apps put JSON in it); anything else is sent on as JSON text.
    handoff = msg.get("handoffData")
    if handoff is not None and not isinstance(handoff, str):
        raise RelayMessageError("Invalid message: 'end.handoffData' must be a string (JSON text, as the vendors take it)")
    if handoff is not None and len(handoff) > MAX_HANDOFF_CHARS:
        raise RelayMessageError(f"Invalid message: 'end.handoffData' is over {MAX_HANDOFF_CHARS} characters")
    return {"type": kind, "handoffData": handoff}
