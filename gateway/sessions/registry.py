"""Who holds each session, beyond the Session itself: the API key that made it (only
that key sees, drives or ends it), the sessions each key holds (for its limit), the
backends and the call attached to it; and the client tokens that bind an output
(a browser's offer, a phone call) to one session. The `Gateway` owns one of each
(gateway/gateway.py) and forgets a session here when it closes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time

from ..errors import GatewayError

_B64URL = re.compile(r"[A-Za-z0-9_-]*")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """Strict unpadded base64url: any character outside the alphabet, or a non-canonical
    ending, is refused (the lenient decoder skipped stray characters, so altered
    tokens still verified)."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("not base64url")
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not canonical base64url")
    return data


class TokenSigner:
    """Issues and checks client tokens bound to one session."""

    def __init__(self, secret: str | bytes | None, ttl_s: float) -> None:
        if secret is None:
            secret = secrets.token_bytes(32)  # tokens then die with the process
        self._key = secret.encode("utf-8") if isinstance(secret, str) else secret
        self.ttl_s = ttl_s

    def issue(self, session_id: str, now: float | None = None) -> str:
        exp = int((now if now is not None else time.time()) + self.ttl_s)
        payload = json.dumps({"sid": session_id, "exp": exp}, separators=(",", ":")).encode("utf-8")
        return _b64(payload) + "." + _b64(self._sign(payload))

    def verify(self, token: object, now: float | None = None) -> str:
        """Returns the session id the token was issued for."""
        if not isinstance(token, str) or token.count(".") != 1 or len(token) > 1024:
            raise GatewayError("invalid_token", "the token is malformed", 401)
        body, sig = token.split(".")
        try:
            payload = _unb64(body)
            given = _unb64(sig)
        except (ValueError, TypeError):
            raise GatewayError("invalid_token", "the token is malformed", 401) from None
        if not hmac.compare_digest(given, self._sign(payload)):
            raise GatewayError("invalid_token", "the token's signature does not match", 401)
        try:
            data = json.loads(payload)
            sid, exp = str(data["sid"]), float(data["exp"])
        except (ValueError, KeyError, TypeError):
            raise GatewayError("invalid_token", "the token is malformed", 401) from None
        if (now if now is not None else time.time()) > exp:
            raise GatewayError("token_expired", "the token has expired; ask the backend for a new one", 403)
        return sid

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()


class SessionRegistry:
    """What the session API knows beyond the Session: who made it, what is attached."""

    def __init__(self) -> None:
        self.made_ahead: set[str] = set()
        # The API key that made each session (None: made without a key, by an
        # anonymous offer or call, or on a server without keys). Only that key
        # sees, drives or ends the session; to any other it does not exist.
        self.owner: dict[str, str | None] = {}
        self.by_key: dict[str, set[str]] = {}
        self.backends: dict[str, dict[str, str]] = {}  # session id -> listener name -> role
        self.calls: dict[str, object] = {}  # session id -> telephony call (signaling.twilio_stream.TwilioCall)

    def owned_by(self, session_id: str, key: str | None) -> bool:
        return session_id in self.owner and self.owner[session_id] == key

    def by_owner(self, key: str) -> list[str]:
        """The ids of the sessions `key` made, ahead or not."""
        return [sid for sid, owner in self.owner.items() if owner == key]

    def add_backend(self, session_id: str, name: str, role: str) -> None:
        """A backend's WebSocket (`name`, "writer" or "watcher") attached to the session."""
        self.backends.setdefault(session_id, {})[name] = role

    def drop_backend(self, session_id: str, name: str) -> None:
        backends = self.backends.get(session_id)
        if backends is not None:
            backends.pop(name, None)

    def add_call(self, session_id: str, call: object) -> None:
        """The telephony call that is the session's output."""
        self.calls[session_id] = call

    def drop_call(self, session_id: str, call: object) -> None:
        """Forget `call`, if it is still the session's (a later call may have joined)."""
        if self.calls.get(session_id) is call:
            del self.calls[session_id]

    def forget(self, session_id: str) -> None:
        self.owner.pop(session_id, None)
        self.made_ahead.discard(session_id)
        self.backends.pop(session_id, None)
        self.calls.pop(session_id, None)
        for ids in self.by_key.values():
            ids.discard(session_id)
