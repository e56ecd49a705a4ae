"""Speech with no WebRTC peer: one utterance and cancel model for `POST /v1/tts`,
`POST /v1/audio/speech` and each context of `GET /v1/tts/ws` (gateway/peerless/speech_contexts.py).

A `PeerlessUtterance` is one such utterance: its engine stream (gateway/peerless/speech_request.py),
the admission slot it holds while it lives (gateway/load/admission.py), its audio cap
(--tts-max-audio-s), and one cancel that ends the stream and frees the slot, harmless a second
time. An HTTP request is one utterance whose text all arrives at once, cancelled when its
response ends or its client goes; `HttpSpeech` is that utterance with its audio as the
response's bytes (gateway/peerless/http_audio.py formats, prices and paces them). signaling/tts_http.py
parses, authenticates and writes what this gives it.

A session's utterances (gateway/sessions/session.py) have a peer, a playout and barge-in; these have
none of them, only the stream, the slot, the cap and the cancel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable

import numpy as np

from ...engine.base import SynthesisOptions
from ...engine.stream import StreamChunk
from ..load.admission import Admission, SpeechSlot
from ..errors import GatewayError
from .http_audio import FORMAT_FAMILIES, EncodedFormatter, FormatRun, Formatter, slots_of
from ..load.late_blame import LateBlame
from .speech_request import SpeechStream, open_speech
from ..sessions.text_pump import TEXT_SLICE_CHARS

log = logging.getLogger(__name__)


def format_names(family: str) -> tuple[str, ...]:
    """The formats a speech route serves: `family` "tts" (POST /v1/tts) or "openai" (POST /v1/audio/speech)."""
    return tuple(FORMAT_FAMILIES[family])


class Timeline:
    """When an utterance's audio was made and sent, on the monotonic clock the engine worker
    shares; logged once per HTTP request so an operator (and the streaming test) can see that
    bytes left while synthesis was still running."""

    def __init__(self) -> None:
        self.received_at = time.monotonic()
        self.first_bytes_at: float | None = None
        self.units: dict[int, float] = {}  # unit index -> when its synthesis began

    def chunk(self, chunk: StreamChunk) -> None:
        started = self.units.get(chunk.unit_index)
        if chunk.synth_started_at and (started is None or chunk.synth_started_at < started):
            self.units[chunk.unit_index] = chunk.synth_started_at

    def log(self, fmt: str, chars: int) -> None:
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - self.received_at) * 1000.0, 1)

        last_unit = self.units[max(self.units)] if self.units else None
        fields = {
            "format": fmt,
            "chars": chars,
            "units": len(self.units),
            "first_bytes_ms": ms(self.first_bytes_at),
            "last_unit_synthesis_started_ms": ms(last_unit),
            "done_ms": ms(time.monotonic()),
        }
        log.info(
            "tts request: %d units, first bytes sent at %s ms, last unit's synthesis started at %s ms",
            fields["units"], fields["first_bytes_ms"], fields["last_unit_synthesis_started_ms"],
            extra={"fields": fields},
        )


class PeerlessUtterance:
    """One utterance with no peer: text in, the engine's PCM out up to its audio cap, and one
    cancel that ends its stream and frees its slot (`open_utterance` makes one)."""

    def __init__(self, stream: SpeechStream, slot: SpeechSlot, max_audio_s: float, label: str) -> None:
        self._stream = stream
        self._slot = slot
        self.max_audio_s = max_audio_s
        self.label = label  # who it is in the log: "tts", "tts ws"
        self.timeline = Timeline()
        self.samples = 0  # engine samples taken (the audio cap)
        self.sample_rate: int | None = None  # the engine's, once its first chunk came

    # Text in
    def push_text(self, text: str) -> None:
        """Text for the engine, in slices of TEXT_SLICE_CHARS (the engine takes one at a time)."""
        for start in range(0, len(text), TEXT_SLICE_CHARS):
            self._stream.push_text(text[start : start + TEXT_SLICE_CHARS])

    async def push_all(self, text: str) -> None:
        """A whole text, a slice per turn of the event loop, so a long text never holds it."""
        for start in range(0, len(text), TEXT_SLICE_CHARS):
            self._stream.push_text(text[start : start + TEXT_SLICE_CHARS])
            await asyncio.sleep(0)

    def flush(self) -> None:
        self._stream.flush()

    def end_input(self) -> None:
        self._stream.end_input()

    # Audio out
    async def first(self) -> StreamChunk | None:
        """The first chunk, or None if the text made no audio; GatewayError if the engine failed.
        Its PCM is not capped: `take` it."""
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            return None
        self.timeline.chunk(chunk)
        return chunk

    def take(self, chunk: StreamChunk) -> np.ndarray:
        """`chunk`'s PCM within the audio cap (counted from the first chunk's rate)."""
        self._rate_of(chunk)
        pcm = chunk.pcm[: max(0, self.max_samples - self.samples)]
        self.samples += len(pcm)
        return pcm

    def _rate_of(self, chunk: StreamChunk) -> None:
        if self.sample_rate is None:
            self.sample_rate = chunk.sample_rate

    @property
    def max_samples(self) -> int:
        return int(self.max_audio_s * (self.sample_rate or 0))

    @property
    def audio_s(self) -> float:
        return self.samples / self.sample_rate if self.sample_rate else 0.0

    async def chunks(self) -> AsyncIterator[tuple[StreamChunk, np.ndarray]]:
        """Each chunk after those already taken, with its PCM within the cap; ends at the cap
        (the rest is not synthesized). GatewayError when the engine fails."""
        async for chunk in self._stream:
            self.timeline.chunk(chunk)
            self._rate_of(chunk)
            if self.samples >= self.max_samples:
                log.info("%s: an utterance reached --tts-max-audio-s (%g s); the rest is not synthesized",
                         self.label, self.max_audio_s)
                return
            yield chunk, self.take(chunk)

    # Cancel
    def cancel(self) -> None:
        """Stop synthesis and free the slot: when it ends, whether it was heard out, failed, or
        its client cancelled it or went away; harmless a second time."""
        self._slot.release()
        self._stream.cancel()


def open_utterance(engine, admission: Admission, caller: str, options: SynthesisOptions, max_audio_s: float,
                   label: str, slots: int = 1, tenant: str | None = None) -> PeerlessUtterance:
    """A new utterance for `caller`: admitted (`slots` of the speech slots, raising GatewayError when
    there is no room) and its stream opened on `engine` (the gateway's EngineClient)."""
    slot = admission.speech_slot(caller, slots, tenant)
    try:
        stream = open_speech(engine, options)
    except GatewayError:
        slot.release()
        raise
    return PeerlessUtterance(stream, slot, max_audio_s, label)


class HttpSpeech:
    """One HTTP speech request: its utterance, and its audio as the response's bytes in format `fmt`
    of `family` (`format_names`), each formatter call run, charged and paced by a FormatRun.
    `close` ends it all: synthesis, the slot, the formatter, the charges."""

    def __init__(self, utterance: PeerlessUtterance, family: str, fmt: str, run: FormatRun) -> None:
        self.utterance = utterance
        self.fmt = fmt
        self._make = FORMAT_FAMILIES[family][fmt]
        self._run = run
        self._formatter: Formatter | None = None
        self._first: StreamChunk | None = None

    async def begin(self, text: str, default_rate: int) -> None:
        """The whole text in, then the first chunk out and the formatter made at its rate (else at
        `default_rate`, when the text made no audio); GatewayError when the engine failed."""
        await self.utterance.push_all(text)
        self.utterance.end_input()
        self._first = await self.utterance.first()
        rate = self._first.sample_rate if self._first is not None else default_rate
        self._formatter = await self._run.run(self._make, rate)

    @property
    def formatter(self) -> Formatter:
        assert self._formatter is not None, "begin() first"
        return self._formatter

    @property
    def content_type(self) -> str:
        return self.formatter.content_type

    @property
    def sample_rate(self) -> int:
        """The response's rate (the formatter's, which may resample)."""
        return self.formatter.sample_rate

    async def head(self) -> bytes:
        """The format's header and the first chunk's audio."""
        data = await self._run.run(self.formatter.start)
        if self._first is not None:
            data += await self._run.run(self.formatter.feed, self.utterance.take(self._first))
        return data

    async def pieces(self) -> AsyncIterator[bytes]:
        """The rest of the audio, a piece per chunk, up to the cap; GatewayError when the engine fails."""
        async for _, pcm in self.utterance.chunks():
            yield await self._run.run(self.formatter.feed, pcm)

    async def finish(self) -> bytes:
        return await self._run.run(self.formatter.finish)

    def close(self) -> None:
        self.utterance.cancel()  # synthesis stops, the slot is free
        if isinstance(self._formatter, EncodedFormatter):
            self._formatter.close()
        self._run.forget()


def open_http_speech(engine, admission: Admission, caller: str, tenant: str, options: SynthesisOptions,
                     max_audio_s: float, family: str, fmt: str, shed: Callable[[str], None]) -> HttpSpeech:
    """A new HTTP speech request for `caller`, admitted at its format's price (`slots_of`) and charged
    to `tenant`; `shed` cuts it when its encodes are blamed for late frames. GatewayError when
    there is no room or the engine cannot open a stream."""
    utterance = open_utterance(engine, admission, caller, options, max_audio_s, "tts", slots_of(fmt), tenant)
    blame: LateBlame = admission.blame
    return HttpSpeech(utterance, family, fmt, FormatRun(fmt, blame, tenant, shed))
