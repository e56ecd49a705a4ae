"""The load generator of bench/bench_capacity.py: one process serving the
orchestrator's commands (one JSON object a line on stdin, answers on stdout),
holding its share of the sessions' clients.

    python bench/capacity_load.py --mic-file PATH      # started by bench_capacity.py, not by hand

Clients are `voxgate.rtc_client.RtcClient` aiortc peers on 127.0.0.1 with no
ICE servers, made cheap so that the generator is not what runs out of CPU:
- received Opus is not decoded: once a client is connected its receiver's
  decoder thread is ended (a stand-in decoder that returns no frames covers
  the packets before that); RTP handling, the jitter buffer, NACKs and RTCP
  receiver reports stay. Every RTP packet is timed as it reaches the client's
  event loop (before aiortc's jitter buffer);
- the offer asks for DTX between utterances (`usedtx=1`), as the bundled
  page's does;
- the microphone sends Opus packets encoded once by the orchestrator
  (`prepare_mic`): aiortc's sender packs an `av.Packet` without encoding it.
  Each packet carries its audio level in the RTP header (RFC 6464
  `ssrc-audio-level`, computed from the frame as aiortc does), as browsers
  send it on every audio packet.

The scenarios (what each session's client does) are defined here; the
orchestrator's docstring says what is measured.

Commands: connect {url, n, scenario, seed} -> {connected, failed, errors};
mark {} starts a measurement window; report {} ends it -> packets, gaps
while the bot speaks, bot speaking time, event counts, this process's
event-loop lag; close {}; exit {}.
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import pickle
import random
import sys
import time

# Scenario content. The tone engine speaks 40 ms per character.
UTTERANCE = "the quick brown fox jumps over the lazy dog. " * 3  # 135 characters: 5.4 s
BOT_TURN = ("the quick brown fox jumps over the lazy dog. " * 3)[:115]  # 4.6 s
USER_SAYS = (
    "Sorry, could you say that again?",
    "Wait, that is not what I asked for.",
    "Yes, that works for me, thank you.",
)
CYCLE_S = 10.0  # one conversation turn: the bot, then (or over it) the user
BARGE_SHARE = 0.25  # of the cycles, the user talks over the bot
NOISE_STD = 20.0  # quiet microphone: about -64 dBFS
MIC_BITRATE = 32000


class Scenario:
    def __init__(self, key: str, title: str, mic: bool, conversation: bool, caller_audio: bool = False) -> None:
        self.key, self.title, self.mic, self.conversation = key, title, mic, conversation
        self.caller_audio = caller_audio  # a backend takes each session's caller audio (?audio=pcm16)


SCENARIOS = {
    "a": Scenario("a", "continuous speech, receive-only clients", mic=False, conversation=False),
    "b": Scenario("b", "continuous speech, quiet microphone, VAD on", mic=True, conversation=False),
    "c": Scenario("c", "conversation: bot 40 %, microphone always on, user speaks now and then (barge-in)", mic=True, conversation=True),
    "d": Scenario("d", "c, and a backend takes each session's caller audio (?audio=pcm16)", mic=True, conversation=True,
                  caller_audio=True),
}


class _NoDecoder:
    """Stands in for aiortc's Opus decoder in the generators: received audio is timed, not decoded."""

    def decode(self, encoded_frame) -> list:
        return []


def _patch_client_side() -> None:
    import aiortc.rtcrtpreceiver as receiver_module
    from aiortc.rtcrtpreceiver import RTCRtpReceiver

    receiver_module.get_decoder = lambda codec: _NoDecoder()
    original = RTCRtpReceiver._handle_rtp_packet

    async def timed(self, packet, arrival_time_ms: int) -> None:
        client = getattr(self, "_capacity_client", None)
        if client is not None:
            client.on_packet(time.perf_counter())
        await original(self, packet, arrival_time_ms)

    RTCRtpReceiver._handle_rtp_packet = timed


