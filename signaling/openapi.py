"""The HTTP API in OpenAPI 3.1, served at `GET /openapi.json`.

Backend developers generate clients from it, so it must stay true:
tests/security/test_openapi.py checks that it names exactly the server's
routes and that real responses match its schemas, and schemathesis fuzzes the
live server against it (every response documented, never a 5xx).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    _version = version("voxgate")
except PackageNotFoundError:  # running from a source tree that is not installed
    _version = "0.0.0"

JSON = "application/json"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _error(description: str) -> dict:
    return {"$ref": f"#/components/responses/{description}"}


def _errors(*codes: int) -> dict:
    # Every route can meet the host allow-list (421) and the Origin check (403).
    names = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
             408: "RequestTimeout", 409: "Conflict", 413: "TooLarge", 421: "MisdirectedRequest", 429: "TooManyRequests",
             502: "BadGateway", 503: "Unavailable"}
    return {str(c): _error(names[c]) for c in sorted({*codes, 403, 405, 421})}


KEYED: list[dict[str, list[str]]] = [{"ApiKey": []}, {"Bearer": []}, {}]  # {}: servers started without --api-key are open

_string = {"type": "string"}
_id = {"type": "string", "minLength": 1, "maxLength": 64}

SCHEMAS: dict[str, dict] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": _string, "message": _string,
                    "reason": {**_string, "description": "why a 503 at_capacity came: max_sessions, anonymous, "
                               "synthesis (the speech budget), loop_lag or late_frames; draining"},
                    "gateway": {**_string, "description": "in a fleet, the URL of a gateway that has room"},
                },
            }
        },
    },
    "OfferRequest": {
        "type": "object",
        "required": ["sdp"],
        "properties": {
            "sdp": {"type": "string", "description": "the offer's SDP"},
            "type": {"const": "offer"},
            "voice": {"type": "string", "description": "one of the server's voice names (session.ready lists them)"},
            "session_id": {"type": "string", "description": "join this session, made through POST /v1/sessions"},
            "token": {"type": "string", "description": "the session's client token"},
        },
    },
    "OfferAnswer": {
        "type": "object",
        "required": ["sdp", "type", "session_id"],
        "properties": {
            "sdp": _string,
            "type": {"const": "answer"},
            "session_id": _id,
            "token": {"type": "string", "description": "client token of a session made for this offer (trickle ICE)"},
        },
    },
    "Candidate": {
        "type": "object",
        "properties": {
            "candidate": {"type": ["string", "null"], "description": "an a=candidate value; null ends the candidates"},
            "sdpMid": {"type": ["string", "null"]},
            "sdpMLineIndex": {"type": ["integer", "null"]},
            "token": {"type": "string", "description": "the session's client token (or Authorization: Bearer)"},
        },
    },
    "Ok": {"type": "object", "required": ["ok"], "properties": {"ok": {"const": True}}},
    "IceServers": {
        "type": "object",
        "required": ["ice_servers"],
        "properties": {
            "ice_servers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["urls"],
                    "properties": {
                        "urls": {"type": "array", "items": _string},
                        "username": _string,
                        "credential": _string,
                    },
                },
            },
            "ttl": {"type": "integer", "description": "seconds the TURN credentials stay valid"},
        },
    },
    "Ready": {
        "type": "object",
        "required": ["ready", "engine", "accepting", "sessions"],
        "properties": {
            "ready": {"type": "boolean"},
            "engine": {"type": "boolean"},
            "accepting": {"type": "boolean"},
            "sessions": {"type": "integer", "minimum": 0},
            "budget_rtf": {"type": ["number", "null"], "description": "seconds of audio per second the node can "
                           "speak, measured (null until measured)"},
            "demand_rtf": {"type": "number", "description": "seconds of audio per second its sessions are expected to speak"},
            "reason": {**_string, "description": "why not ready: draining, engine, max_sessions, synthesis, loop_lag, late_frames"},
        },
    },
    "SessionCreateRequest": {
        "type": "object",
        "properties": {
            "voice": {"type": "string", "description": "one of the server's voice names"},
            "relay": {"type": "object", "description": "a ConversationRelay application drives the session: url (ws:// or "
                      "wss://) and the vendors' <ConversationRelay> attributes by name (docs/relay.md)",
                      "properties": {"url": {"type": "string"}}},
        },
    },
    "SessionCreated": {
        "type": "object",
        "required": ["session_id", "client_token", "token_expires_in_s", "session_url", "offer_url", "ws_url", "telephony_url"],
        "properties": {
            "session_id": _id,
            "client_token": _string,
            "token_expires_in_s": {"type": "number"},
            "session_url": _string,
            "offer_url": _string,
            "ws_url": _string,
            "telephony_url": _string,
        },
    },
    "SessionState": {
        "type": "object",
        "required": ["session_id", "made_ahead", "codec", "connected", "utterances", "writer", "watchers",
                     "backends", "options", "stats", "created_at", "last_activity"],
        "properties": {
            "session_id": _id,
            "made_ahead": {"type": "boolean"},
            "codec": {"type": ["string", "null"], "enum": ["opus", "pcmu", "pcma", "none", None]},
            "connected": {
                "type": "object",
                "required": ["webrtc", "telephony"],
                "properties": {
                    "webrtc": {"type": ["object", "null"], "properties": {"state": _string}},
                    "telephony": {"type": ["object", "null"], "properties": {"call_sid": {"type": ["string", "null"]}}},
                },
            },
            "utterances": {
                "type": "object",
                "required": ["queued", "playing", "ids"],
                "properties": {
                    "queued": {"type": "integer"},
                    "playing": {"type": ["string", "null"]},
                    "ids": {"type": "array", "items": _string},
                },
            },
            "writer": {"type": ["string", "null"]},
            "relay": {"type": ["object", "null"], "description": "the ConversationRelay application, if one drives the session"},
            "watchers": {"type": "array", "items": _string},
            "backends": {"type": "integer"},
            "options": {
                "type": "object",
                "required": ["voice", "rate", "vad"],
                "properties": {"voice": {"type": ["string", "null"]}, "rate": {"type": "number"}, "vad": {"type": "object"}},
            },
            "stats": {"type": "object", "additionalProperties": {"type": "integer"}},
            "created_at": {"type": "number"},
            "last_activity": {"type": "number"},
        },
    },
    "SessionList": {"type": "object", "required": ["sessions"], "properties": {"sessions": {"type": "array", "items": _ref("SessionState")}}},
    "SessionClosed": {
        "type": "object",
        "required": ["session_id", "closed"],
        "properties": {"session_id": _id, "closed": {"const": True}},
    },
    "TtsRequest": {
        "type": "object",
        "required": ["text"],
        "properties": {
            "text": {"type": "string", "minLength": 1, "description": "at most --max-utterance-chars; speech tags allowed"},
            "format": {"enum": ["wav", "pcm", "mulaw", "opus"], "default": "wav"},
            "voice": {"type": "string", "description": "one of the server's voice names"},
            "rate": {"type": "number", "minimum": 0.25, "maximum": 4.0, "default": 1.0},
        },
    },
    "OpenAISpeechRequest": {
        "type": "object",
        "required": ["input", "voice"],
        "properties": {
            "model": {"type": "string", "maxLength": 256, "description": "any model name (tts-1, gpt-4o-mini-tts...): Voxgate has one engine"},
            "input": {"type": "string", "minLength": 1, "description": "at most --max-utterance-chars; speech tags allowed"},
            "voice": {
                "oneOf": [{"type": "string"}, {"type": "object", "required": ["id"], "properties": {"id": _string}}],
                "description": "one of the server's voice names; OpenAI's built-in names (alloy, echo...) mean the default voice",
            },
            "instructions": {"type": "string", "description": "accepted and not used"},
            "response_format": {"enum": ["mp3", "opus", "aac", "flac", "wav", "pcm"], "default": "mp3"},
            "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0, "default": 1.0},
            "stream_format": {"enum": ["audio", "sse"], "default": "audio"},
        },
    },
}

_error_json = {"content": {JSON: {"schema": _ref("Error")}}}
RESPONSES = {
    "BadRequest": {"description": "the request is malformed or a field is invalid", **_error_json},
    "Unauthorized": {"description": "a key or token is missing or invalid", **_error_json},
    "Forbidden": {"description": "the Origin may not use the API, or a token is for another session or expired", **_error_json},
    "NotFound": {"description": "no such session (or not yours), or no such file", **_error_json},
    "MethodNotAllowed": {
        "description": "the path exists but not with this method",
        "headers": {"Allow": {"schema": _string}},
        **_error_json,
    },
    "RequestTimeout": {"description": "the request body did not arrive in time", **_error_json},
    "Conflict": {"description": "a listener is already attached to the session", **_error_json},
    "TooLarge": {"description": "the request body is over this route's limit", **_error_json},
    "MisdirectedRequest": {"description": "the Host is not one this server answers to (--allowed-host)", **_error_json},
    "TooManyRequests": {
        "description": "a per-key or per-address limit was reached",
        "headers": {"Retry-After": {"schema": _string}},
        **_error_json,
    },
    "BadGateway": {
        "description": "in a fleet (--redis-url): the gateway that holds the session did not answer (owner_unreachable)",
        **_error_json,
    },
    "Unavailable": {
        "description": "at capacity, draining, or the engine is restarting; in a fleet, the session directory "
        "is unreachable (directory_unavailable)",
        "headers": {"Retry-After": {"schema": _string}},
        **_error_json,
    },
}

_session_id = {"name": "session_id", "in": "path", "required": True, "schema": _string}
_websocket = {"101": {"description": "switched to a WebSocket"}}


def _op(summary: str, responses: dict, *, body: dict | None = None, body_required: bool = True,
        params: list | None = None, security: list | None = None) -> dict:
    op: dict = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": {JSON: {"schema": body}}}
    if params:
        op["parameters"] = params
    if security is not None:
        op["security"] = security
    return op


PATHS: dict[str, dict] = {
    "/v1/offer": {
        "post": _op(
            "SDP offer in, answer out; makes a session, or joins one made ahead with its token",
            {"200": _json(_ref("OfferAnswer"), "the answer"), **_errors(400, 401, 404, 408, 409, 413, 429, 502, 503)},
            body=_ref("OfferRequest"),
        )
    },
    "/v1/sessions/{session_id}/candidates": {
        "post": _op(
            "trickle ICE from the peer; needs the session's client token",
            {"200": _json(_ref("Ok"), "the candidate was added"), **_errors(400, 401, 404, 408, 409, 413, 502, 503)},
            body=_ref("Candidate"),
            params=[_session_id],
        )
    },
    "/v1/ice-servers": {
        "get": _op(
            "STUN servers for anyone; TURN servers with credentials only against a client token",
            {"200": _json(_ref("IceServers"), "ICE servers for RTCPeerConnection"), **_errors(401, 404, 502, 503)},
            params=[{"name": "token", "in": "query", "required": False, "schema": _string}],
        )
    },
    "/healthz": {"get": _op("liveness", {"200": _json(_ref("Ok"), "the process is up"), **_errors()})},
    "/readyz": {
        "get": _op(
            "readiness: 503 while draining, full, near its speech budget, or restarting the engine",
            {"200": _json(_ref("Ready"), "ready"), "503": _json(_ref("Ready"), "not ready"), **_errors()},
        )
    },
    "/metrics": {
        "get": _op("Prometheus metrics", {"200": {"description": "text exposition format", "content": {"text/plain": {"schema": _string}}}, **_errors()})
    },
    "/v1/sessions": {
        "post": _op(
            "make a session ahead of its listener; returns its client token",
            {"201": _json(_ref("SessionCreated"), "made"), **_errors(400, 401, 408, 413, 429, 503)},
            body=_ref("SessionCreateRequest"), body_required=False, security=KEYED,
        ),
        "get": _op(
            "the caller's own sessions, or those of one phone call",
            {"200": _json(_ref("SessionList"), "sessions made with this key"), **_errors(401)},
            params=[{"name": "call_sid", "in": "query", "required": False, "schema": _string}],
            security=KEYED,
        ),
    },
    "/v1/sessions/{session_id}": {
        "get": _op("one session's state", {"200": _json(_ref("SessionState"), "state"), **_errors(401, 404, 502, 503)},
                   params=[_session_id], security=KEYED),
        "delete": _op("end a session for everyone", {"200": _json(_ref("SessionClosed"), "ended"), **_errors(401, 404, 502, 503)},
                      params=[_session_id], security=KEYED),
    },
    "/v1/sessions/{session_id}/ws": {
        "get": _op(
            "the backend WebSocket: the data channel's JSON messages, both ways, and with audio=pcm16 the caller's "
            "audio as binary frames (see docs/protocol.md)",
            {**_websocket, **_errors(400, 401, 404, 429, 502, 503)},
            params=[_session_id, {"name": "role", "in": "query", "required": False, "schema": {"enum": ["writer", "watcher"]}},
                    {"name": "audio", "in": "query", "required": False, "schema": {"enum": ["pcm16"]}}],
            security=KEYED,
        )
    },
    "/v1/telephony/twilio": {
        "get": _op("Twilio Media Streams WebSocket (see docs/telephony.md)", {**_websocket, **_errors(400)}),
    },
    "/v1/tts/ws": {
        "get": _op(
            "the bi-streaming TTS WebSocket: text in as it arrives, audio and word timings out, several contexts "
            "per connection (messages: docs/tts-websocket.md)",
            {**_websocket, **_errors(400, 401, 503)},
            params=[{"name": "format", "in": "query", "required": False, "schema": {"enum": ["pcm16", "opus"]}},
                    {"name": "sample_rate", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 8000, "maximum": 48000}},
                    {"name": "voice", "in": "query", "required": False, "schema": _string},
                    {"name": "words", "in": "query", "required": False, "schema": {"enum": ["true", "false"]}},
                    {"name": "key", "in": "query", "required": False, "schema": _string,
                     "description": "the API key, for browsers, which cannot set a WebSocket's headers"}],
            security=KEYED,
        )
    },
    "/v1/tts": {
        "post": _op(
            "text in, audio streamed back as it is synthesized",
            {
                "200": {
                    "description": "audio, chunked",
                    "headers": {
                        "X-Sample-Rate": {"schema": _string},
                        "X-Audio-Format": {"schema": _string},
                        "X-Max-Audio-S": {"schema": _string},
                    },
                    "content": {m: {"schema": {"type": "string", "format": "binary"}} for m in
                                ("audio/wav", "audio/L16", "audio/basic", "audio/ogg")},
                },
                **_errors(400, 401, 408, 413, 429, 503),
            },
            body=_ref("TtsRequest"), security=KEYED,
        )
    },
    "/v1/audio/speech": {
        "post": _op(
            "OpenAI's speech API: audio streamed back as it is synthesized, with the keys, limits and errors of /v1/tts",
            {
                "200": {
                    "description": "audio, chunked; or server-sent events (speech.audio.delta, speech.audio.done) with stream_format sse",
                    "headers": {
                        "X-Sample-Rate": {"schema": _string},
                        "X-Audio-Format": {"schema": _string},
                        "X-Max-Audio-S": {"schema": _string},
                    },
                    "content": {m: {"schema": {"type": "string", "format": "binary"}} for m in
                                ("audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/L16", "text/event-stream")},
                },
                **_errors(400, 401, 408, 413, 429, 503),
            },
            body=_ref("OpenAISpeechRequest"), security=KEYED,
        )
    },
    "/": {"get": _op("the bundled page", {"200": {"description": "HTML", "content": {"text/html": {"schema": _string}}}, **_errors(404)})},
    "/static/{path}": {
        "get": _op(
            "the page's scripts and styles",
            {"200": {"description": "a file", "content": {"*/*": {"schema": _string}}}, **_errors(404)},
            params=[{"name": "path", "in": "path", "required": True, "schema": _string}],
        )
    },
    "/openapi.json": {"get": _op("this document", {"200": _json({"type": "object"}, "OpenAPI 3.1"), **_errors()})},
}


def spec(web: bool = True) -> dict:
    paths = dict(PATHS)
    if not web:
        paths.pop("/", None)
        paths.pop("/static/{path}", None)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Voxgate",
            "version": _version,
            "description": "Real-time WebRTC voice gateway. Errors are always JSON {\"error\": {\"code\", \"message\"}}. "
            "Data-channel and WebSocket messages are described in docs/protocol.md.",
        },
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "responses": RESPONSES,
            "securitySchemes": {
                "ApiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                "Bearer": {"type": "http", "scheme": "bearer"},
            },
        },
    }
