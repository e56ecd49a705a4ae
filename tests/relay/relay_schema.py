"""JSON schemas of what a ConversationRelay application receives, written from the vendors' documented
examples (Twilio's "ConversationRelay WebSocket messages" and Telnyx's "ConversationRelay WebSocket
channel"): each message's fields, their types, and nothing else."""

from __future__ import annotations

_STRING = {"type": "string"}

SETUP = {
    "type": "object",
    "properties": {
        "type": {"const": "setup"},
        "sessionId": {"type": "string", "minLength": 1},
        "accountSid": _STRING,
        "parentCallSid": _STRING,
        "callSid": _STRING,
        "from": _STRING,
        "to": _STRING,
        "forwardedFrom": _STRING,
        "callType": _STRING,
        "callerName": _STRING,
        "direction": {"enum": ["inbound", "outbound"]},
        "callStatus": _STRING,
        "customParameters": {"type": "object", "additionalProperties": _STRING},
    },
    "required": ["type", "sessionId", "callSid", "from", "to", "direction", "customParameters"],
    "additionalProperties": False,
}
PROMPT = {
    "type": "object",
    "properties": {"type": {"const": "prompt"}, "voicePrompt": _STRING, "lang": _STRING, "last": {"type": "boolean"}},
    "required": ["type", "voicePrompt", "lang", "last"],
    "additionalProperties": False,
}
DTMF = {
    "type": "object",
    "properties": {"type": {"const": "dtmf"}, "digit": {"type": "string", "pattern": "^[0-9*#A-D]$"}},
    "required": ["type", "digit"],
    "additionalProperties": False,
}
INTERRUPT = {
    "type": "object",
    "properties": {"type": {"const": "interrupt"}, "utteranceUntilInterrupt": _STRING,
                   "durationUntilInterruptMs": {"type": ["integer", "string"]}},
    "required": ["type", "utteranceUntilInterrupt", "durationUntilInterruptMs"],
    "additionalProperties": False,
}
ERROR = {
    "type": "object",
    "properties": {"type": {"const": "error"}, "description": _STRING},
    "required": ["type", "description"],
    "additionalProperties": False,
}
RECEIVED = {"oneOf": [SETUP, PROMPT, DTMF, INTERRUPT, ERROR]}
