"""Speech audio as it leaves without a peer: the one home of formatting for `POST /v1/tts`,
OpenAI's `POST /v1/audio/speech` and the TTS WebSocket (signaling/tts_http.py, openai_speech.py,
tts_ws.py only parse, route and write what this gives them).

A formatter takes the engine's PCM and gives the response's bytes (WAV, raw PCM, mu-law, and
Opus, MP3, AAC, FLAC through PyAV); the WebSocket's take the same PCM and give a list of pieces,
each its own message (raw Opus packets, PCM16). Formatting runs on threads of its own, never on
the event loop, and a compressed format pays its price: more of the speech slots, one thread for
all of them, and a pace (`FormatRun`), charged to its caller for late-frame blame.
"""

from __future__ import annotations

import asyncio
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar, cast

import av
import numpy as np
from av.audio.stream import AudioStream

from ..media import priority
from ..media.encoder import OpusEncoder, OpusSettings, ulaw_encode
from ..load.late_blame import LateBlame
from ..media.resample import StreamResampler

T = TypeVar("T")

# Formatters run here (resampling, Opus, PyAV), never on the event loop; one request's calls
# are awaited in order, so each formatter is only ever used by one thread at a time.
# The event loop's priority (--media-priority): these threads hold the GIL it waits for.
FORMAT_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tts-http", initializer=priority.enter_media_thread)
# The compressed formats cost far more CPU per second of audio than WAV or PCM (bench/bench_aac_encodes.py:
# 300 s of tone audio took seconds as aac or mp3, a hundredth of that as wav), and a request is encoded as
# fast as it is synthesized. Their encodes share one thread of their own, so together they take at most
# one core from the event loop that paces every session's frames, and each such request takes
# COMPRESSED_SLOTS of the speech slots and of the budget (gateway/load/admission.py), not one (issue 53, finding 7).
ENCODE_THREADS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tts-encode", initializer=priority.enter_media_thread)
COMPRESSED = frozenset(("mp3", "aac", "opus"))
COMPRESSED_SLOTS = 2
# And each is paced to at most this share of a core: after a piece that took t seconds of CPU, its
# request waits 3t before the next, so an encode (and through the stream's backpressure, the synthesis
# feeding it) cannot take the cores the event loop's frames need. 300 s of aac then takes some 20 s.
COMPRESSED_CORE_SHARE = 0.25
FORMATS = ("wav", "pcm", "mulaw", "opus")  # POST /v1/tts's
# OpenAI's pcm is 24 kHz, and clients play it at that rate.
OPENAI_PCM_RATE = 24000
UNKNOWN_SIZE = 0xFFFFFFFF


# Output formats: engine PCM in, response bytes out.
class Formatter:
    content_type = "application/octet-stream"

    def __init__(self, engine_rate: int) -> None:
        self.engine_rate = engine_rate

    @property
    def sample_rate(self) -> int:
        return self.engine_rate

    def start(self) -> bytes:
        return b""

    def feed(self, pcm: np.ndarray) -> bytes:
        return np.asarray(pcm, dtype="<i2").tobytes()

    def finish(self) -> bytes:
        return b""


class WavFormatter(Formatter):
    content_type = "audio/wav"

    def start(self) -> bytes:
        # RIFF and data sizes unknown while streaming: 0xFFFFFFFF, which players
        # read as "until the end of the stream".
        rate = self.engine_rate
        fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
        return b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", UNKNOWN_SIZE)


class PcmFormatter(Formatter):
    """Raw 16-bit little-endian mono, at the engine's rate or resampled to `rate`."""

    def __init__(self, engine_rate: int, rate: int | None = None) -> None:
        super().__init__(engine_rate)
        self.resampler = StreamResampler(engine_rate, rate or engine_rate)

    @property
    def sample_rate(self) -> int:
        return self.resampler.out_rate

    @property
    def content_type(self) -> str:  # type: ignore[override]
        return f"audio/L16; rate={self.sample_rate}; channels=1"

    def feed(self, pcm: np.ndarray) -> bytes:
        return self.resampler.process(pcm).astype("<i2").tobytes()

    def finish(self) -> bytes:
        return self.resampler.process(np.zeros(0, dtype=np.int16), last=True).astype("<i2").tobytes()


