"""A WebRTC caller for Voxgate from Python, on aiortc: it joins a session (or
makes one with its offer), sends protocol messages on the data channel, records
the speech it receives, and speaks into its microphone track: a WAV at any
rate, PCM you hand it, or a live microphone (any aiortc audio track). The
tests, the benchmarks and `voxgate probe` use it; docs/backends.md shows it
talking to a voice agent in ten lines:

    async with RtcClient(url, mic=True, session_id=sid, token=token) as caller:
        await caller.mic.play_wav("question.wav")        # any rate, mono or stereo
        done = await caller.wait_for("utterance.done", timeout=60)
        caller.audio.write_wav("reply.wav")               # what the bot said, as heard
"""

from __future__ import annotations

import asyncio
import fractions
import json
import re
import time
import wave
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import av
import numpy as np
from aiortc import RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from .gateway.media import rtc_internals
from .gateway.webrtc.ice import restrict_host_addresses
from .gateway.media.resample import StreamResampler

MIC_RATE = 48000  # what the microphone track sends (Opus's rate)


class OfferRefused(RuntimeError):
    """The gateway answered the offer with an HTTP error."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(f"offer refused ({status}): {body}")
        self.status = status
        self.body = body
        self.code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """A PCM WAV file (8, 16, 24 or 32 bits, any channels) as mono int16, and its rate."""
    with wave.open(path, "rb") as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 1:  # unsigned 8-bit
        pcm = (np.frombuffer(raw, np.uint8).astype(np.int16) - 128) << 8
    elif width == 2:
        pcm = np.frombuffer(raw, "<i2")
    elif width == 3:  # 24-bit: the top two bytes of each sample
        pcm = np.frombuffer(raw, np.uint8).reshape(-1, 3)[:, 1:].copy().view("<i2").reshape(-1)
    elif width == 4:
        pcm = (np.frombuffer(raw, "<i4") >> 16).astype(np.int16)
    else:
        raise ValueError(f"{path}: {8 * width}-bit samples; a WAV of 8, 16, 24 or 32-bit PCM is needed")
    return as_mono_int16(pcm.reshape(-1, channels)), rate


def as_mono_int16(pcm: np.ndarray) -> np.ndarray:
    """Samples as int16 mono: (n,) or (n, channels); floats are taken as -1.0..1.0."""
    x = np.asarray(pcm)
    if x.ndim == 2:
        x = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    if x.dtype.kind == "f":
        x = np.clip(np.nan_to_num(x) * 32767.0, -32768, 32767)
    return np.asarray(np.rint(x) if x.dtype.kind == "f" else x, dtype=np.int16).reshape(-1)


class MicTrack(MediaStreamTrack):
    """A microphone that plays queued audio in real time, silence otherwise (48 kHz mono on the wire)."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._pending = np.zeros(0, dtype=np.int16)
        self._pts = 0
        self._start: float | None = None
        self._drained = asyncio.Event()
        self._drained.set()
        self.playing_since: float | None = None

    def play(self, pcm: np.ndarray, sample_rate: int = MIC_RATE) -> float:
        """Queue audio: int16 or float (-1..1) samples, mono or (n, channels), at any rate. Returns its seconds."""
        mono = as_mono_int16(pcm)
        if sample_rate != MIC_RATE:
            mono = StreamResampler(int(sample_rate), MIC_RATE).process(mono, last=True)
        self._pending = np.concatenate([self._pending, mono])
        self.playing_since = time.perf_counter()
        if len(self._pending):
            self._drained.clear()
        return len(mono) / MIC_RATE

    def play_wav(self, path: str) -> float:
        """Queue a PCM WAV file (any rate, any channels); returns its seconds."""
        pcm, rate = read_wav(path)
        return self.play(pcm, rate)

    async def played(self) -> None:
        """Wait until everything queued has gone out."""
        await self._drained.wait()

    @property
    def busy(self) -> bool:
        return len(self._pending) > 0

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        n = 960
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._pts / 48000 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        chunk, self._pending = self._pending[:n], self._pending[n:]
        if not len(self._pending):
            self._drained.set()
        if len(chunk) < n:
            chunk = np.concatenate([chunk, np.zeros(n - len(chunk), dtype=np.int16)])
        frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 48000
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, 48000)
        self._pts += n
        return frame


