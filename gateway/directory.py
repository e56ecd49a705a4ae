"""The fleet's session directory: which gateway holds each session, kept in Redis.

Each gateway records every session it holds under `voxgate:session:{id}`: the
holder's advertise URL, the id of the API key that made it (a hash, never the
key), and an expiry. The record's Redis TTL is `--directory-ttl-s`; the holder
rewrites every live record each third of it, so a gateway that dies leaves
records that expire within one TTL, and a Redis that restarts empty is filled
again by the next refresh. A session's record is deleted when it closes.

Redis being down never breaks a gateway's own sessions: operations raise
`DirectoryUnavailable`, `up` turns False, and the refresh loop keeps trying.

redis-py is imported only when a directory is made (`--redis-url`), so a
standalone gateway does not need it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

KEY_PREFIX = "voxgate:session:"
# Each Redis call gives up after this long: a directory lookup sits in front of
# a request, and a dead Redis must cost a quick 503, not a hung request.
REDIS_TIMEOUT_S = 1.0
# Records are rewritten this often, as a share of their TTL: two refreshes may
# fail before a live session's record expires.
REFRESH_SHARE = 1 / 3
# The most a create request waits for its session's first write to Redis.
CLAIM_WAIT_S = 2.0

# Rewrite a record if it is absent (Redis restarted, or it expired during an
# outage), ours, or not a record at all (unreadable JSON must not stop the
# refresh of every other session); never take over another gateway's record.
_REFRESH_LUA = """
local v = redis.call('GET', KEYS[1])
local ok, rec = pcall(cjson.decode, v or '')
if v and ok and type(rec) == 'table' and rec['gw'] ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
# Delete a record only while it is ours.
_RELEASE_LUA = """
local v = redis.call('GET', KEYS[1])
local ok, rec = pcall(cjson.decode, v or '')
if v and ok and type(rec) == 'table' and rec['gw'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class DirectoryUnavailable(Exception):
    """Redis did not answer; the message says why."""


def key_id(api_key: str | None) -> str:
    """What the directory stores about a session's API key: a hash that tells keys
    apart without revealing them ("" for a session made without a key)."""
    if api_key is None:
        return ""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    gateway: str  # the holder's advertise URL
    owner: str  # key_id() of the API key that made the session
    expires_at: float  # wall-clock seconds; Redis drops the record then

    def encode(self) -> str:
        return json.dumps({"gw": self.gateway, "owner": self.owner, "exp": round(self.expires_at, 3)}, separators=(",", ":"))

    @classmethod
    def decode(cls, session_id: str, raw: str) -> SessionRecord | None:
        try:
            data = json.loads(raw)
            return cls(session_id, str(data["gw"]), str(data.get("owner", "")), float(data["exp"]))
        except (ValueError, KeyError, TypeError):
            log.warning("directory record for %s is not one of ours: %.80r", session_id, raw)
            return None


class Directory:
    """This gateway's view of the fleet's session directory."""

    def __init__(
        self, redis_url: str, advertise_url: str, ttl_s: float, on_up: Callable[[bool], None] | None = None
    ) -> None:
        from redis.asyncio import Redis
        from redis.backoff import NoBackoff
        from redis.asyncio.retry import Retry

        self.advertise_url = advertise_url.rstrip("/")
        self.ttl_s = ttl_s
        # One retry at once: after a Redis restart the pooled connections are dead,
        # and the retry reconnects; a Redis that is really down fails fast.
        self._redis = Redis.from_url(
            redis_url,
            decode_responses=True,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 1),
        )
        self._refresh_script = self._redis.register_script(_REFRESH_LUA)
        self._release_script = self._redis.register_script(_RELEASE_LUA)
        self.held: dict[str, str] = {}  # session id -> key_id of its owner
        self._claims: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._refresher: asyncio.Task | None = None
        self._on_up = on_up or (lambda up: None)
        self.up = False

    async def start(self) -> None:
        self._refresher = asyncio.ensure_future(self._refresh_loop())

    async def close(self) -> None:
        """Stop refreshing and delete the records of the sessions still held."""
        if self._refresher is not None:
            self._refresher.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=REDIS_TIMEOUT_S * 2)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid in list(self.held):
                    await self._release_script(keys=[KEY_PREFIX + sid], args=[self.advertise_url], client=pipe)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - shutting down: the records expire anyway
            log.info("directory: records not removed at shutdown (%s); they expire within %g s", exc, self.ttl_s)
        self.held.clear()
        await self._redis.aclose()

    def _mark(self, up: bool) -> None:
        if up != self.up:
            (log.info if up else log.warning)("session directory %s", "reachable" if up else "unreachable")
        self.up = up
        self._on_up(up)

    def _record(self, sid: str, owner: str) -> SessionRecord:
        return SessionRecord(sid, self.advertise_url, owner, time.time() + self.ttl_s)

    async def _call(self, coro):
        try:
            result = await coro
        except Exception as exc:  # redis.RedisError, OSError, and timeouts alike
            self._mark(False)
            raise DirectoryUnavailable(f"{type(exc).__name__}: {exc}") from None
        self._mark(True)
        return result

    # Sessions this gateway holds
    def hold(self, session_id: str, api_key: str | None, on_taken: Callable[[], None]) -> None:
        """Record a new session; `on_taken` runs if another gateway holds the id already."""
        owner = key_id(api_key)
        self.held[session_id] = owner
        self._claims[session_id] = self._spawn(self._claim(session_id, owner, on_taken))

    async def _claim(self, sid: str, owner: str, on_taken: Callable[[], None]) -> bool:
        key, px = KEY_PREFIX + sid, int(self.ttl_s * 1000)
        try:
            if await self._call(self._redis.set(key, self._record(sid, owner).encode(), nx=True, px=px)):
                return True
            if await self._call(self._refresh_script(keys=[key], args=[self._record(sid, owner).encode(), self.advertise_url, px])):
                return True  # already ours: a refresh got there first
        except DirectoryUnavailable as exc:
            # The session works locally; the next refresh that reaches Redis records it.
            log.warning("session %s not in the directory yet: %s", sid, exc, extra={"session_id": sid})
            return True
        finally:
            self._claims.pop(sid, None)
        log.error("session id %s is held by another gateway; closing this one", sid, extra={"session_id": sid})
        self.held.pop(sid, None)
        on_taken()
        return False

    async def claimed(self, session_id: str) -> bool:
        """Wait for a new session's first write; False if its id turned out to be taken."""
        task = self._claims.get(session_id)
        if task is None:
            return session_id in self.held
        done, _ = await asyncio.wait([task], timeout=CLAIM_WAIT_S)
        return task.result() if done else True

    def release(self, session_id: str) -> None:
        if self.held.pop(session_id, None) is not None:
            self._spawn(self._release(session_id))

    async def _release(self, sid: str) -> None:
        claim = self._claims.get(sid)
        if claim is not None:
            await asyncio.wait([claim])
        try:
            await self._call(self._release_script(keys=[KEY_PREFIX + sid], args=[self.advertise_url]))
        except DirectoryUnavailable:
            pass  # the record expires within one TTL

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # Any session in the fleet
    async def lookup(self, session_id: str) -> SessionRecord | None:
        """Where a session lives; None for an unknown or expired id. Raises DirectoryUnavailable."""
        raw = await self._call(self._redis.get(KEY_PREFIX + session_id))
        return None if raw is None else SessionRecord.decode(session_id, raw)

    def is_self(self, record: SessionRecord) -> bool:
        return record.gateway.rstrip("/") == self.advertise_url

    # Refresh
    async def refresh(self) -> int:
        """Rewrite every held session's record (all of them, so that a Redis that
        lost its data is rebuilt); returns how many were written."""
        held = dict(self.held)
        if not held:
            await self._call(self._redis.ping())
            return 0
        px = int(self.ttl_s * 1000)

        async def write() -> list:
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid, owner in held.items():
                    await self._refresh_script(
                        keys=[KEY_PREFIX + sid], args=[self._record(sid, owner).encode(), self.advertise_url, px], client=pipe
                    )
                return await pipe.execute()

        results = await self._call(write())
        return sum(1 for r in results if r == 1)

    async def _refresh_loop(self) -> None:
        interval = self.ttl_s * REFRESH_SHARE
        while True:
            try:
                await self.refresh()
            except DirectoryUnavailable as exc:
                log.warning("directory refresh failed: %s; retrying in %.1f s", exc, interval)
            await asyncio.sleep(interval)
