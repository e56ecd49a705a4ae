"""Text on its way to the engine streams: in arrival order, a slice at a time, one slice per turn of the event loop.

A session may receive a large message (up to the per-message limit) or many
small ones at once. Handing all of it to the segmenter in one go would hold
the event loop, and every session's pacer with it; the pump hands over one
slice and yields, so other sessions' frames go out between slices.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

# Text reaches the segmenter in slices of this many characters, one slice per
# turn of the event loop, so one large message never holds the loop for long:
# the pacers of every session get their turn between slices.
TEXT_SLICE_CHARS = 256


class TextSink(Protocol):
    """The side of an engine stream that takes text (`TTSStream`)."""

    def push_text(self, text: str) -> None: ...
    def end_input(self) -> None: ...


class TextPump:
    """One session's queue of text for its engine streams; None as text ends a stream's input."""

    def __init__(self) -> None:
        self._queue: deque[tuple[TextSink, str | None]] = deque()
        self._handle: asyncio.Handle | None = None

    def push(self, stream: TextSink, text: str | None) -> None:
        self._queue.append((stream, text))
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_soon(self._pump)

    def clear(self) -> None:
        """Drop whatever has not reached its stream yet (a cancel, or the session closing)."""
        self._queue.clear()

    def _pump(self) -> None:
        """Hand one slice of queued text to its engine stream, then yield the loop."""
        self._handle = None
        if not self._queue:
            return
        stream, text = self._queue.popleft()
        try:
            if text is None:
                stream.end_input()
            else:
                if len(text) > TEXT_SLICE_CHARS:
                    self._queue.appendleft((stream, text[TEXT_SLICE_CHARS:]))
                    text = text[:TEXT_SLICE_CHARS]
                stream.push_text(text)
        except RuntimeError:
            pass  # the stream was cancelled or failed meanwhile: its text is dropped
        if self._queue:
            self._handle = asyncio.get_running_loop().call_soon(self._pump)