def _stop_decoder_thread(receiver) -> None:
    """End the receiver's decoder thread: with nothing to decode, its hand-off per packet
    (queue, thread wake-up, GIL) was a quarter of a receive-only client's CPU. RTP handling,
    the jitter buffer, NACKs and RTCP reports stay as they are. (aiortc 1.x private names;
    if they change, the thread simply stays.)"""
    queue = getattr(receiver, "_RTCRtpReceiver__decoder_queue", None)
    if queue is not None and getattr(receiver, "_RTCRtpReceiver__decoder_thread", None) is not None:
        queue.put(None)  # the worker ends, and ends the remote track
        receiver._RTCRtpReceiver__decoder_thread = None


def _packet_mic_class():
    import av
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

    class PacketMic(MediaStreamTrack):
        """A microphone sending pre-encoded Opus: quiet noise, or speech when told to."""

        kind = "audio"

        def __init__(self, noise: list[tuple[bytes, int]], offset: int) -> None:
            super().__init__()
            self.noise = noise
            self.index = offset
            self.pending: list[tuple[bytes, int]] = []
            self.level = -127  # dBov of the packet last handed to the sender
            self._pts = 0
            self._start: float | None = None

        def play(self, packets: list[tuple[bytes, int]]) -> None:
            self.pending = list(packets)

        async def recv(self):
            if self.readyState != "live":
                raise MediaStreamError
            if self._start is None:
                self._start = time.monotonic()
            wait = self._start + self._pts / 48000 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.pending:
                payload, self.level = self.pending.pop(0)
            else:
                payload, self.level = self.noise[self.index % len(self.noise)]
                self.index += 1
            packet = av.Packet(payload)
            packet.pts = self._pts
            packet.time_base = fractions.Fraction(1, 48000)
            self._pts += 960
            return packet

    return PacketMic


def send_audio_levels(sender, track) -> None:
    """Have aiortc's sender put the mic's level in each packet, as it does for frames it encodes
    itself (it has no level for a pre-encoded packet)."""
    next_frame = sender._next_encoded_frame

    async def with_level(codec):
        frame = await next_frame(codec)
        if frame is not None:
            frame.audio_level = track.level
        return frame

    sender._next_encoded_frame = with_level


