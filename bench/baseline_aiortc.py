"""A plain aiortc voice server, written the way people hand-roll one: the same-run
baseline of `bench_capacity.py`. Not part of the product.

    python bench/baseline_aiortc.py --port 8090                # aiortc's own Opus settings
    python bench/baseline_aiortc.py --port 8090 --opus matched  # Opus settings matched to Voxgate's

What it does, per session (one `RTCPeerConnection`, no ICE servers):
- `POST /v1/offer` answers an offer; the first data channel carries a minimal
  subset of Voxgate's protocol, enough for the same load generator to drive
  both servers: `session.ready` (with `session_id`) when the channel opens;
  `speak {text, id}` queues the text; `cancel` drops everything queued;
  `audio.started`, `utterance.done {id, audio_ms}` and `utterance.interrupted
  {id, reason, played_ms}` go back.
- Speech is the tone engine's audio (`voxgate.engine.tone.encode`, straight at
  48 kHz, so synthesis costs nothing here either), played by a track that
  returns 48 kHz mono PCM `av.AudioFrame`s paced by its own sleep, exactly
  like aiortc's `AudioStreamTrack`; silence frames between utterances. aiortc
  encodes every frame with its built-in Opus encoder (on its default thread
  pool), as it does for any PCM track.
- A microphone track, when the client sends one, is read frame by frame
  (aiortc decodes it to 48 kHz stereo), resampled to 16 kHz mono and run
  through webrtcvad; 200 ms of voiced frames within 400 ms while speech plays
  is a barge-in: the queue is dropped, as `cancel` does.
- `GET /stats` hands out counters for the benchmark: sessions, frames, late
  frames (more than 5 ms after their deadline, the product pacer's
  definition) and the histogram of |inter-departure interval - 20 ms| on the
  product's own buckets, so the two servers' timing figures compare.

`--opus matched` changes only aiortc's encoder in this process (mono,
`--opus-bitrate`, `--opus-complexity`, FEC and DTX as given, 5 % expected
loss, 20 ms, and `--opus-application`: voip for Voxgate's `--opus-signal
voice`, audio for music and auto, which libopus then codes with CELT alone as
Voxgate does on a listener without loss; FFmpeg has no signal option): the ratio against it separates Voxgate's architecture from
its encoder settings. `--opus default` is aiortc as shipped: stereo, 96 kbit/s,
complexity 10, no FEC.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import fractions
import json
import logging
import time
import uuid

import av
import numpy as np
import webrtcvad
from aiohttp import web
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from voxgate.engine import tone
from voxgate.gateway.webrtc.ice import (
    restrict_host_addresses,  # aioice skips 127.0.0.1 otherwise
)
from voxgate.gateway.load.metrics import (
    JITTER_BUCKETS,  # the product's buckets, so the figures compare
)

RATE = 48000
FRAME = 960  # 20 ms at 48 kHz
FRAME_S = FRAME / RATE
LATE_S = 0.005
VAD_RATE = 16000
VAD_FRAME = VAD_RATE // 50
BARGE_VOICED = 10  # voiced 20 ms frames ...
BARGE_WINDOW = 20  # ... within this many frames

log = logging.getLogger("baseline")


class Counters:
    """Process-wide figures, read by the benchmark through GET /stats."""

    def __init__(self) -> None:
        self.frames = 0
        self.late_frames = 0
        self.intervals = 0
        self.jitter = [0] * (len(JITTER_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.vad_frames = 0
        self.voiced_frames = 0
        self.barge_ins = 0

    def departure(self, lateness: float, interval: float | None) -> None:
        self.frames += 1
        if lateness > LATE_S:
            self.late_frames += 1
        if interval is not None:
            self.intervals += 1
            self.jitter[bisect.bisect_left(JITTER_BUCKETS, abs(interval - FRAME_S))] += 1

    def as_dict(self, sessions: int) -> dict:
        cumulative, total = [], 0
        for n in self.jitter:
            total += n
            cumulative.append(total)
        return {
            "sessions": sessions,
            "frames": self.frames,
            "late_frames": self.late_frames,
            "intervals": self.intervals,
            "jitter_le": [*JITTER_BUCKETS, float("inf")],
            "jitter_cumulative": cumulative,
            "vad_frames": self.vad_frames,
            "voiced_frames": self.voiced_frames,
            "barge_ins": self.barge_ins,
        }


COUNTERS = Counters()


class Session:
    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:16]
        self.queue: collections.deque = collections.deque()  # [id, pcm, position]
        self.channel = None
        self.started_ids: set[str] = set()

    def emit(self, event: dict) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(event))

    def on_message(self, message) -> None:
        try:
            msg = json.loads(message)
        except ValueError:
            return
        kind = msg.get("type")
        if kind == "speak" and isinstance(msg.get("text"), str):
            uid = msg.get("id") or uuid.uuid4().hex[:8]
            self.queue.append([uid, tone.encode(msg["text"], RATE), 0])
        elif kind == "cancel":
            self.interrupt("cancel")
        elif kind == "ping":
            self.emit({"type": "pong", "t": msg.get("t")})

    @property
    def playing(self) -> bool:
        return bool(self.queue)

    def interrupt(self, reason: str) -> None:
        dropped, self.queue = list(self.queue), collections.deque()
        for uid, _pcm, position in dropped:
            self.emit({"type": "utterance.interrupted", "id": uid, "reason": reason, "played_ms": position * 1000 // RATE})

    def next_pcm(self) -> np.ndarray:
        """The next 20 ms of speech, or silence."""
        if not self.queue:
            return np.zeros(FRAME, dtype=np.int16)
        item = self.queue[0]
        uid, pcm, position = item
        if position == 0:
            self.emit({"type": "audio.started", "id": uid})
        chunk = pcm[position : position + FRAME]
        item[2] = position + FRAME
        if item[2] >= len(pcm):
            self.queue.popleft()
            self.emit({"type": "utterance.done", "id": uid, "audio_ms": len(pcm) * 1000 // RATE})
        if len(chunk) < FRAME:
            chunk = np.concatenate([chunk, np.zeros(FRAME - len(chunk), dtype=np.int16)])
        return chunk


class SpeechTrack(MediaStreamTrack):
    """48 kHz PCM frames paced by their own sleep, as aiortc's AudioStreamTrack does."""

    kind = "audio"

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self._start: float | None = None
        self._pts = 0
        self._last: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        else:
            self._pts += FRAME
            wait = self._start + self._pts / RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        now = time.monotonic()
        COUNTERS.departure(now - (self._start + self._pts / RATE), None if self._last is None else now - self._last)
        self._last = now
        frame = av.AudioFrame.from_ndarray(self.session.next_pcm().reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, RATE)
        return frame


