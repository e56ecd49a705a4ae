"""The gateway's side of the engine worker: a client and its text-in, audio-out streams.

    stream = client.stream(SynthesisOptions(voice="joe"))
    stream.push_text("Hello, ")        # pieces as they arrive
    stream.push_text("world.")
    stream.end_input()                 # or flush() to end a segment
    async for chunk in stream:         # StreamChunk, in order
        ...
    stream.cancel()                    # at any moment

One worker process serves many streams. If it dies, every open stream ends
with EngineCrashed and a new worker is started for the streams that follow.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import wire
from .base import SynthesisOptions, WordTiming
from .segmenter import Segmenter, SegmenterConfig, Unit
from .tags import Speech, TagState, to_wire
from .voices import check_voice
from .worker import run_worker

log = logging.getLogger(__name__)

# Chunks a stream may have made but not yet consumed; bounds memory per stream.
STREAM_WINDOW = 3


class EngineUnavailable(RuntimeError):
    """The worker could not be started or is restarting."""


class EngineCrashed(RuntimeError):
    """The worker died while this stream was open."""


class EngineStreamError(RuntimeError):
    """The engine refused this stream's text or options."""


ENGINE_ERROR_TEXT = "the engine could not synthesize this utterance's text"


def public_engine_error(exc: Exception) -> str:
    """What a client is told about an engine failure: generic text. The engine's own
    message (onnxruntime's, with its source paths) goes to the server log only."""
    if isinstance(exc, EngineStreamError):
        log.warning("engine refused a stream: %s", exc)
        return ENGINE_ERROR_TEXT
    return str(exc)  # crashes and restarts: our own words, no engine internals


@dataclass
class StreamChunk:
    pcm: np.ndarray
    sample_rate: int
    text: str
    words: list[WordTiming]
    unit_index: int
    unit_end: bool
    # When the unit was sent to the worker.
    unit_sent_at: float = 0.0
    synth_s: float = 0.0
    # When the worker began the step that made this chunk (time.monotonic, which
    # is the same clock in both processes).
    synth_started_at: float = 0.0

    @property
    def duration(self) -> float:
        return len(self.pcm) / float(self.sample_rate)


@dataclass
class EngineConfig:
    engine: str = "piper"
    voice: str | None = None
    voice_dir: str | None = None  # more voices, chosen by the operator; clients see their names
    device: str = "auto"
    # Synthesis steps run at once in the worker.
    parallel: int = field(default_factory=lambda: os.cpu_count() or 1)
    # The most intra-op threads one step may use; 0: the engine's choice (every core).
    threads: int = 0
    # More keyword arguments for the engine's constructor (PiperEngine(split=False), say).
    engine_options: dict = field(default_factory=dict)
    start_timeout: float = 60.0
    # The first unit is sent after this long even without a clause boundary.
    first_unit_timeout: float = 0.35


