"""The engine worker process: owns the model and the device, serves many streams.

The gateway sends, per stream: open, text units, end, credit and cancel. The
worker's scheduler steps one chunk at a time per stream, so a stream's cancel
takes effect within one chunk, and a new stream's first chunk goes ahead of
streams that are already speaking (they have audio buffered; it has none).
Synthesis steps run on a small thread pool; onnxruntime and torch release the
GIL, so steps of different streams overlap on the cores.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

from . import wire
from .base import AudioChunk, Engine, EngineError, SynthesisOptions
from .registry import create_engine
from .tags import from_wire, render

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    sid: int
    options: SynthesisOptions
    units: deque = field(default_factory=deque)  # (unit_index, text)
    current: Iterator[AudioChunk] | None = None
    current_index: int = 0
    credit: int = 0
    ended: bool = False
    busy: bool = False
    chunks_sent: int = 0
    last_served: float = 0.0

    def runnable(self) -> bool:
        return not self.busy and self.credit > 0 and (self.current is not None or bool(self.units))


class Scheduler:
    def __init__(self, engine: Engine, send, parallel: int) -> None:
        self.engine = engine
        self.send = send
        self.parallel = max(1, parallel)
        self.streams: dict[int, _Stream] = {}
        self.inbox: "queue.Queue[tuple]" = queue.Queue()
        self.pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="synth")
        self.in_flight = 0
        # Engines with start()/step() (the torch engine) advance many streams in one pass.
        self.batching = hasattr(engine, "step") and hasattr(engine, "start")
        self.max_batch = int(engine.info().get("max_batch", 8)) if self.batching else 1
        self.counters = {"steps": 0, "batches": 0, "batched_streams": 0, "largest_batch": 0}

    # Messages from the gateway
    def handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "open":
            _, sid, options, credit = msg
            self.streams[sid] = _Stream(sid, SynthesisOptions.from_dict(options), credit=credit)
        elif kind == "text":
            _, sid, index, text = msg
            stream = self.streams.get(sid)
            if stream is not None:
                stream.units.append((index, text))
        elif kind == "end":
            stream = self.streams.get(msg[1])
            if stream is not None:
                stream.ended = True
                self._maybe_finish(stream)
        elif kind == "credit":
            stream = self.streams.get(msg[1])
            if stream is not None:
                stream.credit += msg[2]
        elif kind == "cancel":
            stream = self.streams.pop(msg[1], None)
            if stream is not None:
                self._close_generator(stream)
        elif kind == "ping":
            self.send(("pong", msg[1], dict(self.counters, streams=len(self.streams), in_flight=self.in_flight)))
        elif kind == "shutdown":
            return False
        elif kind == "_step":
            self.in_flight -= 1
            self._step_done(*msg[1:])
        elif kind == "_batch":
            self.in_flight -= 1
            for member in msg[1]:
                self._step_done(*member)
        return True

    def _maybe_finish(self, stream: _Stream) -> None:
        if stream.ended and not stream.busy and stream.current is None and not stream.units:
            self.streams.pop(stream.sid, None)
            self.send(("done", stream.sid))

    def _close_generator(self, stream: _Stream) -> None:
        gen, stream.current = stream.current, None
        if gen is not None and not stream.busy:
            _close(gen)

    def _ready(self) -> list[_Stream]:
        # Streams with no audio out yet go first (they have nothing buffered;
        # the others do); then the longest-waiting.
        ready = [s for s in self.streams.values() if s.runnable()]
        ready.sort(key=lambda s: (s.chunks_sent > 0, s.last_served))
        return ready

    def _begin_unit(self, stream: _Stream) -> None:
        index, text = stream.units.popleft()
        stream.current_index = index
        if isinstance(text, list):  # speech-tag pieces: pauses, rate spans
            stream.current = iter(render(self.engine, from_wire(text), stream.options))
        elif self.batching:
            stream.current = self.engine.start(text, stream.options)
        else:
            stream.current = iter(self.engine.synthesize(text, stream.options))

    def dispatch(self) -> None:
        while self.in_flight < self.parallel:
            ready = self._ready()
            if not ready:
                return
            for stream in ready:
                if stream.current is None:
                    self._begin_unit(stream)
            stream = ready[0]
            if not _is_job(stream.current):
                group = [stream]
                self.pool.submit(self._run_step, stream.sid, stream.current)
            else:
                # One batched pass for several streams' next windows. Streams still
                # waiting for their first audio are batched only with each other,
                # so a new stream's first window never waits behind a full batch.
                fresh = stream.chunks_sent == 0
                group = [
                    s for s in ready
                    if _is_job(s.current) and (s.chunks_sent == 0) == fresh
                ][: self.max_batch]
                self.pool.submit(self._run_batch, [(s.sid, s.current) for s in group])
                self.counters["batches"] += 1
                self.counters["batched_streams"] += len(group)
                self.counters["largest_batch"] = max(self.counters["largest_batch"], len(group))
            self.counters["steps"] += 1
            for member in group:
                member.busy = True
                member.credit -= 1
            self.in_flight += 1

    def _run_step(self, sid: int, gen: Iterator[AudioChunk]) -> None:
        started = time.monotonic()  # CLOCK_MONOTONIC: comparable with the gateway's clock
        t0 = time.perf_counter()
        try:
            chunk = next(gen, None)
            result: object = chunk
        except EngineError as exc:
            result = exc
        except Exception as exc:  # an engine bug must not take down other streams
            log.error("synthesis failed: %s", traceback.format_exc())
            result = RuntimeError(f"{type(exc).__name__}: {exc}")
        self.inbox.put(("_step", sid, gen, result, time.perf_counter() - t0, started))

    def _run_batch(self, members: list[tuple[int, object]]) -> None:
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            results: list[object] = list(self.engine.step([job for _, job in members]))
        except EngineError as exc:
            results = [exc] * len(members)
        except Exception as exc:
            log.error("batched synthesis failed: %s", traceback.format_exc())
            results = [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(members)
        seconds = time.perf_counter() - t0
        self.inbox.put(("_batch", [(sid, job, result, seconds, started) for (sid, job), result in zip(members, results)]))

    def _step_done(self, sid: int, gen, result, seconds: float, started: float) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.current is not gen:
            # Cancelled while the step ran: discard its audio.
            _close(gen)
            return
        stream.busy = False
        stream.last_served = time.monotonic()
        if isinstance(result, Exception):
            self.streams.pop(sid, None)
            self.send(("error", sid, str(result)))
            return
        if result is None:
            stream.current = None
            stream.credit += 1  # nothing was sent for this step
            self._maybe_finish(stream)
            return
        chunk: AudioChunk = result
        stream.chunks_sent += 1
        meta = {
            "sample_rate": chunk.sample_rate,
            "text": chunk.text,
            "words": [(w.text, float(w.start), float(w.end)) for w in chunk.words],
            "unit_index": stream.current_index,
            "unit_end": chunk.unit_end,
            "synth_s": seconds,
            "synth_started_at": started,
        }
        self.send(("chunk", sid, meta), chunk.pcm)
        if _is_job(stream.current) and stream.current.done:
            stream.current = None
            self._maybe_finish(stream)


def _is_job(current: object) -> bool:
    return current is not None and not hasattr(current, "__next__")


def _close(current: object) -> None:
    close = getattr(current, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


def run_worker(conn, engine_name: str, engine_options: dict, parallel: int) -> None:
    """Entry point of the spawned process."""
    logging.basicConfig(level=os.environ.get("VOXGATE_LOG_LEVEL", "INFO"))
    send_lock = threading.Lock()

    def send(header: tuple, pcm=None) -> None:
        data = wire.pack(header, pcm)
        with send_lock:
            conn.send_bytes(data)

    try:
        engine = create_engine(engine_name, **engine_options)
        t0 = time.perf_counter()
        engine.load()
        info = engine.info()
        info["load_s"] = time.perf_counter() - t0
        info["pid"] = os.getpid()
    except Exception as exc:
        send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    scheduler = Scheduler(engine, send, parallel)
    send(("ready", info))

    def reader() -> None:
        while True:
            try:
                record = conn.recv_bytes()
            except (EOFError, OSError):
                scheduler.inbox.put(("shutdown",))
                return
            header, _ = wire.unpack(record)
            scheduler.inbox.put(header)

    threading.Thread(target=reader, name="worker-reader", daemon=True).start()
    running = True
    while running:
        msg = scheduler.inbox.get()
        running = scheduler.handle(msg)
        # Take everything already waiting before choosing what to run next, so
        # a cancel or a new stream is seen before the next step is dispatched.
        while running:
            try:
                msg = scheduler.inbox.get_nowait()
            except queue.Empty:
                break
            running = scheduler.handle(msg)
        if running:
            scheduler.dispatch()
    scheduler.pool.shutdown(wait=False, cancel_futures=True)
    engine.close()
