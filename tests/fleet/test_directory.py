"""The session directory (gateway/fleet/directory.py) against the real Redis: a new session's id
that another gateway already holds is refused, and the other gateway's record stays."""

from __future__ import annotations

import time

from voxgate.gateway.fleet.directory import KEY_PREFIX, Directory
from voxgate.gateway.fleet.directory_records import RecordSigner, SessionRecord, key_id

from .conftest import REDIS_PASSWORD, TOKEN_SECRET


async def test_an_id_already_held_elsewhere_is_given_up_and_the_record_kept(redis_server):
    sid = "collision-" + "f" * 22
    other = SessionRecord(sid, "http://gateway-b:8080", key_id("someone-else"), time.time() + 60)
    redis_server.client().set(KEY_PREFIX + sid, other.encode(RecordSigner(TOKEN_SECRET)), px=60_000)
    directory = Directory(redis_server.url, "http://gateway-a:8080", ttl_s=3.0, secret=TOKEN_SECRET, password=REDIS_PASSWORD)
    taken = []
    try:
        directory.hold(sid, "my-key", lambda: taken.append(sid))
        assert not await directory.claimed(sid)  # what signaling/fleet.py turns into 503 session_id_taken
        assert taken == [sid] and sid not in directory.held
        record = await directory.lookup(sid)
        assert record is not None and record.gateway == "http://gateway-b:8080" and record.owner == other.owner
        # A fresh id is claimed, and recorded as this gateway's.
        directory.hold(sid + "-2", "my-key", lambda: taken.append("wrong"))
        assert await directory.claimed(sid + "-2") and taken == [sid]
        mine = await directory.lookup(sid + "-2")
        assert mine is not None and directory.is_self(mine) and mine.owner == key_id("my-key")
    finally:
        await directory.close()
    assert redis_server.client().get(KEY_PREFIX + sid) is not None  # closing never deletes another's record
    assert redis_server.client().get(KEY_PREFIX + sid + "-2") is None