class LoadClient:
    """One session's client: connects, keeps the bot talking, plays the user, times arrivals."""

    def __init__(self, url: str, scenario: Scenario, mic: dict | None, rng: random.Random, mic_class) -> None:
        from voxgate.rtc_client import RtcClient

        # Asking for DTX between utterances, as the bundled page does (web/connection.js); a plain
        # aiortc server ignores it, and `--product-args=--no-opus-dtx-when-asked` measures listeners
        # that do not ask.
        self.rtc = RtcClient(url, dtx=True)
        self.scenario = scenario
        self.mic_packets = mic
        self.rng = rng
        self.track = mic_class(mic["noise"], rng.randrange(len(mic["noise"]))) if scenario.mic else None
        self.rtc.mic = self.track  # RtcClient sends it on a sendrecv transceiver
        self.speaking = False
        self._spoke_since: float | None = None
        self._last_t: float | None = None
        self._last_speaking = False
        self._waiters: list[tuple[set, asyncio.Future]] = []
        self._tasks: list[asyncio.Task] = []
        self._n = 0
        self.outstanding = 0
        self.closed_by_server = False
        self.backend = None  # scenario d: the session's backend, reading its caller audio
        self.backend_frames = 0
        self.reset(None)

    def reset(self, mark: float | None) -> None:
        self.mark = mark
        self.packets = 0
        self.gaps: list[float] = []
        self.speech_s = 0.0
        self.counts = {"speak": 0, "done": 0, "interrupted": 0, "barge_in_interrupts": 0, "barge_attempts": 0,
                       "user_turns": 0, "errors": 0, "timeouts": 0, "speech_started": 0}
        self.error_examples: list[str] = []

    async def start(self) -> None:
        if self.scenario.caller_audio:
            # The backend makes the session and takes its caller audio; the client joins it.
            from voxgate.client import VoxgateSession
            from voxgate.rtc_client import RtcClient

            self.backend = VoxgateSession(self.rtc.base_url, caller_audio=True)
            await self.backend.open()
            self.rtc = RtcClient(self.rtc.base_url, dtx=True, session_id=self.backend.session_id,
                                 token=self.backend.client_token)
            self.rtc.mic = self.track
            self._tasks.append(asyncio.ensure_future(self._read_caller_audio()))
        await self.rtc.connect(timeout=30.0)
        if self.track is not None:
            # The sender's loop looks the method up for every frame, so this holds from the next one.
            (sender,) = [s for s in self.rtc.pc.getSenders() if s.track is self.track]
            send_audio_levels(sender, self.track)
        for transceiver in self.rtc.pc.getTransceivers():
            if transceiver.kind == "audio":
                transceiver.receiver._capacity_client = self
                _stop_decoder_thread(transceiver.receiver)
        self._tasks.append(asyncio.ensure_future(self._pump()))
        behaviour = self._conversation if self.scenario.conversation else self._continuous
        self._tasks.append(asyncio.ensure_future(behaviour()))

    async def _read_caller_audio(self) -> None:
        async for _ in self.backend.caller_frames():
            self.backend_frames += 1

    # Arrivals and events
    def on_packet(self, t: float) -> None:
        if self.mark is not None:
            self.packets += 1
            if self._last_t is not None and self.speaking and self._last_speaking:
                self.gaps.append(t - self._last_t)
        self._last_t = t
        self._last_speaking = self.speaking

    async def _pump(self) -> None:
        while True:
            event = await self.rtc.events.get()
            now = time.perf_counter()
            kind = event.get("type")
            if kind == "audio.started":
                self.speaking = True
                self._spoke_since = now
            elif kind in ("utterance.done", "utterance.interrupted"):
                self._stop_speaking(now)
                self.outstanding = max(0, self.outstanding - 1)
                if kind == "utterance.done":
                    self._count("done")
                else:
                    self._count("interrupted")
                    if event.get("reason") == "barge_in":
                        self._count("barge_in_interrupts")
            elif kind == "speech.started":
                self._count("speech_started")
            elif kind == "error":
                self._count("errors")
                if len(self.error_examples) < 3:
                    self.error_examples.append(f"{event.get('code')}: {str(event.get('message'))[:120]}")
            elif kind == "session.closed":
                self.closed_by_server = True
            for waiter in list(self._waiters):
                kinds, future = waiter
                if kind in kinds and not future.done():
                    future.set_result(event)
                    self._waiters.remove(waiter)

    def _count(self, key: str) -> None:
        if self.mark is not None:
            self.counts[key] += 1

    def _stop_speaking(self, now: float) -> None:
        if self.speaking and self._spoke_since is not None and self.mark is not None:
            self.speech_s += now - max(self._spoke_since, self.mark)
        self.speaking = False
        self._spoke_since = None

    def speech_in_window(self, now: float) -> float:
        open_part = now - max(self._spoke_since, self.mark) if self.speaking and self._spoke_since is not None else 0.0
        return self.speech_s + max(0.0, open_part)

    async def _next(self, kinds: set, timeout: float) -> dict | None:
        future = asyncio.get_running_loop().create_future()
        waiter = (kinds, future)
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._count("timeouts")
            return None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _speak(self, text: str) -> None:
        self._n += 1
        self.outstanding += 1
        self._count("speak")
        self.rtc.send({"type": "speak", "text": text, "id": f"u{self._n}"})

    # Behaviours
    async def _continuous(self) -> None:
        """Two utterances queued at all times."""
        while True:
            while self.outstanding < 2:
                self._speak(UTTERANCE)
            await self._next({"utterance.done", "utterance.interrupted"}, timeout=30.0)

    async def _conversation(self) -> None:
        from voxgate.engine.tone import SYMBOL_S

        # Join the conversation at a random point of a cycle, so that every window,
        # the first included, sees the same mix of bot and user time.
        phase = self.rng.uniform(0.0, CYCLE_S)
        cycle_at = time.perf_counter() - phase
        left = int((len(BOT_TURN) * SYMBOL_S - phase) / SYMBOL_S)
        if left >= 10:
            await self._turn(BOT_TURN[-left:], barge=False)
        elif phase < CYCLE_S - 4.0:
            await self._user_turn()
        while True:
            cycle_at += CYCLE_S
            await asyncio.sleep(max(0.0, cycle_at - time.perf_counter()))
            await self._turn(BOT_TURN, barge=self.rng.random() < BARGE_SHARE)

    async def _turn(self, text: str, barge: bool) -> None:
        """The bot says `text`; the user answers after it, or talks over it (a barge-in)."""
        self._speak(text)
        if barge:
            if await self._next({"audio.started"}, timeout=10.0) is not None:
                await asyncio.sleep(self.rng.uniform(1.0, 2.5))
                self._count("barge_attempts")
                self.track.play(self.rng.choice(self.mic_packets["speech"]))
            await self._next({"utterance.done", "utterance.interrupted"}, timeout=15.0)
        else:
            await self._next({"utterance.done", "utterance.interrupted"}, timeout=15.0)
            await self._user_turn()

    async def _user_turn(self) -> None:
        await asyncio.sleep(self.rng.uniform(0.3, 1.0))
        self._count("user_turns")
        self.track.play(self.rng.choice(self.mic_packets["speech"]))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.rtc.close()
        if self.backend is not None:
            await self.backend.close()


