"""Finding 7: sessions without an audio track (data channel only) play out in real time.

Before, nothing consumed their audio: utterances never finished, all speech
was synthesized and encoded at full speed, and the session counted as
speaking until its 1 h lifetime. Now frames leave the playout on the 20 ms
clock and are dropped unencoded, so every event means what it means for a
listener.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from voxgate.gateway.webrtc.ice import restrict_host_addresses

from sec_helpers import http_json


class ChannelOnlyClient:
    def __init__(self, url: str) -> None:
        self.url = url
        restrict_host_addresses(["127.0.0.1"])
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.events: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self) -> "ChannelOnlyClient":
        self.channel = self.pc.createDataChannel("control")
        self.channel.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        status, body, _ = await http_json("POST", self.url + "/v1/offer", body={"sdp": self.pc.localDescription.sdp, "type": "offer"})
        assert status == 200, body
        self.session_id = body["session_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(body["sdp"], "answer"))
        self.ready = await self.wait_for("session.ready")
        return self

    async def wait_for(self, kind: str, timeout: float = 30) -> dict:
        while True:
            event = await asyncio.wait_for(self.events.get(), timeout)
            if event.get("type") == kind:
                return event

    def send(self, msg: dict) -> None:
        self.channel.send(json.dumps(msg))

    async def __aexit__(self, *exc) -> None:
        await self.pc.close()


async def test_utterances_finish_and_the_session_stops_speaking(tone_server):
    async with ChannelOnlyClient(tone_server.url) as client:
        assert client.ready["codec"] == "none"
        client.send({"type": "speak", "id": "a", "text": "Hello there."})
        started = await client.wait_for("audio.started")
        done = await client.wait_for("utterance.done")
        assert started["id"] == done["id"] == "a"
        assert done["text"] == "Hello there." and done["audio_ms"] > 0
        status, state, _ = await http_json("GET", f"{tone_server.url}/v1/sessions/{client.session_id}")
        assert status == 200 and state["utterances"]["queued"] == 0


async def test_speech_plays_in_real_time_and_a_cancel_reports_what_played(tone_server):
    async with ChannelOnlyClient(tone_server.url) as client:
        text = "x" * 4000  # 160 s of tone-engine audio
        client.send({"type": "speak", "id": "long", "text": text})
        await client.wait_for("audio.started")
        t0 = time.monotonic()
        client.send({"type": "ping", "t": 1})
        await client.wait_for("pong")
        client.send({"type": "cancel"})
        interrupted = await client.wait_for("utterance.interrupted")
        elapsed_ms = (time.monotonic() - t0) * 1000
        # At full speed the 160 s would all have been "played" within a few seconds.
        assert interrupted["played_ms"] <= elapsed_ms + 1000, (interrupted, elapsed_ms)
        assert interrupted["played_text"] == text[: len(interrupted["played_text"])]
