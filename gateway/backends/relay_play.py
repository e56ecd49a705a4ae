"""A relay application's `play`: audio fetched from a URL and played as one of the session's
utterances, so a barge-in, a cancel and `played_ms` treat it as they treat speech (docs/relay.md).

Voxgate fetches only what the operator allowed, and a bounded amount of it:
- the URL's origin must be one of --relay-play-origin (none by default: `play` is refused);
- the connection passes the outbound guard (gateway/backends/outbound.py): loopback and private
  addresses only with --relay-allow-private, checked on the address connected to;
- no redirects (one could lead to another origin), HTTP 200 only;
- --relay-play-timeout-s for the whole fetch, --relay-connect-timeout-s for its connection;
- --relay-play-max-bytes, by Content-Length before reading and by what arrives after;
- decoded by PyAV from memory, with the container named from its first bytes (WAV, MP3, Ogg,
  FLAC, MP4/M4A, WebM/Matroska, AAC), never probed: a playlist or a concat script would make
  FFmpeg open other URLs or files. Decoding stops at --relay-play-max-s of audio.

The fetch runs on the event loop (aiohttp), the decode on a small thread pool of its own. A session
loads its plays one at a time, in order (the next is fetched while the one before plays), and the
process at most MAX_LOADS at once; how many wait is bounded by the session's utterance queue. What
fails is an `error` to the application; the utterance ends with no audio and the conversation goes on.
"""

from __future__ import annotations

import asyncio
import io
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, cast
from urllib.parse import urlsplit

import aiohttp
import av
import numpy as np

from ...config import play_origin
from ...engine.stream import StreamChunk, TTSStream
from .outbound import PrivateAddress, guarded_http, private_refusal, refuse_private_host, shown_url
from ..media.playout import UtterancePlay
from ..errors import GatewayError

if TYPE_CHECKING:
    from ...config import Settings
    from ..sessions.session import Session

MAX_LOADS = 8  # fetching or decoding at once, in the whole process
DECODE_THREADS = 2
CHUNK_S = 1.0  # the clip reaches the feeder in pieces this long (it encodes only a second ahead anyway)
FETCH_PIECE = 65536
# Containers by their first bytes, and the PyAV (FFmpeg) demuxer each is opened with.
MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"RIFF", "wav"), (0, b"ID3", "mp3"), (0, b"OggS", "ogg"), (0, b"fLaC", "flac"),
    (4, b"ftyp", "mov"), (0, b"\x1a\x45\xdf\xa3", "matroska"),
)
ALLOWED_KINDS = "WAV, MP3, Ogg, FLAC, MP4/M4A, WebM, AAC"

_decoder = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="relay-play")
# The process's MAX_LOADS, per event loop (a semaphore belongs to one loop; tests run several in turn).
_process_loads: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _process_slots() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    slots = _process_loads.get(loop)
    if slots is None:
        slots = _process_loads[loop] = asyncio.Semaphore(MAX_LOADS)
    return slots


class PlayRefused(Exception):
    """Why a `play` is not played; str() is the `error` description's detail."""


def container_of(head: bytes) -> str | None:
    """The demuxer for a file by its first bytes, or None if it is not an audio file played here."""
    for offset, magic, name in MAGIC:
        if head[offset:offset + len(magic)] == magic:
            if name == "wav" and head[8:12] != b"WAVE":
                return None
            return name
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # MPEG audio frame sync: ADTS AAC has layer bits 00, MP3 has them set.
        return "aac" if head[1] & 0x06 == 0 else "mp3"
    return None


def check_source(url: str, origins: list[str]) -> str:
    """The URL if its origin is allowed; PlayRefused says why not."""
    origin = play_origin(url)
    if origin is None:
        raise PlayRefused(f"'source' must be an http:// or https:// URL, not {url[:80]!r}")
    if origin not in {play_origin(o) for o in origins}:
        if not origins:
            raise PlayRefused("this server fetches no audio (no --relay-play-origin); send text")
        raise PlayRefused(f"{origin} is not an origin this server fetches audio from (--relay-play-origin)")
    return url