class MulawFormatter(Formatter):
    content_type = "audio/basic"

    def __init__(self, engine_rate: int) -> None:
        super().__init__(engine_rate)
        self.resampler = StreamResampler(engine_rate, 8000)

    @property
    def sample_rate(self) -> int:
        return 8000

    def feed(self, pcm: np.ndarray) -> bytes:
        return ulaw_encode(self.resampler.process(pcm))

    def finish(self) -> bytes:
        return ulaw_encode(self.resampler.process(np.zeros(0, dtype=np.int16), last=True))


class _Sink:
    """Where the Ogg muxer writes; taken out after every call."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> int:
        self.data += bytes(data)
        return len(data)

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class EncodedFormatter(Formatter):
    """A codec in a streamable container, encoded by PyAV's bundled FFmpeg.

    PyAV cuts what it is fed into the codec's frame size itself, so chunks of any
    length go in, and the muxer writes each packet out as it is made (the sink
    cannot seek), so bytes leave with the audio rather than at the end.
    """

    container_format = "ogg"
    codec = "libopus"
    rate: int | None = None  # None: the engine's rate
    options: dict[str, str] = {}

    def __init__(self, engine_rate: int) -> None:
        super().__init__(engine_rate)
        self._rate = self.rate or engine_rate
        self.resampler = StreamResampler(engine_rate, self._rate)
        self.sink = _Sink()
        self.container = av.open(self.sink, "w", format=self.container_format, options=dict(self.options))
        self.stream = cast(AudioStream, self.container.add_stream(self.codec, rate=self._rate))
        self.stream.layout = "mono"
        self.pts = 0

    @property
    def sample_rate(self) -> int:
        return self._rate

    def _encode(self, pcm: np.ndarray | None) -> None:
        frame = None
        if pcm is not None:
            if not len(pcm):
                return
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self._rate
            frame.pts = self.pts
            self.pts += len(pcm)
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def feed(self, pcm: np.ndarray) -> bytes:
        self._encode(self.resampler.process(pcm))
        return self.sink.take()

    def finish(self) -> bytes:
        self._encode(self.resampler.process(np.zeros(0, dtype=np.int16), last=True))
        self._encode(None)
        self.container.close()
        return self.sink.take()

    def close(self) -> None:
        try:
            self.container.close()
        except Exception:
            pass


class OpusFormatter(EncodedFormatter):
    content_type = "audio/ogg; codecs=opus"
    rate = 48000
    # Short Ogg pages, so audio leaves as it is encoded rather than once a second.
    options = {"page_duration": "100000"}


class Mp3Formatter(EncodedFormatter):
    content_type = "audio/mpeg"
    container_format = "mp3"
    codec = "libmp3lame"


class AacFormatter(EncodedFormatter):
    content_type = "audio/aac"
    container_format = "adts"
    codec = "aac"


class FlacFormatter(EncodedFormatter):
    content_type = "audio/flac"
    container_format = "flac"
    codec = "flac"


FORMATTERS: dict[str, type[Formatter]] = {
    "wav": WavFormatter,
    "pcm": PcmFormatter,
    "mulaw": MulawFormatter,
    "opus": OpusFormatter,
}


# OpenAI's formats (POST /v1/audio/speech): the engine's rate -> a formatter.
OPENAI_FORMATTERS: dict[str, Callable[[int], Formatter]] = {
    "mp3": Mp3Formatter,
    "opus": OpusFormatter,
    "aac": AacFormatter,
    "flac": FlacFormatter,
    "wav": WavFormatter,
    "pcm": lambda rate: PcmFormatter(rate, OPENAI_PCM_RATE),
}


# Each speech route's formats by name: POST /v1/tts's and OpenAI's.
FORMAT_FAMILIES: dict[str, dict[str, Callable[[int], Formatter]]] = {"tts": dict(FORMATTERS), "openai": OPENAI_FORMATTERS}


# The TTS WebSocket's (signaling/tts_ws.py): a list of pieces a chunk, each sent as one message.
class OpusPackets:
    """Engine PCM in, raw Opus packets (20 ms each, decoded at 48 kHz) out; the
    last frame padded with silence."""

    def __init__(self, engine_rate: int) -> None:
        # Over a WebSocket (TCP) nothing is lost: --opus-bitrate throughout, not the FEC bitrate.
        self.encoder = OpusEncoder(OpusSettings(signal="voice", fec_bitrate=0))
        self.resampler = StreamResampler(engine_rate, self.encoder.sample_rate)
        self.frame = self.encoder.frame_samples
        self.pending = np.zeros(0, dtype=np.int16)

    def feed(self, pcm: np.ndarray) -> list[bytes]:
        pcm = np.concatenate([self.pending, self.resampler.process(pcm)])
        whole = len(pcm) - len(pcm) % self.frame
        self.pending = pcm[whole:]
        return self.encoder.encode(pcm[:whole]) if whole else []

    def finish(self) -> list[bytes]:
        pcm = np.concatenate([self.pending, self.resampler.process(np.zeros(0, dtype=np.int16), last=True)])
        self.pending = np.zeros(0, dtype=np.int16)
        if len(pcm) % self.frame:
            pcm = np.concatenate([pcm, np.zeros(self.frame - len(pcm) % self.frame, dtype=np.int16)])
        return self.encoder.encode(pcm) if len(pcm) else []


class Pcm16Pieces:
    """Engine PCM in, PCM16 LE at the connection's rate out, one piece per chunk."""

    def __init__(self, engine_rate: int, rate: int) -> None:
        self.formatter = PcmFormatter(engine_rate, rate)

    def feed(self, pcm: np.ndarray) -> list[bytes]:
        data = self.formatter.feed(pcm)
        return [data] if data else []

    def finish(self) -> list[bytes]:
        data = self.formatter.finish()
        return [data] if data else []