class Generator:
    """Serves the orchestrator's commands, one JSON object a line on stdin, answers on stdout."""

    def __init__(self, mic_file: str | None) -> None:
        with open(mic_file, "rb") as f:
            self.mic = pickle.load(f)
        self.clients: list[LoadClient] = []
        self.lag: list[float] = []
        self.measuring = False
        self.mic_class = _packet_mic_class()

    async def run(self) -> None:
        _patch_client_side()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        ticker = asyncio.ensure_future(self._tick())
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                command = json.loads(line)
                reply = await self.handle(command)
                sys.stdout.write(json.dumps(reply) + "\n")
                sys.stdout.flush()
                if command["cmd"] == "exit":
                    break
        finally:
            ticker.cancel()
            await self.close_all()

    async def _tick(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.02)
            if self.measuring:
                self.lag.append(time.perf_counter() - t0 - 0.02)

    async def handle(self, c: dict) -> dict:
        cmd = c["cmd"]
        if cmd == "connect":
            scenario = SCENARIOS[c["scenario"]]
            rng = random.Random(c["seed"])
            new = [LoadClient(c["url"], scenario, self.mic, random.Random(rng.random()), self.mic_class) for _ in range(c["n"])]
            errors = []
            # A few at a time: a burst of DTLS handshakes is not what is being measured.
            for i in range(0, len(new), 8):
                batch = new[i : i + 8]
                results = await asyncio.gather(*(client.start() for client in batch), return_exceptions=True)
                for client, result in zip(batch, results):
                    if isinstance(result, BaseException):
                        errors.append(f"{type(result).__name__}: {result}"[:200])
                        await client.close()
                    else:
                        self.clients.append(client)
            return {"connected": len(new) - len(errors), "failed": len(errors), "errors": errors[:3]}
        if cmd == "mark":
            now = time.perf_counter()
            for client in self.clients:
                client.reset(now)
            self.lag = []
            self.measuring = True
            return {"t": now}
        if cmd == "report":
            now = time.perf_counter()
            self.measuring = False
            out = {"clients": len(self.clients), "backend_frames": sum(c.backend_frames for c in self.clients), "packets": 0, "speech_s": 0.0, "gaps_ms": [], "errors": [],
                   "closed_by_server": 0, "window_s": None}
            counts: dict[str, int] = {}
            for client in self.clients:
                out["window_s"] = now - client.mark if client.mark is not None else None
                out["packets"] += client.packets
                out["speech_s"] += client.speech_in_window(now)
                out["gaps_ms"].extend(round(g * 1000.0, 2) for g in client.gaps)
                out["errors"].extend(client.error_examples)
                out["closed_by_server"] += client.closed_by_server
                for k, v in client.counts.items():
                    counts[k] = counts.get(k, 0) + v
                client.mark = None
            out["counts"] = counts
            out["errors"] = out["errors"][:3]
            out["loop_lag_ms"] = [round(x * 1000.0, 2) for x in self.lag]
            return out
        if cmd == "close":
            n = len(self.clients)
            await self.close_all()
            return {"closed": n}
        if cmd == "exit":
            return {"bye": True}
        return {"error": f"unknown command {cmd!r}"}

    async def close_all(self) -> None:
        clients, self.clients = self.clients, []
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


