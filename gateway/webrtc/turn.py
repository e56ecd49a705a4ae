"""Short-lived TURN credentials, coturn's REST-auth scheme ("use-auth-secret").

The gateway and the TURN server share one secret. The username carries its
own expiry, `<unix expiry>:<user>`, and the credential is
`base64(HMAC-SHA1(secret, username))`, so the TURN server checks a
credential without asking anyone and a leaked one dies on its own.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time


def turn_credentials(
    secret: str | bytes,
    ttl_s: int,
    user: str,
    urls: list[str] | str,
    now: float | None = None,
) -> dict:
    """An RTCIceServer entry `{"urls", "username", "credential", "ttl"}` valid for `ttl_s` seconds."""
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    if ":" in user:
        # coturn reads the expiry up to the first ':'; keep the rest unambiguous.
        raise ValueError("user must not contain ':'")
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    expiry = int(now if now is not None else time.time()) + int(ttl_s)
    username = f"{expiry}:{user}"
    digest = hmac.new(key, username.encode("utf-8"), hashlib.sha1).digest()
    return {
        "urls": [urls] if isinstance(urls, str) else list(urls),
        "username": username,
        "credential": base64.b64encode(digest).decode("ascii"),
        "ttl": int(ttl_s),
    }
