"""Structured logs: one JSON object per line, carrying the session id."""

from voxgate.rtc_client import RtcClient


async def test_json_logs_carry_the_session_id(server_factory):
    server = server_factory("tone", ["--log-json"])
    async with RtcClient(server.url) as client:
        client.send({"type": "speak", "text": "Log me.", "id": "l"})
        await client.wait_for("utterance.done", id="l")
        session_id = client.session_id
    await server.wait_log(lambda e: e.get("session_id") == session_id and "connection connected" in e["message"])
    entries = server.log_entries()
    assert entries and all({"ts", "level", "logger", "message"} <= e.keys() for e in entries)
    mine = [e for e in entries if e.get("session_id") == session_id]
    assert any("connection connected" in e["message"] for e in mine), mine
