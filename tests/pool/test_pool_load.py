"""With an engine pool, the speech budget is the pool's: its replicas measure and report what they
carry (GET /v1/stats "load"), the gateway adds them up, and admission plans with what the pool has
left after other gateways' listeners (issue 41)."""

from __future__ import annotations

import json
import time

import aiohttp

from tests.conftest import in_process_gateway
from voxgate.engine.cluster.remote import PoolLoad


async def test_replicas_report_their_load_and_admission_plans_with_the_pools(pool):
    stats = await pool.wait_stats(lambda s: s.get("load") is not None)
    load = stats["load"]
    # Measured at the replica's start (the tone engine costs next to nothing, so it can carry many).
    assert load["cost"] > 0 and load["capacity"] > 10 and load["speaking"] == 0, load
    async with in_process_gateway(engine_url=pool.url, talk_share=1.0, unjoined_share=1.0) as (app, url):
        gw = app["gateway"]
        read = gw.engine.pool_load()
        assert read is not None and read.replicas == 1 and read.speaking == 0
        assert abs(read.capacity - load["capacity"]) < 0.5 * load["capacity"], (read, load)
        # The pool as another gateway's listener would leave it: room for one more listener. (A stand-in for
        # that other gateway: the tone engine's streams end too soon to hold a replica's listener.)
        gw.engine.pool.load_read = PoolLoad(capacity=2.0, speaking=1.0, replicas=1, read_at=time.monotonic())
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/sessions") as resp:
                assert resp.status == 201, await resp.text()
            async with http.post(url + "/v1/sessions") as resp:
                error = json.loads(await resp.text())["error"]
                assert (resp.status, error["reason"]) == (503, "synthesis"), error