class EngineClient:
    """The gateway's handle on one engine worker process: starts it, talks to it, restarts it.

    Synthesis runs in its own process so a model never blocks the event loop and
    a crash costs the open streams, not the server. A reader thread hands the
    worker's messages to the loop; streams are made with `stream()`.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.info: dict = {}
        self.restarts = 0
        self._ids = itertools.count(1)
        self._streams: dict[int, "TTSStream"] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._ready: asyncio.Future | None = None
        self._closing = False
        self._started = False
        self._generation = 0
        self._send_lock = threading.Lock()
        self.listeners: list = []  # callables(event: str, data: dict) for metrics
        self._pongs: dict[int, asyncio.Future] = {}

    # Lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._spawn()
        self._started = True

    async def _spawn(self) -> None:
        assert self._loop is not None
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        options = {
            **self.config.engine_options,
            "voice": self.config.voice,
            "device": self.config.device,
            "threads": self.config.threads,
            "voice_dir": self.config.voice_dir,
        }
        process = ctx.Process(
            target=run_worker,
            args=(child, self.config.engine, options, self.config.parallel),
            name=f"voxgate-engine-{self.config.engine}",
            daemon=True,
        )
        self._ready = self._loop.create_future()
        self._generation += 1
        generation = self._generation
        await self._loop.run_in_executor(None, process.start)
        child.close()  # so that the worker's death reads as EOF here
        self._process, self._conn = process, parent
        threading.Thread(
            target=self._read_loop, args=(parent, generation), name="engine-reader", daemon=True
        ).start()
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), self.config.start_timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(
                f"the {self.config.engine} engine worker did not start within {self.config.start_timeout:.0f} s"
            ) from None

    async def close(self) -> None:
        self._closing = True
        for stream in list(self._streams.values()):
            stream._fail(EngineUnavailable("the engine is shutting down"))
        if self._conn is not None:
            self._send(("shutdown",))
        process = self._process
        if process is not None:
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5)
            if process.is_alive():
                process.kill()
        if self._conn is not None:
            self._conn.close()

    @property
    def ready(self) -> bool:
        return bool(self._ready and self._ready.done() and not self._ready.exception())

    @property
    def worker_pid(self) -> int | None:
        return self._process.pid if self._process else None

    def check_voice(self, voice: object) -> str | None:
        """The one voice check, against the worker's list of voices (see engine/voices.py)."""
        return check_voice(self.info.get("voices", []), voice)

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    async def worker_stats(self, timeout: float = 5.0) -> dict:
        """Scheduler counters from the worker: steps, batched passes, largest batch, open streams."""
        assert self._loop is not None
        token = next(self._ids)
        future = self._loop.create_future()
        self._pongs[token] = future
        self._send(("ping", token))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pongs.pop(token, None)

    def stream(
        self,
        options: SynthesisOptions | None = None,
        segmenter: SegmenterConfig | None = None,
        start_in_s: float = 0.0,
    ) -> "TTSStream":
        """A new stream. `start_in_s`: seconds until its listener needs the first
        audio (0: someone is waiting now; more for an utterance queued behind
        others). The worker orders steps by it; it travels as a plain duration
        so that it means the same on another machine."""
        if not self.ready:
            raise EngineUnavailable("the engine worker is restarting; try again in a moment")
        sid = next(self._ids)
        stream = TTSStream(self, sid, options or SynthesisOptions(), segmenter)
        self._streams[sid] = stream
        self._send(("open", sid, stream.options.to_dict(), STREAM_WINDOW, max(0.0, float(start_in_s))))
        return stream

    # Pipe plumbing
    def _send(self, header: tuple) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send_bytes(wire.pack(header))
        except (OSError, ValueError):
            pass  # the reader notices the dead worker and fails the streams

    def _read_loop(self, conn, generation: int) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                record = conn.recv_bytes()
            except (EOFError, OSError):
                _call_soon(loop, self._on_worker_lost, generation)
                return
            header, pcm = wire.unpack(record)
            if not _call_soon(loop, self._on_message, header, pcm):
                return

    def _on_message(self, header: tuple, pcm) -> None:
        kind = header[0]
        if kind == "ready":
            if self._ready and not self._ready.done():
                self._ready.set_result(header[1])
            return
        if kind == "pong":
            future = self._pongs.get(header[1])
            if future is not None and not future.done():
                future.set_result(header[2])
            return
        if kind == "fatal":
            if self._ready and not self._ready.done():
                self._ready.set_exception(EngineUnavailable(header[1]))
            return
        stream = self._streams.get(header[1]) if len(header) > 1 else None
        if stream is None:
            return
        if kind == "chunk":
            stream._on_chunk(header[2], pcm)
        elif kind == "done":
            stream._on_done()
        elif kind == "error":
            stream._fail(EngineStreamError(header[2]))

    def _on_worker_lost(self, generation: int) -> None:
        if generation != self._generation or self._closing:
            return
        if not self._started:
            if self._ready and not self._ready.done():
                self._ready.set_exception(EngineUnavailable("the engine worker exited while starting"))
            return
        code = self._process.exitcode if self._process else None
        log.error("engine worker exited (code %s); restarting", code)
        if self._ready and not self._ready.done():
            self._ready.set_exception(EngineUnavailable(f"the engine worker exited with code {code}"))
        error = EngineCrashed(f"the engine worker stopped unexpectedly (exit code {code}); it is being restarted")
        for stream in list(self._streams.values()):
            stream._fail(error)
        self.restarts += 1
        for listener in self.listeners:
            listener("restart", {"exitcode": code})
        self._ready = None
        asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        delay = 0.1
        while not self._closing:
            try:
                await self._spawn()
                return
            except Exception as exc:
                log.error("engine worker restart failed: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _forget(self, sid: int) -> None:
        self._streams.pop(sid, None)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the loop has closed: nobody is listening any more
        return False


class TTSStream:
    """Text in piece by piece, audio out as an async iterator."""

    def __init__(self, client: EngineClient, sid: int, options: SynthesisOptions, segmenter: SegmenterConfig | None) -> None:
        self.client = client
        self.sid = sid
        self.options = options
        self.segmenter = Segmenter(segmenter)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unit_index = 0
        self._units: dict[int, float] = {}  # unit index -> when it was sent to the worker
        # The unit of the last chunk that said something, and whether its text ended
        # in a space: a unit's last chunk has none, so the next unit's text gets one.
        self._text_unit = -1
        self._text_spaced = True
        self._input_ended = False
        self._closed = False
        self._first_timer: asyncio.TimerHandle | None = None
        self.first_text_at: float | None = None
        self.first_unit_sent_at: float | None = None
        # Inline speech tags; open ones carry over between units.
        self.tags = TagState(engine_tags=frozenset(client.info.get("supported_tags", ())))

    # Text in
    def push_text(self, text: str) -> None:
        if self._input_ended or self._closed:
            raise RuntimeError("push_text after end_input or cancel")
        if not text:
            return
        now = time.perf_counter()
        if self.first_text_at is None:
            self.first_text_at = now
            timeout = self.client.config.first_unit_timeout
            if timeout > 0:
                self._first_timer = asyncio.get_running_loop().call_later(timeout, self._first_timeout)
        self._send_units(self.segmenter.push(text))

    def flush(self) -> None:
        """End of a segment: whatever text is pending is spoken now."""
        self._send_units(self.segmenter.end())

    def end_input(self) -> None:
        if self._input_ended or self._closed:
            return
        self.flush()
        self._input_ended = True
        if self._first_timer:
            self._first_timer.cancel()
        self.client._send(("end", self.sid))

    def cancel(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._first_timer:
            self._first_timer.cancel()
        self.client._send(("cancel", self.sid))
        self.client._forget(self.sid)
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    def _first_timeout(self) -> None:
        if not self._closed and not self.segmenter.started:
            self._send_units(self.segmenter.flush_first())

    def _send_units(self, units: list[Unit]) -> None:
        for unit in units:
            pieces = self.tags.pieces(unit.raw)
            if not pieces:
                continue
            index = self._unit_index
            self._unit_index += 1
            sent = time.perf_counter()
            if self.first_unit_sent_at is None:
                self.first_unit_sent_at = sent
            self._units[index] = sent
            if len(pieces) == 1 and isinstance(pieces[0], Speech) and pieces[0].rate == 1.0:
                payload: str | list = pieces[0].text  # plain text, as before tags existed
            else:
                payload = to_wire(pieces)
            self.client._send(("text", self.sid, index, payload))

    # Audio out
    def _on_chunk(self, meta: dict, pcm) -> None:
        sent_at = self._units.get(meta["unit_index"], 0.0)
        chunk = StreamChunk(
            pcm=pcm if pcm is not None else np.zeros(0, dtype=np.int16),
            sample_rate=meta["sample_rate"],
            text=self._joined_text(meta["text"], meta["unit_index"]),
            words=[WordTiming(*w) for w in meta["words"]],
            unit_index=meta["unit_index"],
            unit_end=meta["unit_end"],
            unit_sent_at=sent_at,
            synth_s=meta.get("synth_s", 0.0),
            synth_started_at=meta.get("synth_started_at", 0.0),
        )
        self._queue.put_nowait(chunk)

    def _joined_text(self, text: str, unit_index: int) -> str:
        """The chunk's text, with a space in front when it starts a new unit right
        after a unit whose text ended without one ("Third," + "a short one.")."""
        if not text:
            return text
        if unit_index != self._text_unit and not self._text_spaced and not text[0].isspace():
            text = " " + text
        self._text_unit = unit_index
        self._text_spaced = text[-1].isspace()
        return text

    def _on_done(self) -> None:
        self.client._forget(self.sid)
        self._queue.put_nowait(None)

    def _fail(self, error: Exception) -> None:
        self.client._forget(self.sid)
        self._queue.put_nowait(error)

    def __aiter__(self) -> "TTSStream":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self._closed = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self._closed = True
            raise item
        # Consumed: the worker may make one more.
        self.client._send(("credit", self.sid, 1))
        return item

    async def aclose(self) -> None:
        self.cancel()
