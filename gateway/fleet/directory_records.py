"""What the fleet's session directory (gateway/fleet/directory.py) stores, signed: a session's
record (which gateway holds it, a hash of the key that made it, an expiry), a gateway's entry
in the fleet's list (its expiry) and its published load (speech budget, demand, sessions, expiry), each with an HMAC keyed from the
fleet's shared `--token-secret`, and the checks a reader makes before following one: the
signature, a record's size, a gateway URL's form, a load's ranges. Pure data, no Redis.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

# A record is under 300 bytes; anything much longer is not one of ours and is not parsed.
MAX_RECORD_BYTES = 1024
# A published budget or demand past this (seconds of audio per second) is not a load of ours.
MAX_LOAD_RTF = 1e6
MAX_LOAD_SESSIONS = 10_000_000


def key_id(api_key: str | None) -> str:
    """What the directory stores about a session's API key: a hash that tells keys
    apart without revealing them ("" for a session made without a key)."""
    if api_key is None:
        return ""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class RecordSigner:
    """Signs and checks directory records and gateway entries with a key derived from the
    fleet's shared secret (never the secret itself, which also signs client tokens)."""

    def __init__(self, secret: str | bytes) -> None:
        secret = secret.encode("utf-8") if isinstance(secret, str) else secret
        self._key = hmac.new(secret, b"voxgate directory records v1", hashlib.sha256).digest()

    def sign(self, *fields: str) -> str:
        return hmac.new(self._key, "\n".join(fields).encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()

    def valid(self, sig: object, *fields: str) -> bool:
        return isinstance(sig, str) and hmac.compare_digest(sig.encode("ascii", "replace"), self.sign(*fields).encode("ascii"))


def gateway_url_ok(url: str) -> bool:
    """A gateway's base URL, as --advertise-url must be: http(s)://HOST[:PORT], no path, query or user."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/")
            and not parts.query and not parts.fragment and parts.username is None and parts.password is None)


def gateway_entry(url: str, expires_at: float, signer: RecordSigner) -> str:
    """A gateway's entry in the fleet's list: its expiry, signed."""
    exp = f"{expires_at:.3f}"
    return json.dumps({"exp": exp, "sig": signer.sign("gateway", url, exp)}, separators=(",", ":"))


def gateway_expiry(url: str, raw: str | None, signer: RecordSigner) -> float:
    """When a listed gateway's entry expires; 0 for one unreadable, not validly signed, or not a gateway URL."""
    if raw is None or len(raw) > MAX_RECORD_BYTES:
        return 0.0
    try:
        data = json.loads(raw)
        exp, sig = data["exp"], data["sig"]
        if isinstance(exp, str) and signer.valid(sig, "gateway", url, exp) and gateway_url_ok(url):
            return float(exp)
    except (ValueError, KeyError, TypeError, RecursionError):
        pass
    return 0.0


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    gateway: str  # the holder's advertise URL
    owner: str  # key_id() of the API key that made the session
    expires_at: float  # wall-clock seconds; Redis drops the record then

    def _fields(self) -> tuple[str, ...]:
        return (self.session_id, self.gateway, self.owner, f"{self.expires_at:.3f}")

    def encode(self, signer: RecordSigner) -> str:
        return json.dumps({"gw": self.gateway, "owner": self.owner, "exp": f"{self.expires_at:.3f}",
                           "sig": signer.sign(*self._fields())}, separators=(",", ":"))

    @classmethod
    def decode(cls, session_id: str, raw: str, signer: RecordSigner) -> tuple[SessionRecord | None, str]:
        """(the record, "ok"), or (None, why: "unreadable" or "forged")."""
        if len(raw) > MAX_RECORD_BYTES:
            return None, "unreadable"
        try:
            data = json.loads(raw)
            gw, owner, exp, sig = data["gw"], data.get("owner", ""), data["exp"], data.get("sig")
        except (ValueError, KeyError, TypeError, RecursionError):
            return None, "unreadable"
        if not (isinstance(gw, str) and isinstance(owner, str) and isinstance(exp, str)):
            return None, "unreadable"
        try:
            record = cls(session_id, gw, owner, float(exp))
        except ValueError:
            return None, "unreadable"
        if not signer.valid(sig, session_id, gw, owner, exp) or not gateway_url_ok(gw):
            return None, "forged"
        return record, "ok"


@dataclass
class GatewayLoad:
    """A gateway's load as it published it: real-time factors, seconds of audio per second."""

    budget: float  # inf: not measured yet
    demand: float
    sessions: int
    expires_at: float  # wall-clock seconds

    @property
    def headroom(self) -> float:
        return self.budget - self.demand

    def fields(self) -> tuple[str, str, str, str]:
        budget = "inf" if math.isinf(self.budget) else f"{self.budget:.3f}"
        return (f"{self.expires_at:.3f}", budget, f"{self.demand:.3f}", str(self.sessions))

    def encode(self, url: str, signer: RecordSigner) -> str:
        exp, budget, demand, sessions = self.fields()
        return json.dumps({"exp": exp, "budget": budget, "demand": demand, "sessions": sessions,
                           "sig": signer.sign("load", url, exp, budget, demand, sessions)}, separators=(",", ":"))

    @classmethod
    def decode(cls, url: str, raw: object, signer: RecordSigner) -> GatewayLoad | None:
        """The load, or None when it is unreadable, unsigned or out of range."""
        if not isinstance(raw, str) or len(raw) > MAX_RECORD_BYTES:
            return None
        try:
            data = json.loads(raw)
            exp, budget, demand, sessions, sig = data["exp"], data["budget"], data["demand"], data["sessions"], data["sig"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        if not all(isinstance(x, str) and len(x) <= 32 for x in (exp, budget, demand, sessions)):
            return None
        if not signer.valid(sig, "load", url, exp, budget, demand, sessions):
            return None
        try:
            load = cls(float(budget), float(demand), int(sessions), float(exp))
        except ValueError:
            return None
        if not (0.0 <= load.budget <= MAX_LOAD_RTF or load.budget == math.inf) or not 0.0 <= load.demand <= MAX_LOAD_RTF:
            return None
        if not 0 <= load.sessions <= MAX_LOAD_SESSIONS or not math.isfinite(load.expires_at):
            return None
        return load
