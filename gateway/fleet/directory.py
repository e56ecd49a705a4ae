"""The fleet's session directory: which gateway holds each session, kept in Redis.

Each gateway records every session it holds under `voxgate:session:{id}`: the
holder's advertise URL, the id of the API key that made it (a hash, never the
key), and an expiry. The record's Redis TTL is `--directory-ttl-s`; the holder
rewrites every live record each third of it, so a gateway that dies leaves
records that expire within one TTL, and a Redis that restarts empty is filled
again by the next refresh. A session's record is deleted when it closes.

Redis being down never breaks a gateway's own sessions: operations raise
`DirectoryUnavailable`, `up` turns False, and the refresh loop keeps trying.

Whoever can write to Redis must not be able to send a session's requests (and
the API key on them) elsewhere, so records are signed: an HMAC keyed from the
fleet's shared `--token-secret` over the session id and every field. Each
gateway also lists itself, signed, in `voxgate:gateways` with each refresh; a
record is followed only when its signature holds and it names a gateway on
that list. A record that fails its signature is ignored by readers and
rewritten by its holder at the next refresh. Lookups have a connection pool
of their own that waits up to `REDIS_TIMEOUT_S` for a connection, so a flood
of them queues or fails fast, and never takes the connections the records'
refreshes need.

Each gateway also publishes its load every LOAD_INTERVAL_S in `voxgate:load`,
signed the same way: its speech budget and the demand it plans with (real-time
factors, gateway/load/admission.py) and its session count, with an expiry of
LOAD_TTL_S. From these a gateway places a new session (`placement`) on the
gateway of the fleet with the most headroom (budget less demand), and names one
with room (`room_elsewhere`) when it refuses a session for capacity itself. A
load that is stale, unsigned, out of range, or of a gateway not on the list is
not used.

The records and loads themselves, their signing and the checks on them, are
gateway/fleet/directory_records.py; this module reads and writes them in Redis.

redis-py is imported only when a directory is made (`--redis-url`), so a
standalone gateway does not need it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable

from .directory_records import (
    MAX_LOAD_RTF, GatewayLoad, RecordSigner, SessionRecord, gateway_entry, gateway_expiry, key_id,
)
from ..errors import GatewayError

if TYPE_CHECKING:
    from ..sessions.session import Session

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

GATEWAYS_KEY = "voxgate:gateways"  # hash: advertise URL -> signed expiry
LOAD_KEY = "voxgate:load"  # hash: advertise URL -> signed load (budget, demand, sessions, expiry)
# Each gateway writes its load and reads the others' this often; a load older than
# LOAD_TTL_S (three writes missed) is not placed on.
LOAD_INTERVAL_S = 1.0
LOAD_TTL_S = 3.0
# Connections for lookups, which sit in front of requests: more wait for one, up to REDIS_TIMEOUT_S.
LOOKUP_CONNECTIONS = 32
# The most often a gateway logs that it met a forged or unreadable record.
FORGED_LOG_INTERVAL_S = 10.0

# Rewrite a record if it is absent (Redis restarted, or it expired during an
# outage), ours, not a record at all (unreadable JSON must not stop the
# refresh of every other session), or exactly the value the caller found
# forged (ARGV[4]); another gateway's record is returned unchanged, for the
# caller to check its signature (Redis's Lua has no HMAC).
_REFRESH_LUA = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[4] then
  local ok, rec = pcall(cjson.decode, v)
  if ok and type(rec) == 'table' and rec['gw'] ~= ARGV[2] then return v end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
# Delete a gateway's entry only while it is the value that was found stale.
_FORGET_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
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


class RecordRefused(DirectoryUnavailable):
    """The session's record is unreadable or not validly signed: where the session lives is
    unknown until its holder rewrites it (at its next refresh)."""


class Directory:
    """This gateway's view of the fleet's session directory."""

    def __init__(
        self, redis_url: str, advertise_url: str, ttl_s: float, secret: str | bytes,
        on_up: Callable[[bool], None] | None = None, on_forged: Callable[[str], None] | None = None,
        password: str | None = None,
    ) -> None:
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.backoff import NoBackoff
        from redis.asyncio.retry import Retry

        self.advertise_url = advertise_url.rstrip("/")
        self.ttl_s = ttl_s
        self.signer = RecordSigner(secret)
        # One retry at once: after a Redis restart the pooled connections are dead,
        # and the retry reconnects; a Redis that is really down fails fast.
        options: dict[str, Any] = dict(decode_responses=True, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
                       retry=Retry(NoBackoff(), 1))
        if password:
            options["password"] = password  # else the URL's own, if it has one
        self._redis = Redis.from_url(redis_url, **options)  # this gateway's own records
        self._lookups = Redis(connection_pool=BlockingConnectionPool.from_url(
            redis_url, max_connections=LOOKUP_CONNECTIONS, timeout=REDIS_TIMEOUT_S, **options))
        self._refresh_script = self._redis.register_script(_REFRESH_LUA)
        self._release_script = self._redis.register_script(_RELEASE_LUA)
        self._forget_script = self._redis.register_script(_FORGET_LUA)
        self.held: dict[str, str] = {}  # session id -> key_id of its owner
        self.gateways: dict[str, float] = {}  # the fleet's gateways as last read: URL -> expiry
        self._claims: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._refresher: asyncio.Task | None = None
        self._on_up = on_up or (lambda up: None)
        self._on_forged = on_forged or (lambda why: None)
        self._forged_logged_at = -FORGED_LOG_INTERVAL_S
        self.up = False
        # This gateway's load as (budget, demand, sessions), published every LOAD_INTERVAL_S.
        self.load_source: Callable[[], tuple[float, float, int]] | None = None
        self.loads: dict[str, GatewayLoad] = {}  # the other gateways' loads as last read
        self._loads_read_at = -math.inf
        self._publisher: asyncio.Task | None = None

    async def start(self) -> None:
        self._refresher = asyncio.ensure_future(self._refresh_loop())
        if self.load_source is not None:
            self._publisher = asyncio.ensure_future(self._load_loop())

    async def close(self) -> None:
        """Stop refreshing and delete the records of the sessions still held."""
        for task in (self._refresher, self._publisher):
            if task is not None:
                task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=REDIS_TIMEOUT_S * 2)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid in list(self.held):
                    await self._release_script(keys=[KEY_PREFIX + sid], args=[self.advertise_url], client=pipe)
                pipe.hdel(GATEWAYS_KEY, self.advertise_url)
                pipe.hdel(LOAD_KEY, self.advertise_url)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - shutting down: the records expire anyway
            log.info("directory: records not removed at shutdown (%s); they expire within %g s", exc, self.ttl_s)
        self.held.clear()
        await self._redis.aclose()
        await self._lookups.aclose()

    def _mark(self, up: bool) -> None:
        if up != self.up:
            (log.info if up else log.warning)("session directory %s", "reachable" if up else "unreachable")
        self.up = up
        self._on_up(up)

    def _record(self, sid: str, owner: str) -> str:
        return SessionRecord(sid, self.advertise_url, owner, time.time() + self.ttl_s).encode(self.signer)

    def _forged(self, sid: str, why: str, raw: str) -> None:
        """A record that is not one of ours, or whose signature fails: counted, and logged
        at most every FORGED_LOG_INTERVAL_S (whoever writes them chooses how many)."""
        self._on_forged(why)
        now = time.monotonic()
        if now - self._forged_logged_at >= FORGED_LOG_INTERVAL_S:
            self._forged_logged_at = now
            log.warning("directory record for session %s is %s (%.80r); ignored, and rewritten by its holder "
                        "(logged at most every %g s)", sid, "unreadable" if why == "unreadable" else
                        "not signed with the fleet's --token-secret", raw, FORGED_LOG_INTERVAL_S)

    async def _call(self, coro, mark: bool = True):
        try:
            result = await coro
        except Exception as exc:  # redis.RedisError, OSError, and timeouts alike
            if mark:
                self._mark(False)
            raise DirectoryUnavailable(f"{type(exc).__name__}: {exc}") from None
        if mark:
            self._mark(True)
        return result

    # Sessions this gateway holds
    def track(self, session: Session, api_key: str | None) -> None:
        """Gateway.on_session_created: hold the session until it closes; close it if another gateway holds its id."""
        self.hold(session.id, api_key, lambda: asyncio.ensure_future(session.close("session id taken by another gateway")))
        session.on_close.append(lambda s: self.release(s.id))

    def hold(self, session_id: str, api_key: str | None, on_taken: Callable[[], object]) -> None:
        """Record a new session; `on_taken` runs if another gateway holds the id already."""
        owner = key_id(api_key)
        self.held[session_id] = owner
        self._claims[session_id] = self._spawn(self._claim(session_id, owner, on_taken))

    async def _claim(self, sid: str, owner: str, on_taken: Callable[[], object]) -> bool:
        key, px = KEY_PREFIX + sid, int(self.ttl_s * 1000)
        try:
            if await self._call(self._redis.set(key, self._record(sid, owner), nx=True, px=px)):
                return True
            if await self._rewrite(sid, owner, px):
                return True  # already ours (a refresh got there first), or a forgery now replaced
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

    async def _rewrite(self, sid: str, owner: str, px: int, result=None) -> bool:
        """Write this gateway's record for `sid` (`result`: the refresh script's answer, when a
        pipeline already ran it); False only when a validly signed record of another gateway holds it."""
        key = KEY_PREFIX + sid
        if result is None:
            result = await self._call(self._refresh_script(keys=[key], args=[self._record(sid, owner), self.advertise_url, px, ""]))
        if result == 1:
            return True
        _, why = SessionRecord.decode(sid, result, self.signer)
        if why == "ok":
            return False
        self._forged(sid, why, result)
        # Replaced only if it is still that value: a real claim that came meanwhile stands.
        again = await self._call(self._refresh_script(keys=[key], args=[self._record(sid, owner), self.advertise_url, px, result]))
        return again == 1

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

    async def _quietly(self, coro) -> None:
        try:
            await self._call(coro)
        except DirectoryUnavailable:
            pass  # tried again at the next refresh

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # Any session in the fleet
    async def lookup(self, session_id: str) -> SessionRecord | None:
        """Where a session lives; None for an unknown or expired id. Raises RecordRefused for a
        record that is unreadable or not validly signed, and DirectoryUnavailable when Redis does
        not answer (or no lookup connection frees up within REDIS_TIMEOUT_S)."""
        raw = await self._call(self._lookups.get(KEY_PREFIX + session_id), mark=False)
        if raw is None:
            return None
        record, why = SessionRecord.decode(session_id, raw, self.signer)
        if record is None:
            self._forged(session_id, why, raw)
            raise RecordRefused(f"the record is {why}")
        return record

    async def find(self, session_id: str) -> SessionRecord | None:
        """The record of a session another gateway of the fleet holds, for a route to send its
        request there; None for an unknown or expired id, or one held here. GatewayError (503)
        when Redis does not answer (directory_unavailable), the record fails its check
        (record_refused) or names a gateway not on the fleet's list (owner_unknown)."""
        try:
            record = await self.lookup(session_id)
            if record is None or self.is_self(record):
                return None
            if await self.is_gateway(record.gateway):
                return record
        except RecordRefused:
            raise GatewayError("record_refused", "the session's directory record failed its check and is not followed; "
                               "its gateway rewrites it shortly; retry", 503) from None
        except DirectoryUnavailable:
            raise GatewayError("directory_unavailable", "this gateway does not hold the session and cannot reach the "
                               "session directory; retry shortly", 503) from None
        log.warning("a directory record names %s, which is not a gateway of the fleet; not followed", record.gateway)
        raise GatewayError("owner_unknown", "the session's record names a gateway that is not in the fleet's list; retry shortly", 503)

    def is_self(self, record: SessionRecord) -> bool:
        return record.gateway.rstrip("/") == self.advertise_url

    async def is_gateway(self, url: str) -> bool:
        """Whether `url` is a gateway of the fleet: listed, validly signed and unexpired, as last
        read, or read now for one not seen yet (a gateway that just started)."""
        url = url.rstrip("/")
        if self.gateways.get(url, 0.0) > time.time():
            return True
        raw = await self._call(self._lookups.hget(GATEWAYS_KEY, url), mark=False)
        expires = gateway_expiry(url, raw, self.signer)
        if expires > time.time():
            self.gateways[url] = expires
            return True
        return False

    # Refresh
    async def refresh(self) -> int:
        """Rewrite every held session's record (all of them, so that a Redis that
        lost its data is rebuilt) and this gateway's entry in the list of gateways, and
        read that list; returns how many records were written."""
        held = dict(self.held)
        px = int(self.ttl_s * 1000)

        async def write() -> list:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(GATEWAYS_KEY, self.advertise_url, gateway_entry(self.advertise_url, time.time() + self.ttl_s, self.signer))
                pipe.hgetall(GATEWAYS_KEY)
                for sid, owner in held.items():
                    await self._refresh_script(
                        keys=[KEY_PREFIX + sid], args=[self._record(sid, owner), self.advertise_url, px, ""], client=pipe
                    )
                return await pipe.execute()

        results = await self._call(write())
        now = time.time()
        gateways = {}
        for url, raw in (results[1] or {}).items():
            expires = gateway_expiry(url, raw, self.signer)
            if expires > now:
                gateways[url] = expires
            else:  # gone (three refreshes missed), or never one of us; unless rewritten meanwhile
                self._spawn(self._quietly(self._forget_script(keys=[GATEWAYS_KEY], args=[url, raw])))
        self.gateways = gateways
        written = 0
        for (sid, owner), result in zip(held.items(), results[2:]):
            if result == 1 or await self._rewrite(sid, owner, px, result):
                written += 1
        return written

    async def _refresh_loop(self) -> None:
        interval = self.ttl_s * REFRESH_SHARE
        while True:
            try:
                await self.refresh()
            except DirectoryUnavailable as exc:
                log.warning("directory refresh failed: %s; retrying in %.1f s", exc, interval)
            await asyncio.sleep(interval)

    # Load and placement
    async def publish_load(self) -> None:
        """Write this gateway's load and read every gateway's (raises DirectoryUnavailable)."""
        if self.load_source is None:
            return
        budget, demand, sessions = self.load_source()
        budget = max(0.0, min(MAX_LOAD_RTF, budget)) if math.isfinite(budget) else math.inf
        own = GatewayLoad(budget, max(0.0, min(MAX_LOAD_RTF, demand)), max(0, int(sessions)), time.time() + LOAD_TTL_S)

        async def write() -> list:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(LOAD_KEY, self.advertise_url, own.encode(self.advertise_url, self.signer))
                pipe.hgetall(LOAD_KEY)
                return await pipe.execute()

        results = await self._call(write())
        now = time.time()
        loads = {}
        for url, raw in (results[1] or {}).items():
            url = url.rstrip("/")
            load = GatewayLoad.decode(url, raw, self.signer)
            if load is not None and load.expires_at > now:
                if url != self.advertise_url and (self.gateways.get(url, 0.0) > now or await self.is_gateway(url)):
                    loads[url] = load
            elif load is None or load.expires_at < now - 10 * LOAD_TTL_S:
                # Never one of ours, or long gone: removed, unless rewritten meanwhile.
                self._spawn(self._quietly(self._forget_script(keys=[LOAD_KEY], args=[url, raw])))
        self.loads = loads
        self._loads_read_at = time.monotonic()

    async def _load_loop(self) -> None:
        while True:
            try:
                await self.publish_load()
            except DirectoryUnavailable:
                pass  # the refresh loop logs Redis's state; placement keeps sessions here meanwhile
            except Exception:  # noqa: BLE001 - a load that cannot be read must not stop publishing
                log.exception("publishing this gateway's load failed")
            await asyncio.sleep(LOAD_INTERVAL_S)

    def _with_room(self, need: float) -> list[tuple[float, str]]:
        """(headroom, URL) of the other gateways, listed and with a fresh load, that can take `need`."""
        now = time.time()
        return sorted(((load.headroom, url) for url, load in self.loads.items()
                       if load.expires_at > now and self.gateways.get(url, 0.0) > now and load.headroom >= need),
                      reverse=True)

    def room_elsewhere(self, need: float) -> str | None:
        """Another gateway of the fleet that has room for `need` more, the most headroom first (None: none)."""
        ranked = self._with_room(need)
        return ranked[0][1] if ranked else None

    def placement(self, need: float, own_headroom: float) -> str | None:
        """Where a new session goes: another gateway's URL when it has room and more headroom
        than this one's `own_headroom`; None for here."""
        ranked = self._with_room(need)
        if not ranked or ranked[0][0] <= own_headroom:
            return None
        return ranked[0][1]

    def placed(self, url: str, need: float) -> None:
        """A session was placed on `url`: count it there until that gateway's next load."""
        load = self.loads.get(url)
        if load is not None:
            load.demand += need