async def consume_mic(session: Session, track) -> None:
    """Decode (aiortc does, to 48 kHz stereo), resample to 16 kHz mono, webrtcvad, barge-in."""
    resampler = av.AudioResampler(format="s16", layout="mono", rate=VAD_RATE)
    vad = webrtcvad.Vad(2)
    pending = np.zeros(0, dtype=np.int16)
    recent: collections.deque = collections.deque(maxlen=BARGE_WINDOW)
    while True:
        try:
            frame = await track.recv()
        except (MediaStreamError, asyncio.CancelledError):
            return
        for out in resampler.resample(frame):
            pending = np.concatenate([pending, out.to_ndarray().reshape(-1)])
        while len(pending) >= VAD_FRAME:
            chunk, pending = pending[:VAD_FRAME], pending[VAD_FRAME:]
            voiced = vad.is_speech(chunk.tobytes(), VAD_RATE)
            COUNTERS.vad_frames += 1
            COUNTERS.voiced_frames += voiced
            recent.append(voiced)
            if sum(recent) >= BARGE_VOICED and session.playing:
                COUNTERS.barge_ins += 1
                recent.clear()
                session.interrupt("barge_in")


SESSIONS: dict[str, tuple[Session, RTCPeerConnection]] = {}


async def handle_offer(request: web.Request) -> web.Response:
    body = await request.json()
    session = Session()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    SESSIONS[session.id] = (session, pc)
    tasks: list[asyncio.Task] = []
    track = SpeechTrack(session)

    @pc.on("datachannel")
    def on_datachannel(channel) -> None:
        if session.channel is not None:
            return
        session.channel = channel
        channel.on("message", session.on_message)
        ready = {"type": "session.ready", "session_id": session.id, "codec": "opus"}
        if channel.readyState == "open":
            session.emit(ready)
        else:
            channel.on("open", lambda: session.emit(ready))

    @pc.on("track")
    def on_track(remote) -> None:
        if remote.kind == "audio":
            tasks.append(asyncio.ensure_future(consume_mic(session, remote)))

    @pc.on("connectionstatechange")
    async def on_state() -> None:
        if pc.connectionState in ("failed", "closed") and session.id in SESSIONS:
            del SESSIONS[session.id]
            for task in tasks:
                task.cancel()
            track.stop()
            await pc.close()

    await pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type=body.get("type", "offer")))
    pc.addTrack(track)
    await pc.setLocalDescription(await pc.createAnswer())
    return web.json_response({"sdp": pc.localDescription.sdp, "type": "answer", "session_id": session.id})


async def handle_stats(request: web.Request) -> web.Response:
    return web.json_response(COUNTERS.as_dict(len(SESSIONS)))


def match_opus(bitrate: int, complexity: int, fec: bool, dtx: bool, application: str = "voip") -> None:
    """Give aiortc's Opus encoder Voxgate's settings, in this process only."""
    from aiortc.codecs import opus

    def matched_init(self) -> None:
        self.codec = av.CodecContext.create("libopus", "w")
        self.codec.bit_rate = bitrate
        self.codec.format = "s16"
        self.codec.layout = "mono"
        self.codec.sample_rate = opus.SAMPLE_RATE
        self.codec.time_base = opus.TIME_BASE
        self.codec.options = {
            "application": application,
            "frame_duration": "20",
            "packet_loss": "5",
            "fec": "1" if fec else "0",
            "dtx": "1" if dtx else "0",
            "compression_level": str(complexity),
        }
        self.resampler = av.AudioResampler(format="s16", layout="mono", rate=opus.SAMPLE_RATE, frame_size=opus.SAMPLES_PER_FRAME)
        self.first_packet_pts = None

    opus.OpusEncoder.__init__ = matched_init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--opus", choices=("default", "matched"), default="default")
    parser.add_argument("--opus-bitrate", type=int, default=32000)
    parser.add_argument("--opus-complexity", type=int, default=5)
    parser.add_argument("--opus-fec", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--opus-dtx", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--opus-application", choices=("voip", "audio"), default="voip")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    restrict_host_addresses([args.host])
    if args.opus == "matched":
        match_opus(args.opus_bitrate, args.opus_complexity, args.opus_fec, args.opus_dtx, args.opus_application)
    app = web.Application()
    app.router.add_post("/v1/offer", handle_offer)
    app.router.add_get("/stats", handle_stats)

    async def close_all(app: web.Application) -> None:
        await asyncio.gather(*(pc.close() for _, pc in list(SESSIONS.values())), return_exceptions=True)

    app.on_shutdown.append(close_all)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
