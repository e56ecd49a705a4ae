"""A session's ConversationRelay options: the `<ConversationRelay>` attributes an application
was configured with on the vendor's side, given to Voxgate as the `relay` object of
`POST /v1/sessions`, as `<Parameter>`s on the Twilio bridge, or as the server's --relay-url.

The attributes keep the vendors' names, so an application's configuration moves unchanged.
Those Voxgate acts on are fields here; those it takes and ignores are listed in IGNORED
(docs/relay.md says why for each); any other name is refused, so a typo is not silently lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..errors import GatewayError

INTERRUPTIBLE = ("none", "dtmf", "speech", "any")
SENSITIVITY = ("low", "medium", "high")
# Caller speech before it interrupts, by interruptSensitivity (barge_in.min_interrupt_ms): high hears less.
SENSITIVITY_MS = {"low": 400, "medium": 200, "high": 100}
# Accepted and not acted on: the vendor's choice of providers and models, and its own features.
IGNORED = ("ttsProvider", "transcriptionProvider", "speechModel", "elevenlabsTextNormalization",
           "intelligenceService", "debug", "hints", "preemptible", "reportInputDuringAgentSpeech", "profanityFilter")
MAX_TEXT = 2000  # welcomeGreeting's characters
MAX_PARAMETERS = 32
MAX_PARAMETER_CHARS = 1024
# The Twilio bridge: these <Parameter> names are Voxgate's own, never the application's customParameters.
BRIDGE_NAMES = ("session_id", "token", "relay_url")


@dataclass
class RelayOptions:
    url: str
    auth_token: str | None = None  # signs the handshake (X-Twilio-Signature); --twilio-auth-token if not given
    welcome_greeting: str = ""
    welcome_greeting_interruptible: str = "any"
    interruptible: str = "any"
    interrupt_sensitivity: str | None = None  # None: the session's own min_interrupt_ms
    voice: str | None = None
    language: str = "en-US"
    tts_language: str | None = None
    transcription_language: str | None = None
    dtmf_detection: bool = False
    partial_prompts: bool = False
    custom_parameters: dict[str, str] = field(default_factory=dict)
    # `<Connect action>`: where the conversation's end is POSTed (gateway/backends/relay_status.py); `statusCallback` too.
    action: str | None = None
    ignored: dict[str, object] = field(default_factory=dict)  # taken, not acted on (GET shows them)

    @property
    def prompt_language(self) -> str:
        return self.transcription_language or self.language


def check_url(url: object) -> str:
    if not isinstance(url, str) or len(url) > 2048:
        raise GatewayError("invalid_field", "'relay.url' must be a ws:// or wss:// URL")
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise GatewayError("invalid_field", f"'relay.url' must be a ws:// or wss:// URL, not {url[:80]!r}")
    return url


def check_action_url(name: str, url: object) -> str:
    if not isinstance(url, str) or len(url) > 2048:
        raise GatewayError("invalid_field", f"'relay.{name}' must be an http:// or https:// URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GatewayError("invalid_field", f"'relay.{name}' must be an http:// or https:// URL, not {url[:80]!r}")
    return url


def _flag(name: str, value: object) -> bool:
    # <Parameter> values are strings; the JSON body may use booleans.
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise GatewayError("invalid_field", f"'relay.{name}' must be true or false")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if isinstance(value, bool) and choices == INTERRUPTIBLE:
        return "any" if value else "none"  # the vendors' older boolean form
    if isinstance(value, str) and value.lower() in ("true", "false") and choices == INTERRUPTIBLE:
        return "any" if value.lower() == "true" else "none"
    if not isinstance(value, str) or value.lower() not in choices:
        raise GatewayError("invalid_field", f"'relay.{name}' must be one of {', '.join(choices)}")
    return value.lower()


def _text(name: str, value: object, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise GatewayError("invalid_field", f"'relay.{name}' must be a string of at most {limit} characters")
    return value


def _parameters(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_PARAMETERS:
        raise GatewayError("invalid_field", f"'relay.customParameters' must be an object of at most {MAX_PARAMETERS} strings")
    out = {}
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > MAX_PARAMETER_CHARS:
            raise GatewayError("invalid_field", "'relay.customParameters' takes string values of at most "
                               f"{MAX_PARAMETER_CHARS} characters under names of at most 64")
        out[key] = item
    return out


def parse_options(data: dict, *, default_url: str | None = None) -> RelayOptions:
    """The relay object of a request (or the Twilio bridge's parameters), checked: GatewayError (400) names the field."""
    url = check_url(data.get("url", default_url))
    opts = RelayOptions(url=url)
    for name, value in data.items():
        if name == "url":
            continue
        if name == "authToken":
            opts.auth_token = _text(name, value, 256)
        elif name == "welcomeGreeting":
            opts.welcome_greeting = _text(name, value, MAX_TEXT)
        elif name == "welcomeGreetingInterruptible":
            opts.welcome_greeting_interruptible = _choice(name, value, INTERRUPTIBLE)
        elif name == "interruptible":
            opts.interruptible = _choice(name, value, INTERRUPTIBLE)
        elif name == "interruptSensitivity":
            opts.interrupt_sensitivity = _choice(name, value, SENSITIVITY)
        elif name == "voice":
            opts.voice = _text(name, value, 128) or None
        elif name in ("language", "ttsLanguage", "transcriptionLanguage"):
            text = _text(name, value, 35)
            if name == "language":
                opts.language = text or opts.language
            elif name == "ttsLanguage":
                opts.tts_language = text or None
            else:
                opts.transcription_language = text or None
        elif name == "dtmfDetection":
            opts.dtmf_detection = _flag(name, value)
        elif name == "partialPrompts":
            opts.partial_prompts = _flag(name, value)
        elif name == "customParameters":
            opts.custom_parameters = _parameters(value)
        elif name in ("action", "statusCallback"):
            opts.action = check_action_url(name, value) if value else None
        elif name in IGNORED:
            opts.ignored[name] = value if isinstance(value, (str, bool, int, float)) else "(given)"
        else:
            raise GatewayError("invalid_field", f"'relay' has no attribute {str(name)[:40]!r}; docs/relay.md lists them")
    return opts


def options_from_parameters(params: dict, default_url: str | None) -> RelayOptions | None:
    """A Twilio call's relay options from its <Parameter>s: `relay_url` (or the server's --relay-url)
    and the attributes by their vendor names; every other parameter is the application's own
    customParameters, as on the vendor. None: no relay for this call."""
    url = params.get("relay_url") or default_url
    if not url:
        return None
    known = {"url", "authToken", "customParameters"}
    attributes = {name: value for name, value in params.items()
                  if name not in known and name not in BRIDGE_NAMES and (name in IGNORED or name in _ATTRIBUTES)}
    custom = {name: value for name, value in params.items() if name not in BRIDGE_NAMES and name not in attributes}
    opts = parse_options({"url": url, **attributes})
    opts.custom_parameters = _parameters({k: str(v) for k, v in list(custom.items())[:MAX_PARAMETERS]})
    return opts


_ATTRIBUTES = ("welcomeGreeting", "welcomeGreetingInterruptible", "interruptible", "interruptSensitivity", "voice",
               "language", "ttsLanguage", "transcriptionLanguage", "dtmfDetection", "partialPrompts", "action",
               "statusCallback")
