"""Issue 53, theme: late-frame admission does not punish other tenants for one tenant's attack.

Before, once more than 5 % of frames went late over 10 s, admission refused every tenant's new
sessions, so anything that made frames late (250 watchers on one session, four aac encodes) locked
everyone out. Now the work each tenant's input and jobs cost is charged to it (gateway/load/late_blame.py);
while frames are late, a tenant whose work is a third of the process's is to blame: only its new
sessions are refused, and its costliest source (here a watcher taking the caller's audio) is shed.

The late frames are set in the counters admission reads (a real attack takes tens of seconds:
bench/bench_watchers.py); the charge is what the watcher's link would have measured.
"""

from __future__ import annotations

import aiohttp

from tests.conftest import in_process_gateway

from sec_helpers import http_json


def frames_went_late(gw, share: float) -> None:
    """The pacer's counters as admission samples them: a snapshot, then 1,000 frames, `share` of them late."""
    gw.admission.tick()
    pacer = gw.metrics.for_session("tone")  # what a session's pacer reports each frame to
    late = int(1000 * share)
    for i in range(1000):
        pacer.frame_sent(0.020, 0.010 if i < late else 0.0)


async def test_only_the_tenant_whose_work_made_frames_late_is_refused_and_its_watcher_is_shed():
    async with in_process_gateway(api_key=["attacker", "victim"]) as (app, url), \
            aiohttp.ClientSession(headers={"X-API-Key": "attacker"}) as http:
        gw = app["gateway"]
        status, made, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "attacker"})
        watcher = await http.ws_connect(f"{url.replace('http', 'ws')}/v1/sessions/{made['session_id']}/ws?role=watcher&audio=pcm16")
        [link] = [cb.__self__ for name, cb in gw.sessions[made["session_id"]].caller.audio.taps.items()]
        frames_went_late(gw, 0.2)
        gw.admission.blame.charge("key:attacker", 6.0, link)  # 0.6 cores of its watcher's sends
        gw.admission._cpu0 -= 8.0  # the process spent 8 s meanwhile: the watcher's 6 are three quarters
        gw.admission.tick()
        assert gw.admission.blame.culprit == "key:attacker"
        # The victim is admitted; the attacker is refused for the late frames.
        status, body, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "victim"})
        assert status == 201, body
        status, body, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "attacker"})
        assert (status, body["error"]["reason"]) == (503, "late_frames"), body
        # Its watcher was shed: disconnected, no longer fed the caller's audio.
        message = await watcher.receive(timeout=5)
        while message.type == aiohttp.WSMsgType.TEXT:
            message = await watcher.receive(timeout=5)
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING), message
        assert not gw.sessions[made["session_id"]].caller.audio.taps


async def test_with_nobody_to_blame_late_frames_refuse_everyone():
    async with in_process_gateway(api_key=["a", "b"]) as (app, url):
        gw = app["gateway"]
        frames_went_late(gw, 0.2)
        gw.admission.blame.charge("key:a", 1.0)
        gw.admission._cpu0 -= 8.0
        gw.admission.tick()
        assert gw.admission.blame.culprit is None
        for key in ("a", "b"):
            status, body, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": key})
            assert (status, body["error"]["reason"]) == (503, "late_frames"), body