# Microphone audio, encoded once (in the orchestrator, before any window).
def opus_packets(pcm48k, bitrate: int = MIC_BITRATE) -> list[bytes]:
    import av
    import numpy as np

    ctx = av.CodecContext.create("libopus", "w")
    ctx.sample_rate, ctx.layout, ctx.format, ctx.bit_rate = 48000, "mono", "s16", bitrate
    ctx.options = {"application": "voip", "frame_duration": "20", "fec": "1", "packet_loss": "5"}
    pcm = np.asarray(pcm48k, dtype=np.int16)
    pcm = np.concatenate([pcm, np.zeros((-len(pcm)) % 960, dtype=np.int16)])
    out = []
    for start in range(0, len(pcm), 960):
        frame = av.AudioFrame.from_ndarray(pcm[start : start + 960].reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, start
        out.extend(bytes(p) for p in ctx.encode(frame))
    for p in ctx.encode(None):
        out.append(bytes(p))
    return out


def with_levels(packets: list[bytes], pcm48k) -> list[tuple[bytes, int]]:
    """Each packet with its frame's level in dBov, -127..0, as aiortc's compute_audio_level_dbov."""
    import numpy as np

    out = []
    for i, payload in enumerate(packets):
        frame = np.asarray(pcm48k[i * 960 : (i + 1) * 960], dtype=np.float64)
        rms = float(np.sqrt(np.mean(frame**2)) / 32767) if len(frame) else 0.0
        out.append((payload, max(-127, min(0, round(20 * np.log10(rms)))) if rms > 0 else -127))
    return out


def prepare_mic() -> tuple[dict, dict, object]:
    """Quiet noise, and the user's sentences in the embedded Piper voice, as Opus packets
    (plus the speech itself, for the calibration)."""
    import numpy as np
    import soxr
    from voxgate.engine.base import SynthesisOptions
    from voxgate.engine.piper.piper_engine import PiperEngine

    rng = np.random.default_rng(7)
    noise_pcm = np.clip(rng.normal(0.0, NOISE_STD, 48000 * 10), -32768, 32767).astype(np.int16)
    noise = with_levels(opus_packets(noise_pcm), noise_pcm)
    engine = PiperEngine(threads=1)
    engine.load()
    speech, pcm_all = [], []
    for text in USER_SAYS:
        pcm = np.concatenate([c.pcm for c in engine.synthesize(text, SynthesisOptions())])
        pcm48 = soxr.resample(pcm, 22050, 48000).astype(np.int16)
        speech.append(with_levels(opus_packets(pcm48), pcm48))
        pcm_all.append(pcm48)
    info = {
        "noise_std": NOISE_STD,
        "noise_packets": len(noise),
        "noise_bytes_per_packet": round(sum(len(p) for p, _ in noise) / len(noise), 1),
        "noise_level_dbov": sorted({level for _, level in noise}),
        "user_sentences_s": [round(len(p) / 48000, 2) for p in pcm_all],
    }
    return {"noise": noise, "speech": speech}, info, np.concatenate(pcm_all)


def main() -> None:
    import logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mic-file", required=True, help="the microphone packets, pickled by prepare_mic's caller")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    asyncio.run(Generator(args.mic_file).run())


if __name__ == "__main__":
    main()