def slots_of(fmt: str) -> int:
    """The speech slots a request in format `fmt` takes: its encode's price."""
    return COMPRESSED_SLOTS if fmt in COMPRESSED else 1


def pause_after(fmt: str, cpu_s: float) -> float:
    """How long a request in format `fmt` waits after a piece that took `cpu_s` of CPU (COMPRESSED_CORE_SHARE)."""
    return cpu_s * (1.0 / COMPRESSED_CORE_SHARE - 1.0) if fmt in COMPRESSED else 0.0


def threads_of(fmt: str) -> ThreadPoolExecutor:
    """Where a request in format `fmt` is formatted: the compressed ones on their one thread."""
    return ENCODE_THREADS if fmt in COMPRESSED else FORMAT_THREADS


def _timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """`fn(*args)` and the CPU time it took this thread."""
    started = time.thread_time()
    result = fn(*args)
    return result, time.thread_time() - started


class FormatRun:
    """One request's formatting in format `fmt`: each call on the format's thread (`threads_of`),
    its CPU time charged to `tenant` (gateway/load/late_blame.py), and a compressed format paced
    (`pause_after`). `shed` stops the request when its encodes are blamed for late frames; the
    route that made it says how (signaling/tts_http.py aborts its connection)."""

    def __init__(self, fmt: str, blame: LateBlame, tenant: str, shed: Callable[[str], None]) -> None:
        self.fmt = fmt
        self.blame = blame
        self.tenant = tenant
        self._shed = shed
        self.threads = threads_of(fmt)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        result, spent = await asyncio.get_running_loop().run_in_executor(self.threads, _timed, fn, *args)
        self.blame.charge(self.tenant, spent, self)  # on the loop's thread: the blame's tables are its alone
        pause = pause_after(self.fmt, spent)
        if pause > 0:
            await asyncio.sleep(pause)  # a compressed encode's pace
        return result

    def shed(self, why: str) -> None:
        self._shed(why)

    def forget(self) -> None:
        """The request is over: nothing more to charge or shed."""
        self.blame.forget(self)