# aiortc's audio jitter buffer holds at most 16 packets, so once this many frames
# have been decoded after an event, the frames the server sent before it have
# usually been decoded too (the server sends a frame every 20 ms, silence when
# idle). `wait_tail` counts packets instead, which also covers a decoder thread
# that lags behind the wire; this count is its fallback and a bound for tests.
TAIL_FRAMES = 20


@dataclass
class ReceivedAudio:
    """Decoded frames as they arrived: mono int16 at `sample_rate`, with arrival times."""

    sample_rate: int = 48000
    frames: list = field(default_factory=list)  # (arrival perf_counter, pcm)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def add(self, at: float, pcm: np.ndarray) -> None:
        self.frames.append((at, pcm))
        self._arrived.set()

    async def wait_total(self, count: int, timeout: float = 10.0) -> None:
        """Wait until `count` frames have been decoded since the track started."""
        await self._wait(lambda: len(self.frames) >= count, lambda: f"only {len(self.frames)} of {count} audio frames", timeout)

    def count_since(self, since: float) -> int:
        n = 0
        for t, _ in reversed(self.frames):
            if t < since:
                break
            n += 1
        return n

    async def wait_frames(self, count: int, since: float, timeout: float = 10.0) -> None:
        """Wait until `count` frames have arrived at or after `since` (a perf_counter time)."""
        await self._wait(
            lambda: self.count_since(since) >= count, lambda: f"only {self.count_since(since)} of {count} audio frames", timeout
        )

    async def _wait(self, done, shortfall, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError(f"{shortfall()} arrived within {timeout} s")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def pcm(self, since: float = 0.0) -> np.ndarray:
        parts = [p for t, p in self.frames if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)

    def write_wav(self, path: str, since: float = 0.0) -> None:
        """What arrived (from `since`, a perf_counter time) as a 16-bit mono WAV at `sample_rate`."""
        with wave.open(path, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate)
            w.writeframes(self.pcm(since).astype("<i2").tobytes())

    def first_sound_after(self, since: float, threshold: float = 300.0) -> float | None:
        for t, p in self.frames:
            if t >= since and len(p) and np.sqrt(np.mean(p.astype(np.float64) ** 2)) > threshold:
                return t
        return None

    def last_sound(self, threshold: float = 300.0) -> float | None:
        for t, p in reversed(self.frames):
            if len(p) and np.sqrt(np.mean(p.astype(np.float64) ** 2)) > threshold:
                return t
        return None


def offer_with_dtx(sdp: str) -> str:
    """The offer with `usedtx=1` on its Opus format line (aiortc's own decoder takes gaps as they come)."""
    from .gateway.webrtc.peer import ask_for_dtx

    match = re.search(r"(?mi)^a=rtpmap:(\d+) opus/48000", sdp)
    return ask_for_dtx(sdp, int(match.group(1))) if match else sdp


class RtcClient:
    """One caller: `connect()` (or `async with`), then `send`, `wait_for`, `mic.play...`, `audio`.

    `mic`: True for a `MicTrack` this client plays audio into (`self.mic`), or any aiortc audio
    track, such as a live microphone's: `MediaPlayer("default", format="pulse").audio` (Linux,
    PulseAudio) from aiortc.contrib.media. `session_id` and `token`: join a session made through
    the session API; without them the offer makes a session. `ice_hosts`: the local addresses to
    offer (loopback by default; None for every address, to reach a gateway on another machine)."""

    def __init__(
        self,
        base_url: str,
        *,
        mic: bool | MediaStreamTrack = False,
        codecs: list[str] | None = None,
        ice_hosts: Sequence[str] | None = ("127.0.0.1",),
        voice: str | None = None,
        session_id: str | None = None,
        token: str | None = None,
        dtx: bool = False,
    ) -> None:
        self.join = {"session_id": session_id, "token": token}
        # Ask for DTX between utterances (usedtx=1 on the offer's Opus line), as the bundled page does.
        self.dtx = dtx
        self.base_url = base_url.rstrip("/")
        if ice_hosts:
            restrict_host_addresses(list(ice_hosts))
        self.pc = RTCPeerConnection(configuration=RTCConfiguration(iceServers=[]))
        self.mic = MicTrack() if mic is True else None
        self._live_mic = mic if isinstance(mic, MediaStreamTrack) else None
        self.codecs = codecs
        self.voice = voice
        self.events: asyncio.Queue = asyncio.Queue()
        self.event_log: list[tuple[float, dict]] = []
        self._packets_at: dict[int, int] = {}  # id(event) -> audio packets received before it
        self.audio = ReceivedAudio()
        self.session_id: str | None = None
        self.ready: dict | None = None
        self._channel: RTCDataChannel | None = None
        self._audio_task: asyncio.Task | None = None
        self._opened = asyncio.Event()
        self.offer_s: float | None = None

    async def connect(self, timeout: float = 20.0) -> dict:
        pc = self.pc
        mic = self.mic if self.mic is not None else self._live_mic
        if mic is not None:
            transceiver = pc.addTransceiver(mic, direction="sendrecv")
        else:
            transceiver = pc.addTransceiver("audio", direction="recvonly")
        if self.codecs:
            from aiortc.rtcrtpsender import RTCRtpSender

            caps = RTCRtpSender.getCapabilities("audio")
            wanted = [c for c in caps.codecs if c.mimeType.split("/")[-1].lower() in self.codecs]
            transceiver.setCodecPreferences(wanted)
        self._channel = channel = pc.createDataChannel("control")

        @channel.on("message")
        def on_message(message: str) -> None:
            event = json.loads(message)
            self.event_log.append((time.perf_counter(), event))
            packets = self._audio_packets_received()
            if packets is not None:
                self._packets_at[id(event)] = packets
            self.events.put_nowait(event)

        @pc.on("track")
        def on_track(track) -> None:
            if track.kind == "audio":
                self._audio_task = asyncio.ensure_future(self._record(track))

        await pc.setLocalDescription(await pc.createOffer())
        body = {"sdp": pc.localDescription.sdp, "type": "offer"}
        if self.dtx:
            body["sdp"] = offer_with_dtx(body["sdp"])
        if self.voice:
            body["voice"] = self.voice
        body.update({k: v for k, v in self.join.items() if v})
        async with aiohttp.ClientSession() as http:
            posted = time.perf_counter()
            async with http.post(self.base_url + "/v1/offer", json=body) as resp:
                answer = await resp.json()
                # How long the server took to answer the offer (or refuse it), at this client.
                self.offer_s = time.perf_counter() - posted
                if resp.status != 200:
                    raise OfferRefused(resp.status, answer)
        self.session_id = answer["session_id"]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        try:
            self.ready = await self.wait_for("session.ready", timeout=timeout)
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(self._why_not_ready(answer["sdp"], timeout)) from None
        return self.ready

    def _why_not_ready(self, answer_sdp: str, timeout: float) -> str:
        """Why no session.ready came: what the answer offered, and how far the connection got."""
        offered = sorted({line.split()[4] for line in answer_sdp.splitlines()
                          if line.startswith("a=candidate:") and len(line.split()) > 4})
        state = f"ICE {self.pc.iceConnectionState}, connection {self.pc.connectionState}"
        if not offered:
            return (f"the session did not start within {timeout:g} s ({state}): the server's answer offered no ICE "
                    "candidate, as a server does when it has no address to offer or refused every candidate of "
                    "the offer. Start it with --ice-host and an address this client can reach (127.0.0.1 on this "
                    "machine), or let its --ice-allow take this client's addresses")
        return (f"the session did not start within {timeout:g} s ({state}): the server offered "
                f"{', '.join(offered)} for media and no connection came of it. Is that address reachable from "
                "here? Start the server with --ice-host and an address this client can reach")

    async def _record(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except (MediaStreamError, asyncio.CancelledError):
                return
            arr = frame.to_ndarray()
            channels = len(frame.layout.channels)
            pcm = arr.reshape(-1, channels).mean(axis=1).astype(np.int16) if channels > 1 else arr.reshape(-1)
            self.audio.sample_rate = frame.sample_rate
            self.audio.add(time.perf_counter(), pcm)

    def send(self, message: dict | str | bytes) -> float:
        if isinstance(message, dict):
            message = json.dumps(message)
        if self._channel is None:
            raise RuntimeError("RtcClient.send before connect()")
        self._channel.send(message)
        return time.perf_counter()

    async def wait_for(self, kind: str, timeout: float = 20.0, id: str | None = None) -> dict:
        """Next event of a type (earlier events of other types stay in event_log)."""
        return await self._next(lambda e: e.get("type") == kind and (id is None or e.get("id") == id), timeout, kind)

    def arrival(self, event: dict) -> float:
        """When an event returned by wait_for arrived (perf_counter)."""
        return next(t for t, e in reversed(self.event_log) if e is event)

    async def wait_tail(self, event: dict, timeout: float = 10.0, tail_frames: int = TAIL_FRAMES) -> None:
        """Wait until all audio the server sent before `event` has arrived, and some after it.

        Used after `utterance.done` or `utterance.interrupted` before decoding the
        received audio. It counts packets and frames, so it never depends on
        wall time, nor on how far this process's decoding lags behind the wire:
        every frame from a packet that came off the wire before the event, then
        TAIL_FRAMES decoded after the event arrived (which also covers a server
        that sends the event before its last packet, as aiortc's own sender may).
        A listener on DTX gets one packet every 400 ms between utterances: a few
        `tail_frames` then do, where 20 would take 8 s.
        """
        packets = self.frame_index(event)
        if packets is not None:  # None: no audio yet, or aiortc renamed its counters
            await self.audio.wait_total(packets, timeout=timeout)
        await self.audio.wait_frames(tail_frames, since=self.arrival(event), timeout=timeout)

    def frame_index(self, event: dict) -> int | None:
        """Where audio sent after `event` starts in `audio.frames`.

        That is the number of RTP packets that had come off the wire when the
        event arrived: each becomes one frame, in order (loopback loses none).
        None when no audio had arrived or aiortc's counter is missing.
        """
        return self._packets_at.get(id(event))

    async def wait_frames_after(self, event: dict, count: int, timeout: float = 10.0) -> list:
        """Wait for `count` frames sent after `event`; returns them (PCM arrays)."""
        index = self.frame_index(event)
        if index is None:
            # Without the counter: frames decoded after the event arrived, less
            # those the jitter buffer may still have held from before it.
            await self.audio.wait_frames(count + TAIL_FRAMES, since=self.arrival(event), timeout=timeout)
            return [p for t, p in self.audio.frames if t >= self.arrival(event)][TAIL_FRAMES : TAIL_FRAMES + count]
        await self.audio.wait_total(index + count, timeout=timeout)
        return [p for _, p in self.audio.frames[index : index + count]]

    def _audio_packets_received(self) -> int | None:
        """RTP packets the audio receiver has taken off the wire so far.

        The DTLS transport hands datagrams over in arrival order, so when a
        data-channel event is read, every packet the server sent before it has
        been counted; each becomes one decoded frame, however far the decoder
        thread and the track's queue lag behind.
        """
        for receiver in self.pc.getReceivers():
            if receiver.track is not None and receiver.track.kind == "audio":
                streams = rtc_internals.receiver_remote_streams(receiver)
                if streams:
                    return sum(s.packets_received for s in streams.values())
        return None

    async def wait_for_any(self, kinds: tuple[str, ...], timeout: float = 20.0) -> dict:
        """Next event whose type is one of `kinds`."""
        return await self._next(lambda e: e.get("type") in kinds, timeout, " or ".join(kinds))

    async def _next(self, wanted, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                seen = [e.get("type") for _, e in self.event_log[-10:]]
                raise asyncio.TimeoutError(f"no {what} event within {timeout} s; saw {seen}")
            event = await asyncio.wait_for(self.events.get(), remaining)
            if wanted(event):
                return event

    async def close(self) -> None:
        if self._audio_task:
            self._audio_task.cancel()
        await self.pc.close()

    async def __aenter__(self) -> "RtcClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
