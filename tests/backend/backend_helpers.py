"""Test helpers for the session API: a WebRTC listener that joins a session made ahead."""

from __future__ import annotations

import json
import time

import aiohttp
from aiortc import RTCSessionDescription

from voxgate.rtc_client import RtcClient


class OfferRefused(Exception):
    def __init__(self, status: int, body: dict) -> None:
        super().__init__(f"offer refused ({status}): {body}")
        self.status = status
        self.body = body


class JoiningRtcClient(RtcClient):
    """RtcClient whose offer carries `session_id` and `token` (RtcClient has no such option)."""

    def __init__(self, base_url: str, session_id: str | None, token: str | None, **kwargs) -> None:
        super().__init__(base_url, **kwargs)
        self.join_id = session_id
        self.token = token

    async def connect(self, timeout: float = 20.0) -> dict:
        pc = self.pc
        pc.addTransceiver("audio", direction="recvonly")
        self._channel = pc.createDataChannel("control")

        @self._channel.on("message")
        def on_message(message: str) -> None:
            event = json.loads(message)
            self.event_log.append((time.perf_counter(), event))
            self.events.put_nowait(event)

        @pc.on("track")
        def on_track(track) -> None:
            import asyncio

            if track.kind == "audio":
                self._audio_task = asyncio.ensure_future(self._record(track))

        await pc.setLocalDescription(await pc.createOffer())
        body = {"sdp": pc.localDescription.sdp, "type": "offer"}
        if self.join_id is not None:
            body["session_id"] = self.join_id
        if self.token is not None:
            body["token"] = self.token
        async with aiohttp.ClientSession() as http:
            async with http.post(self.base_url + "/v1/offer", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise OfferRefused(resp.status, answer)
        self.session_id = answer["session_id"]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        self.ready = await self.wait_for("session.ready", timeout=timeout)
        return self.ready
