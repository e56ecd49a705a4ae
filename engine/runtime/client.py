"""The gateway's side of the engine worker: starts it, talks to it, restarts it.

One worker process serves many streams (engine/stream.py). Messages are the
typed records of engine/proto.py, framed by engine/runtime/codec.py. If the worker
dies, every open stream ends with EngineCrashed and a new worker is started
for the streams that follow. A worker that hangs with its pipe open (a deadlock, a
stopped process) would stall every stream instead: a watchdog pings it, as
LiveKit's supervised processes are pinged, and one that leaves a ping unanswered
for `ping_timeout` is killed, which then counts as a crash.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...config import Settings, threads_or_every_core
from . import codec
from .. import proto
from ..base import SynthesisOptions
from ..errors import EngineCrashed, EngineStreamError, EngineUnavailable
from ..text.segmenter import SegmenterConfig
from ..stream import TTSStream
from ..text.text_pipeline import FIRST_UNIT_TIMEOUT_S, TextPipeline
from ..voices import check_voice
from .worker import run_worker

log = logging.getLogger(__name__)

# Chunks a stream may have made but not yet consumed; bounds memory per stream.
STREAM_WINDOW = 3
# The watchdog pings at most this often (LiveKit's interval), and at least four times per bound.
PING_INTERVAL_S = 2.5


@dataclass(kw_only=True)
class EngineConfig:
    """The worker's settings; the defaults are the flags' (voxgate/config.py)."""

    engine: str = Settings.engine
    voice: str | None = Settings.voice
    voice_dir: str | None = Settings.voice_dir  # more voices, chosen by the operator; clients see their names
    device: str = Settings.device
    # Synthesis steps run at once in the worker: one per core unless told.
    parallel: int = field(default_factory=threads_or_every_core)
    # The most intra-op threads one step may use; 0: every core.
    threads: int = Settings.engine_threads
    # The worker logs as the gateway does (--log-level, --log-json).
    log_level: str = Settings.log_level
    log_json: bool = Settings.log_json
    # More keyword arguments for the engine's constructor (PiperEngine(split=False), say).
    engine_options: dict = field(default_factory=dict)
    start_timeout: float = 60.0
    # Called first in the reader thread: the gateway gives it the event loop's priority
    # (gateway/media/priority.py), since it holds the GIL the loop waits for while it unpacks audio.
    reader_setup: Callable[[], None] | None = None
    # The first unit is sent after this long even without a clause boundary.
    first_unit_timeout: float = FIRST_UNIT_TIMEOUT_S
    # A worker that leaves a ping unanswered this long is killed and restarted; 0: no watchdog.
    ping_timeout: float = Settings.engine_ping_timeout_s
    # The scheduler holds a new stream while started speech needs the cores (engine/runtime/scheduler.py).
    hold_new: bool = Settings.engine_hold_new


class EngineClient:
    """The gateway's handle on one engine worker process: starts it, talks to it, restarts it.

    Synthesis runs in its own process so a model never blocks the event loop and
    a crash costs the open streams, not the server. A reader thread hands the
    worker's messages to the loop; streams are made with `stream()`, and reach
    the worker through this client's `StreamTransport` methods (send_unit,
    end_input, cancel, credit).
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.info: dict = {}
        self.restarts = 0
        self._ids = itertools.count(1)
        self._streams: dict[int, TTSStream] = {}
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
        # The worker's last load report (proto.Load, about once a second), and the underruns
        # it has counted across restarts (each worker counts from 0).
        self.load: proto.Load | None = None
        self.underruns = 0
        # The watchdog's unanswered ping (token, sent at, time.monotonic), or None; the reader
        # thread clears it, so an answer counts when it arrives, however late the loop is.
        self._watch_ping: tuple[int, float] | None = None
        self._watchdog: asyncio.Future | None = None
        self.slowest_ping_s = 0.0  # the longest a watchdog ping has waited for its answer
        self.hung_kills = 0  # restarts that the watchdog began
        self._lost = 0  # the last generation whose loss was handled

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
            args=(child, self.config.engine, options, self.config.parallel, self.config.log_level, self.config.log_json,
                  self.config.hold_new),
            name=f"voxgate-engine-{self.config.engine}",
            daemon=True,
        )
        self._ready = self._loop.create_future()
        self._generation += 1
        self.load = None
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
        if self.config.ping_timeout > 0:
            self._watch_ping = None
            self._watchdog = asyncio.ensure_future(self._watch(generation))

    async def close(self) -> None:
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._fail_all(EngineUnavailable("the engine is shutting down"))
        if self._conn is not None:
            self._send(proto.Shutdown())
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
        self._send(proto.Ping(token))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pongs.pop(token, None)

    def text_pipeline(self, segmenter: SegmenterConfig | None = None) -> TextPipeline:
        """A fresh text pipeline for one stream: this engine's tags, the configured first-unit timeout."""
        return TextPipeline(
            segmenter=segmenter,
            engine_tags=frozenset(self.info.get("supported_tags", ())),
            first_unit_timeout=self.config.first_unit_timeout,
        )

    def stream(
        self,
        options: SynthesisOptions | None = None,
        pipeline: TextPipeline | None = None,
        start_in_s: float = 0.0,
        held_s: float = 0.0,
        after: TTSStream | None = None,
    ) -> TTSStream:
        """A new stream. `pipeline`: its text pipeline (default: `text_pipeline()`).
        `start_in_s`: seconds until its listener needs the first audio (0: someone
        is waiting now; more for an utterance queued behind others). The worker
        orders steps by it; it travels as a plain duration so that it means the
        same on another machine. `held_s`: audio the caller keeps back from its
        listener until the stream ends (the gateway's resampler and framer), so
        that the worker's deadlines are the listener's. `after`: the stream its
        listener hears before this one (an utterance queued behind another), so
        that this one is needed once that one's audio runs out."""
        if not self.ready:
            raise EngineUnavailable("the engine worker is restarting; try again in a moment")
        sid = next(self._ids)
        stream = TTSStream(self, sid, options=options or SynthesisOptions(), pipeline=pipeline or self.text_pipeline())
        self._streams[sid] = stream
        self._send(proto.OpenStream(
            sid, stream.options.to_dict(), STREAM_WINDOW, max(0.0, float(start_in_s)),
            min(max(0.0, float(held_s)), proto.MAX_HELD_S),
            after.sid if after is not None else None,
        ))
        return stream

    # StreamTransport: what a TTSStream asks of this client
    def send_unit(self, sid: int, index: int, payload: proto.UnitPayload) -> None:
        self._send(proto.PushUnit(sid, index, payload))

    def end_input(self, sid: int) -> None:
        self._send(proto.EndInput(sid))

    def cancel(self, sid: int) -> None:
        self._send(proto.CancelStream(sid))
        self._streams.pop(sid, None)

    def credit(self, sid: int, chunks: int) -> None:
        self._send(proto.Credit(sid, chunks))

    # Pipe plumbing
    def _send(self, message: proto.ToWorker) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send_bytes(codec.pack(message))
        except (OSError, ValueError):
            pass  # the reader notices the dead worker and fails the streams

    def _read_loop(self, conn, generation: int) -> None:
        loop = self._loop
        assert loop is not None
        if self.config.reader_setup is not None:
            self.config.reader_setup()
        while True:
            try:
                record = conn.recv_bytes()
            except (EOFError, OSError):
                _call_soon(loop, self._on_worker_lost, generation)
                return
            message, pcm = codec.unpack(record)
            if isinstance(message, proto.Pong):
                self._answered(message.token)
            if not _call_soon(loop, self._on_message, message, pcm):
                return

    def _on_message(self, message: proto.FromWorker, pcm: np.ndarray | None) -> None:
        if isinstance(message, proto.Chunk):
            stream = self._streams.get(message.sid)
            if stream is not None:
                stream.on_chunk(message, pcm)
        elif isinstance(message, proto.StreamDone):
            stream = self._streams.pop(message.sid, None)
            if stream is not None:
                stream.on_done()
        elif isinstance(message, proto.StreamError):
            stream = self._streams.pop(message.sid, None)
            if stream is not None:
                stream.on_error(EngineStreamError(message.message))
        elif isinstance(message, proto.Load):
            before = self.load.underruns if self.load is not None else 0
            self.underruns += max(0, message.underruns - before)
            self.load = message
        elif isinstance(message, proto.Pong):
            future = self._pongs.get(message.token)
            if future is not None and not future.done():
                future.set_result(message.stats)
        elif isinstance(message, proto.Ready):
            if self._ready and not self._ready.done():
                self._ready.set_result(message.info)
        elif isinstance(message, proto.Fatal):
            if self._ready and not self._ready.done():
                self._ready.set_exception(EngineUnavailable(message.message))

    # The watchdog
    async def _watch(self, generation: int) -> None:
        """Ping the worker every PING_INTERVAL_S (or a quarter of the bound); kill it once a
        ping has waited `ping_timeout`. The worker's scheduling loop answers between messages,
        never inside a synthesis step (steps run on its pool's threads), so a busy worker
        answers in milliseconds and only a stuck loop or a stopped process goes silent."""
        timeout = self.config.ping_timeout
        interval = min(PING_INTERVAL_S, timeout / 4)
        while generation == self._generation and not self._closing:
            pending = self._watch_ping
            if pending is None:
                token = next(self._ids)
                self._watch_ping = (token, time.monotonic())
                self._send(proto.Ping(token))
                await asyncio.sleep(interval)
                continue
            left = pending[1] + timeout - time.monotonic()
            if left > 0:
                await asyncio.sleep(min(left, interval))
                continue
            await self._kill_hung(generation, timeout)
            return

    def _answered(self, token: int) -> None:
        """In the reader thread: a Pong arrived (the watchdog's, or worker_stats')."""
        pending = self._watch_ping
        if pending is not None and pending[0] == token:
            self.slowest_ping_s = max(self.slowest_ping_s, time.monotonic() - pending[1])
            self._watch_ping = None

    async def _kill_hung(self, generation: int, timeout: float) -> None:
        process = self._process
        log.error("engine worker %s answered no ping for %.1f s; killing it to restart it",
                  process.pid if process else None, timeout)
        self.hung_kills += 1
        if process is not None:
            process.kill()  # SIGKILL: a stopped process dies too
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5)
        # Its pipe reads EOF too; whichever comes first restarts it, once.
        self._on_worker_lost(generation)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.on_error(error)

    def _on_worker_lost(self, generation: int) -> None:
        if generation != self._generation or generation == self._lost or self._closing:
            return
        self._lost = generation
        if not self._started:
            if self._ready and not self._ready.done():
                self._ready.set_exception(EngineUnavailable("the engine worker exited while starting"))
            return
        code = self._process.exitcode if self._process else None
        log.error("engine worker exited (code %s); restarting", code)
        if self._ready and not self._ready.done():
            self._ready.set_exception(EngineUnavailable(f"the engine worker exited with code {code}"))
        self._fail_all(EngineCrashed(f"the engine worker stopped unexpectedly (exit code {code}); it is being restarted"))
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


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the loop has closed: nobody is listening any more
        return False
