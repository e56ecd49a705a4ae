"""A text-in, audio-out stream, and the narrow seam it talks to its engine through.

    stream = client.stream(SynthesisOptions(voice="joe"))
    stream.push_text("Hello, ")        # pieces as they arrive
    stream.push_text("world.")
    stream.end_input()                 # or flush() to end a segment
    async for chunk in stream:         # StreamChunk, in order
        ...
    stream.cancel()                    # at any moment

The stream owns the order of units and the chunks' text; the text pipeline
(engine/text/text_pipeline.py) cuts units; the transport carries them. Any client
that implements `StreamTransport` and feeds `on_chunk` / `on_done` / `on_error`
back can serve a `TTSStream`: the worker-process client (engine/runtime/client.py) does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import proto
from .base import AudioChunk, SynthesisOptions
from .text.text_pipeline import TextPipeline


class StreamTransport(Protocol):
    """What a stream asks of its engine client; the client answers with on_chunk/on_done/on_error."""

    def send_unit(self, sid: int, index: int, payload: proto.UnitPayload) -> None: ...

    def end_input(self, sid: int) -> None: ...

    def cancel(self, sid: int) -> None:
        """Stop the stream's synthesis and forget it: later chunks are dropped."""

    def credit(self, sid: int, chunks: int) -> None:
        """The stream's reader took `chunks` chunks: the engine may make that many more."""


@dataclass
class StreamChunk(AudioChunk):
    """An engine's chunk as its stream hands it out: `unit_index` is the unit's
    place in the stream, and it carries when the unit went out and how long its step took."""

    # When the unit was sent to the worker (time.perf_counter).
    unit_sent_at: float = 0.0
    synth_s: float = 0.0
    # When the worker began the step that made this chunk (time.monotonic, which
    # is the same clock in both processes).
    synth_started_at: float = 0.0
    # When the chunk reached this process (time.perf_counter); a reader may take it much later,
    # when the utterance waited for its listener or for the ones before it.
    received_at: float = 0.0


class TTSStream:
    """Text in piece by piece, audio out as an async iterator."""

    def __init__(self, transport: StreamTransport, sid: int, *, options: SynthesisOptions, pipeline: TextPipeline) -> None:
        self.transport = transport
        self.sid = sid
        self.options = options
        self.pipeline = pipeline
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

    # Text in
    def push_text(self, text: str) -> None:
        if self._input_ended or self._closed:
            raise RuntimeError("push_text after end_input or cancel")
        if not text:
            return
        now = time.perf_counter()
        if self.first_text_at is None:
            self.first_text_at = now
            timeout = self.pipeline.first_unit_timeout
            if timeout > 0:
                self._first_timer = asyncio.get_running_loop().call_later(timeout, self._first_timeout)
        self._send_units(self.pipeline.push(text))

    def flush(self) -> None:
        """End of a segment: whatever text is pending is spoken now."""
        self._send_units(self.pipeline.end())

    def end_input(self) -> None:
        if self._input_ended or self._closed:
            return
        self.flush()
        self._input_ended = True
        if self._first_timer:
            self._first_timer.cancel()
        self.transport.end_input(self.sid)

    def cancel(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._first_timer:
            self._first_timer.cancel()
        self.transport.cancel(self.sid)
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    def _first_timeout(self) -> None:
        if not self._closed and not self.pipeline.started:
            self._send_units(self.pipeline.flush_first())

    def _send_units(self, payloads: list[proto.UnitPayload]) -> None:
        for payload in payloads:
            index = self._unit_index
            self._unit_index += 1
            sent = time.perf_counter()
            if self.first_unit_sent_at is None:
                self.first_unit_sent_at = sent
            self._units[index] = sent
            self.transport.send_unit(self.sid, index, payload)

    # Audio out: the transport calls these
    def on_chunk(self, msg: proto.Chunk, pcm: np.ndarray | None) -> None:
        chunk = StreamChunk(
            pcm=pcm if pcm is not None else np.zeros(0, dtype=np.int16),
            sample_rate=msg.sample_rate,
            text=self._joined_text(msg.text, msg.unit_index),
            words=list(msg.words),
            unit_index=msg.unit_index,
            unit_end=msg.unit_end,
            unit_sent_at=self._units.get(msg.unit_index, 0.0),
            synth_s=msg.synth_s,
            synth_started_at=msg.synth_started_at,
            received_at=time.perf_counter(),
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

    def on_done(self) -> None:
        self._queue.put_nowait(None)

    def on_error(self, error: Exception) -> None:
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
        # Consumed: the engine may make one more.
        self.transport.credit(self.sid, 1)
        return item

    async def aclose(self) -> None:
        self.cancel()