async def fetch(url: str, settings: Settings) -> bytes:
    """The file at `url`, within the guard, the timeouts and the size cap."""
    allow = settings.relay_allow_private
    limit = settings.relay_play_max_bytes
    try:
        refuse_private_host(urlsplit(url).hostname or "", allow)
        timeout = aiohttp.ClientTimeout(total=settings.relay_play_timeout_s, sock_connect=settings.relay_connect_timeout_s)
        async with guarded_http(allow, timeout=timeout) as http:
            async with http.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise PlayRefused(f"fetching the audio answered HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > limit:
                    raise PlayRefused(f"the audio is {resp.content_length} bytes; the limit is {limit} "
                                      "(--relay-play-max-bytes)")
                body = bytearray()
                async for piece in resp.content.iter_chunked(FETCH_PIECE):
                    body += piece
                    if len(body) > limit:
                        raise PlayRefused(f"the audio is over {limit} bytes (--relay-play-max-bytes)")
                return bytes(body)
    except PrivateAddress as exc:
        raise PlayRefused(str(exc)) from None
    except asyncio.TimeoutError:
        raise PlayRefused(f"the audio was not fetched within {settings.relay_play_timeout_s:g} s "
                          "(--relay-play-timeout-s)") from None
    except (aiohttp.ClientError, OSError) as exc:
        refused = private_refusal(exc)
        if refused is not None:
            raise PlayRefused(str(refused)) from None
        raise PlayRefused(f"could not fetch the audio: {type(exc).__name__}") from None


def decode(data: bytes, rate: int, max_s: float, deadline_s: float = 30.0) -> np.ndarray:
    """Mono int16 PCM at `rate` of the file's first audio stream, at most `max_s` of it. Runs on a thread."""
    kind = container_of(data[:16])
    if kind is None:
        raise PlayRefused(f"the file is not audio played here ({ALLOWED_KINDS})")
    limit = int(max_s * rate)
    deadline = time.monotonic() + deadline_s
    pieces: list[np.ndarray] = []
    have = 0
    try:
        with av.open(io.BytesIO(data), format=kind, mode="r") as container:
            if not container.streams.audio:
                raise PlayRefused("the file holds no audio")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    pcm = out.to_ndarray().reshape(-1)
                    pieces.append(pcm)
                    have += len(pcm)
                if have >= limit or time.monotonic() > deadline:
                    break
            else:
                for out in resampler.resample(None):
                    pieces.append(out.to_ndarray().reshape(-1))
    except PlayRefused:
        raise
    except (av.FFmpegError, ValueError, EOFError, OSError) as exc:
        raise PlayRefused(f"the audio could not be decoded: {type(exc).__name__}") from None
    pcm = np.concatenate(pieces)[:limit].astype(np.int16, copy=False) if pieces else np.zeros(0, np.int16)
    if not len(pcm):
        raise PlayRefused("the file holds no audio")
    return pcm


class ClipStream:
    """A `play`'s audio where an utterance's engine stream would be: what the feeder reads. It has
    no engine stream (`sid` None), so an utterance queued behind it waits on nothing at the engine."""

    sid = None
    first_text_at = None

    def __init__(self, rate: int, loops: int, max_s: float) -> None:
        self.rate = rate
        self.loops = loops  # 0: until interrupted, within max_s
        self.max_samples = int(max_s * rate)
        self.task: asyncio.Future | None = None
        self._pcm: np.ndarray | None = None
        self._ready = asyncio.Event()
        self._closed = False
        self._sent = 0
        self._index = 0

    def set_audio(self, pcm: np.ndarray | None) -> None:
        """The decoded clip; None: there is none (it failed), the utterance ends silent."""
        self._pcm = pcm
        self._ready.set()

    @property
    def total(self) -> int:
        if self._pcm is None or not len(self._pcm):
            return 0
        whole = len(self._pcm) * self.loops if self.loops else self.max_samples
        return min(whole, self.max_samples)

    # What an engine stream is asked for besides its audio.
    def push_text(self, text: str) -> None:
        raise RuntimeError("a play takes no text")

    def flush(self) -> None:
        pass

    def end_input(self) -> None:
        pass

    def cancel(self) -> None:
        self._closed = True
        self._ready.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def __aiter__(self) -> ClipStream:
        return self

    async def __anext__(self) -> StreamChunk:
        await self._ready.wait()
        pcm = self._pcm
        if self._closed or pcm is None or self._sent >= self.total:
            raise StopAsyncIteration
        start = self._sent % len(pcm)
        size = min(int(CHUNK_S * self.rate), len(pcm) - start, self.total - self._sent)
        self._sent += size
        self._index += 1
        return StreamChunk(pcm=pcm[start:start + size], sample_rate=self.rate, unit_index=self._index)


def queue_clip(session: Session, uid: str, source: str, stream: ClipStream) -> UtterancePlay:
    """The clip as the last of the session's utterances, as a `speak` would queue it
    (`UtteranceQueue.add_audio`); PlayRefused when the queue is full."""
    try:
        return session.queue.add_audio(source, uid, cast(TTSStream, stream))
    except GatewayError as exc:
        raise PlayRefused(str(exc)) from None


class RelayPlayer:
    """One relayed session's `play`s: each checked, queued at once in the session's order, and loaded
    in the background; `on_error` sends the application an `error` for one that fails."""

    def __init__(self, session: Session, settings: Settings, source: str, on_error: Callable[[str], None]) -> None:
        self.session = session
        self.settings = settings
        self.source = source
        self.on_error = on_error
        self._loads: set[asyncio.Future] = set()
        self._turn = asyncio.Lock()  # one load at a time, in the order the plays came

    def play(self, uid: str, url: str, loops: int) -> None:
        """Queue `play` as utterance `uid`; PlayRefused (at once) if it is not taken."""
        check_source(url, self.settings.relay_play_origin)
        encoder = self.session.output.encoder
        rate = encoder.sample_rate if encoder is not None else 48000
        stream = ClipStream(rate, loops, self.settings.relay_play_max_s)
        play = queue_clip(self.session, uid, self.source, stream)
        task = asyncio.ensure_future(self._load(stream, play, url))
        stream.task = task
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load(self, stream: ClipStream, play: UtterancePlay, url: str) -> None:
        try:
            async with self._turn, _process_slots():
                data = await fetch(url, self.settings)
                loop = asyncio.get_running_loop()
                pcm = await loop.run_in_executor(_decoder, decode, data, stream.rate, self.settings.relay_play_max_s)
        except PlayRefused as exc:
            self.on_error(f"play {shown_url(url)}: {exc}")
            stream.set_audio(None)
            return
        except asyncio.CancelledError:
            stream.set_audio(None)
            raise
        play.ready_at = time.perf_counter()
        stream.set_audio(pcm)

    def close(self) -> None:
        for task in list(self._loads):
            task.cancel()

