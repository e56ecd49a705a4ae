"""A stand-in for Twilio's side of a Media Stream, over a real WebSocket.

Twilio cannot be reached from this machine, so this plays its part by the
protocol: it sends `connected`, `start`, paced `media` and `stop`, and models
the phone's playback buffer: media plays in arrival order at 20 ms a frame, a
`mark` is echoed once the audio before it has played, and `clear` drops what
is buffered and echoes the pending marks at once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from voxgate.gateway.media.encoder import ulaw_decode, ulaw_encode

FRAME_S = 0.020


@dataclass
class ReceivedMark:
    name: str
    arrived: float
    frames_before: int  # media frames received before it
    echoed: str | None = None  # 'played' or 'cleared'


@dataclass
class Received:
    messages: list = field(default_factory=list)  # (arrival, parsed JSON)
    media: list = field(default_factory=list)  # (arrival, μ-law bytes)
    marks: list = field(default_factory=list)
    clears: list = field(default_factory=list)  # arrival times
    errors: list = field(default_factory=list)
    non_text_frames: int = 0


class TwilioStandIn:
    def __init__(self, base_url: str, *, stream_sid: str = "MZstandin0001", call_sid: str = "CAstandin0001") -> None:
        self.url = base_url.replace("http://", "ws://").rstrip("/") + "/v1/telephony/twilio"
        self.stream_sid = stream_sid
        self.call_sid = call_sid
        self.received = Received()
        self._http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._seq = 0
        self._chunk = 0
        self.sent_media: list[tuple[float, bytes]] = []  # (when it was sent, μ-law) for each media frame
        self._play_end = 0.0  # when the buffered audio will have played
        self._echo_tasks: dict[str, asyncio.Task] = {}
        self.event = asyncio.Event()  # set on every message

    async def connect(self) -> None:
        self._http = aiohttp.ClientSession()
        self.ws = await self._http.ws_connect(self.url)
        self._reader = asyncio.ensure_future(self._read())

    async def send(self, message: dict) -> None:
        self._seq += 1
        message.setdefault("sequenceNumber", str(self._seq))
        assert self.ws is not None
        await self.ws.send_str(json.dumps(message))

    async def start(self, custom: dict | None = None) -> None:
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.send(
            {
                "event": "start",
                "streamSid": self.stream_sid,
                "start": {
                    "accountSid": "ACstandin",
                    "streamSid": self.stream_sid,
                    "callSid": self.call_sid,
                    "tracks": ["inbound"],
                    "customParameters": custom or {},
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                },
            }
        )

    async def send_audio(self, pcm8k: np.ndarray, on_first=None, speed: float = 1.0) -> None:
        """Caller audio, μ-law, in 20 ms frames at `speed` times real time (each remembered in `sent_media`)."""
        data = ulaw_encode(pcm8k)
        t0 = time.monotonic()
        for i in range(0, len(data), 160):
            await asyncio.sleep(max(0.0, t0 + (i // 160) * FRAME_S / speed - time.monotonic()))
            self._chunk += 1
            if i == 0 and on_first is not None:
                on_first()
            self.sent_media.append((time.perf_counter(), data[i : i + 160]))
            await self.send(
                {
                    "event": "media",
                    "streamSid": self.stream_sid,
                    "media": {
                        "track": "inbound",
                        "chunk": str(self._chunk),
                        "timestamp": str(self._chunk * 20),
                        "payload": base64.b64encode(data[i : i + 160]).decode("ascii"),
                    },
                }
            )

    async def stop(self) -> None:
        await self.send({"event": "stop", "streamSid": self.stream_sid, "stop": {"accountSid": "ACstandin", "callSid": self.call_sid}})

    async def close(self) -> None:
        for task in self._echo_tasks.values():
            task.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
        if self._http is not None:
            await self._http.close()

    # The phone side's playback model
    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            now = time.perf_counter()
            if msg.type != aiohttp.WSMsgType.TEXT:
                self.received.non_text_frames += 1
                continue
            data = json.loads(msg.data)
            self.received.messages.append((now, data))
            kind = data.get("event")
            if kind == "media":
                self.received.media.append((now, base64.b64decode(data["media"]["payload"])))
                self._play_end = max(self._play_end, now) + FRAME_S
            elif kind == "mark":
                mark = ReceivedMark(data["mark"]["name"], now, len(self.received.media))
                self.received.marks.append(mark)
                delay = max(0.0, self._play_end - now)
                self._echo_tasks[mark.name] = asyncio.ensure_future(self._echo_later(mark, delay))
            elif kind == "clear":
                self.received.clears.append(now)
                self._play_end = now
                for mark in self.received.marks:
                    if mark.echoed is None:
                        task = self._echo_tasks.pop(mark.name, None)
                        if task is not None:
                            task.cancel()
                        mark.echoed = "cleared"
                        await self._echo(mark.name)
            elif kind == "error":
                self.received.errors.append(data)
            self.event.set()

    async def _echo_later(self, mark: ReceivedMark, delay: float) -> None:
        await asyncio.sleep(delay)
        if mark.echoed is None:
            mark.echoed = "played"
            self._echo_tasks.pop(mark.name, None)
            await self._echo(mark.name)

    async def _echo(self, name: str) -> None:
        if self.ws is not None and not self.ws.closed:
            await self.send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def wait(self, predicate, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError(f"stand-in: condition not met in {timeout} s; last: {self.received.messages[-3:]}")
            self.event.clear()
            try:
                await asyncio.wait_for(self.event.wait(), min(remaining, 0.2))
            except asyncio.TimeoutError:
                pass

    def pcm(self, since: float = 0.0) -> np.ndarray:
        parts = [ulaw_decode(m) for t, m in self.received.media if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)


class SpeakerPhone:
    """The stand-in's line, streamed as Twilio streams a call: the phone's loudspeaker (what it received,
    played at 20 ms a frame) heard back by its microphone `delay_frames` later at `echo_db` (None: no
    echo), over `background` (8 kHz, looped), plus a caller when `say` is called."""

    def __init__(self, phone: TwilioStandIn, *, echo_db: float | None, delay_frames: int,
                 background: np.ndarray | None = None) -> None:
        self.phone = phone
        self.gain = 0.0 if echo_db is None else 10 ** (echo_db / 20)
        self.background = background
        self.played = 0  # received media frames played so far
        self.line: list[np.ndarray] = [np.zeros(160, np.int16)] * max(1, delay_frames)
        self.caller: np.ndarray | None = None
        self.caller_at: float | None = None  # when the caller's first sample went down the line
        self._clears = 0
        self.task = asyncio.ensure_future(self._run())

    def say(self, pcm8k: np.ndarray) -> None:
        self.caller = pcm8k
        self.caller_at = None

    async def _run(self) -> None:
        t0 = time.monotonic()
        tick = 0
        pos = 0
        while True:
            await asyncio.sleep(max(0.0, t0 + tick * FRAME_S - time.monotonic()))
            tick += 1
            media = self.phone.received.media
            clears = self.phone.received.clears
            if len(clears) > self._clears:  # what a clear dropped is never played
                self._clears = len(clears)
                self.played = max(self.played, sum(1 for t, _ in media if t < clears[-1]))
            if self.played < len(media):
                heard = ulaw_decode(media[self.played][1]).astype(np.float64)
                self.played += 1
            else:
                heard = np.zeros(160)
            self.line.append(heard)
            mix = self.line.pop(0) * self.gain
            if self.background is not None:
                start = (tick * 160) % max(1, len(self.background) - 160)
                mix += self.background[start : start + 160]
            if self.caller is not None:
                if self.caller_at is None:
                    self.caller_at = time.perf_counter()
                    pos = 0
                piece = self.caller[pos : pos + 160]
                mix[: len(piece)] += piece
                pos += 160
                if pos >= len(self.caller):
                    self.caller = None
            payload = ulaw_encode(np.clip(mix, -32768, 32767).astype(np.int16))
            await self.send_media(tick, payload)

    async def send_media(self, tick: int, payload: bytes) -> None:
        await self.phone.send({"event": "media", "streamSid": self.phone.stream_sid,
                               "media": {"track": "inbound", "chunk": str(tick), "timestamp": str(tick * 20),
                                         "payload": base64.b64encode(payload).decode("ascii")}})
