"""The TTS WebSocket's contexts (`GET /v1/tts/ws`): one connection's utterances, each a
gateway/peerless/peerless_speech.py `PeerlessUtterance` (the model `POST /v1/tts` uses too), opened by
its first text. What a connection may hold is bounded here: contexts at once
(--tts-ws-max-contexts), text per context (--max-utterance-chars), how long one may sit idle
holding its slot (--tts-ws-context-idle-s); its audio is formatted by gateway/peerless/http_audio.py.

`SpeechContexts` hands out typed events (`ContextAudio`, `ContextDone`, `ContextCancelled`,
`ContextError`) through a `ContextSink`; signaling/tts_ws.py parses the client's messages,
calls in, and writes the events as JSON frames (docs/tts-websocket.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from ...config import Settings
from ...engine.base import SynthesisOptions
from ...engine.stream import StreamChunk
from ..load.admission import Admission
from ..errors import GatewayError, checked_voice
from .http_audio import FORMAT_THREADS, OpusPackets, Pcm16Pieces
from .peerless_speech import PeerlessUtterance, open_utterance

log = logging.getLogger(__name__)

# How a context's audio leaves: PCM16 at a rate, or raw Opus packets (decoded at OPUS_RATE).
CONTEXT_FORMATS = ("pcm16", "opus")
OPUS_RATE = 48000  # what a receiver decodes the packets at (http_audio.OpusPackets)
# Ids of ended contexts remembered, so late text for one is refused rather than opening it anew.
MAX_CLOSED_IDS = 256
# How a remembered context ended. After an error about it (it failed, or was refused as it opened),
# its error was its last word: what the client still sends for it is ignored, not answered with
# more errors (a client streaming tokens sends them before it reads the error). One refused for
# want of room may be opened again by a later `text` (a retry); its flush and end are ignored.
ENDED, FAILED, REFUSED = "ended", "failed", "refused"


@dataclass(frozen=True)
class WordTiming:
    word: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class ContextOutput:
    """How a connection's contexts speak: `fmt` one of CONTEXT_FORMATS; `rate` pcm16's rate (None:
    the engine's); `words` whether word timings go with the audio."""

    fmt: str
    rate: int | None
    words: bool


@dataclass
class ContextAudio:
    context: Context
    seq: int
    data: bytes
    start_ms: float
    duration_ms: float
    words: list[WordTiming]


@dataclass
class ContextDone:
    context: Context
    duration_ms: float


@dataclass
class ContextCancelled:
    context_id: str


@dataclass
class ContextError:
    code: str
    message: str
    context_id: str | None = None


class ContextSink(Protocol):
    """Where a connection's events go, in order (signaling/tts_ws.py's writer)."""

    async def send(self, event: ContextAudio | ContextDone) -> None:
        """Audio or done: waits while the reader is behind, so synthesis is paced by it."""

    def send_now(self, event: ContextCancelled | ContextError) -> None:
        """A control event: never waits."""


@dataclass
class Context:
    """One context: its id and utterance, and where its audio is on its own clock."""

    id: str
    utterance: PeerlessUtterance
    chars: int = 0
    seq: int = 0
    out_ms: float = 0.0  # audio sent so far, on this context's clock
    engine_s: float = 0.0  # engine audio received so far (words are placed on it)
    cancelled: bool = False  # stopped by a cancel, an error or the connection's end: none of its queued audio is sent
    failed: bool = False  # ended by an error about it
    ended: bool = False  # `end` received
    task: asyncio.Task | None = None
    # Last new text or audio made (monotonic): a context quiet for --tts-ws-context-idle-s ends.
    active_at: float = field(default_factory=time.monotonic)


class SpeechContexts:
    """One connection's contexts (`GET /v1/tts/ws`): each an utterance of `caller`'s, bounded by
    --tts-ws-max-contexts at once, --max-utterance-chars of text each and --tts-ws-context-idle-s
    without new text or audio; its events go to `sink`."""

    def __init__(self, engine, admission: Admission, settings: Settings, caller: str, voice: str | None,
                 output: ContextOutput, sink: ContextSink) -> None:
        self.engine = engine
        self.admission = admission
        self.settings = settings
        self.caller = caller
        self.voice = voice
        self.output = output
        self.sink = sink
        self.contexts: dict[str, Context] = {}
        self.closed_ids: OrderedDict[str, str] = OrderedDict()  # id -> ENDED, FAILED or REFUSED

    @property
    def sample_rate(self) -> int:
        if self.output.fmt == "opus":
            return OPUS_RATE
        return self.output.rate or int(self.engine.info.get("sample_rate") or 16000)

    # The client's requests; each raises GatewayError (naming the context) for a client's mistake.
    def text(self, cid: str, text: str, voice: object) -> None:
        """More text for context `cid`, opening it (in `voice`, if given) when it is not open."""
        ctx = self.contexts.get(cid)
        if ctx is None and self.closed_ids.get(cid) == FAILED:
            return  # its error was its last word
        if ctx is None:
            ctx = self._open(cid, voice)
        elif voice is not None:
            raise GatewayError("invalid_field", "'voice' applies to a context's first text only", id=cid)
        if ctx.ended:
            raise GatewayError("context_ended", f"context {cid!r} has had its 'end'; open a new context", id=cid)
        ctx.chars += len(text)
        if text.strip():
            ctx.active_at = time.monotonic()
        if ctx.chars > self.settings.max_utterance_chars:
            self.fail(ctx, "text_too_long", f"the context's text is over {self.settings.max_utterance_chars} characters; it was stopped")
            return
        ctx.utterance.push_text(text)

    def flush(self, cid: str) -> None:
        ctx = self._ongoing(cid)
        if ctx is not None:
            ctx.utterance.flush()

    def end(self, cid: str) -> None:
        ctx = self._ongoing(cid)
        if ctx is not None:
            ctx.ended = True
            ctx.utterance.end_input()

    def cancel(self, cid: str) -> None:
        ctx = self.contexts.get(cid)
        if ctx is not None:
            self._stop(ctx)
            self.sink.send_now(ContextCancelled(ctx.id))
        elif cid in self.closed_ids:
            self.sink.send_now(ContextCancelled(cid))  # it ended already: nothing more comes
        else:
            raise GatewayError("unknown_context", f"no context {cid!r} on this connection", id=cid)

    def close(self) -> None:
        """The connection ended: every context stops."""
        for ctx in list(self.contexts.values()):
            self._stop(ctx)

    def fail(self, ctx: Context, code: str, message: str) -> None:
        """End `ctx` with an error about it, its last word."""
        ctx.failed = True
        self._stop(ctx)
        self.sink.send_now(ContextError(code, message, ctx.id))

    # Opening and ending
    def _ongoing(self, cid: str) -> Context | None:
        """The open context `cid` for a flush or an end: None when there is nothing left to do."""
        ctx = self.contexts.get(cid)
        if ctx is None:
            gone = self.closed_ids.get(cid)
            if gone in (FAILED, REFUSED):
                return None  # its error was its last word
            if gone == ENDED:
                raise GatewayError("context_closed", f"context {cid!r} has ended", id=cid)
            raise GatewayError("unknown_context", f"no context {cid!r} on this connection; a 'text' opens one", id=cid)
        return None if ctx.ended else ctx  # a repeated end or a flush after it: nothing left to do

    def _open(self, cid: str, voice: object) -> Context:
        if self.closed_ids.get(cid) == ENDED:
            raise GatewayError("context_closed", f"context {cid!r} has ended; open a new context with another id", id=cid)
        self.closed_ids.pop(cid, None)  # refused before: this is a retry
        try:
            return self._admit(cid, voice)
        except GatewayError as exc:
            exc.id = cid  # every error about a context names it
            # No room now (429, 503): a later `text` may try again. A mistake in the message
            # that opened it (an unknown voice): the context is over.
            self._remember(cid, REFUSED if exc.status in (429, 503) else FAILED)
            raise

    def _admit(self, cid: str, voice: object) -> Context:
        limit = self.settings.tts_ws_max_contexts
        if len(self.contexts) >= limit:
            raise GatewayError("too_many_contexts", f"this connection has {limit} open contexts; end or cancel one first", 429)
        if voice is not None and not isinstance(voice, str):
            raise GatewayError("invalid_field", "'voice' must be a string", id=cid)
        voice = checked_voice(self.engine, voice) if voice is not None else self.voice
        utterance = open_utterance(self.engine, self.admission, self.caller, SynthesisOptions(voice=voice),
                                   self.settings.tts_max_audio_s, "tts ws")
        ctx = Context(cid, utterance)
        self.contexts[cid] = ctx
        ctx.task = asyncio.ensure_future(self._speak(ctx))
        self._watch_idle(ctx)
        return ctx

    def _remember(self, cid: str, how: str) -> None:
        self.closed_ids[cid] = how
        self.closed_ids.move_to_end(cid)
        while len(self.closed_ids) > MAX_CLOSED_IDS:
            self.closed_ids.popitem(last=False)

    def _watch_idle(self, ctx: Context) -> None:
        """End `ctx` once it has had no new text and made no audio for --tts-ws-context-idle-s:
        an open context holds a speech slot, and one word with a `flush` every few seconds
        held all of them at no cost (issue 53, finding 6)."""
        idle = self.settings.tts_ws_context_idle_s

        def check() -> None:
            if self.contexts.get(ctx.id) is not ctx:
                return
            quiet = time.monotonic() - ctx.active_at
            if quiet >= idle:
                self.fail(ctx, "context_idle", f"no new text and no audio for {idle:g} s; the context ended and "
                          "gave up its slot (open a new one to speak again)")
            else:
                asyncio.get_running_loop().call_later(idle - quiet, check)

        asyncio.get_running_loop().call_later(idle, check)

    def _forget(self, ctx: Context) -> None:
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
            self._remember(ctx.id, FAILED if ctx.failed else ENDED)
        ctx.utterance.cancel()

    def _stop(self, ctx: Context) -> None:
        # Marked first: the sink drops what of it is queued, and the task stops at its next await.
        ctx.cancelled = True
        self._forget(ctx)
        if ctx.task is not None:
            ctx.task.cancel()

    # Speaking
    async def _speak(self, ctx: Context) -> None:
        loop = asyncio.get_running_loop()
        pieces: OpusPackets | Pcm16Pieces | None = None
        words: list[WordTiming] = []  # words not yet sent with audio
        try:
            async for chunk, pcm in ctx.utterance.chunks():
                if pieces is None:
                    if self.output.fmt == "opus":
                        pieces = await loop.run_in_executor(FORMAT_THREADS, OpusPackets, chunk.sample_rate)
                    else:
                        pieces = await loop.run_in_executor(FORMAT_THREADS, Pcm16Pieces, chunk.sample_rate, self.sample_rate)
                if self.output.words:
                    words += self._words(ctx, chunk, len(pcm))
                ctx.engine_s += len(pcm) / chunk.sample_rate
                words = await self._send_audio(ctx, await loop.run_in_executor(FORMAT_THREADS, pieces.feed, pcm), words)
                ctx.active_at = time.monotonic()
            if pieces is not None:
                words = await self._send_audio(ctx, await loop.run_in_executor(FORMAT_THREADS, pieces.finish), words)
            if words:
                await self._send_audio(ctx, [b""], words)
            await self.sink.send(ContextDone(ctx, round(ctx.out_ms, 1)))
        except asyncio.CancelledError:
            return
        except GatewayError as exc:  # the engine failed (gateway/peerless/speech_request.py)
            log.warning("tts ws: engine failed mid-context: %s", exc.message)
            ctx.failed = True
            self.sink.send_now(ContextError(exc.code, exc.message, ctx.id))
        except Exception as exc:  # a bug costs this context, not the connection
            log.exception("tts ws: context failed")
            ctx.failed = True
            self.sink.send_now(ContextError("internal", f"internal error: {type(exc).__name__}", ctx.id))
        finally:
            self._forget(ctx)

    @staticmethod
    def _words(ctx: Context, chunk: StreamChunk, taken: int) -> list[WordTiming]:
        """The chunk's words within its first `taken` samples, on the context's clock."""
        words = []
        rate = chunk.sample_rate
        for w in chunk.words:
            if w.start * rate >= taken:
                break
            words.append(WordTiming(w.text, round((ctx.engine_s + w.start) * 1000.0, 1),
                                    round((ctx.engine_s + min(w.end, taken / rate)) * 1000.0, 1)))
        return words

    async def _send_audio(self, ctx: Context, pieces: list[bytes], words: list[WordTiming]) -> list[WordTiming]:
        """One audio event per piece; the words so far go with the first. Returns the words left unsent."""
        bytes_per_ms = 2 * self.sample_rate / 1000.0
        for data in pieces:
            duration = 20.0 if self.output.fmt == "opus" and data else len(data) / bytes_per_ms
            event = ContextAudio(ctx, ctx.seq, data, round(ctx.out_ms, 1), round(duration, 1), words)
            words = []
            ctx.seq += 1
            ctx.out_ms += duration
            await self.sink.send(event)
        return words
