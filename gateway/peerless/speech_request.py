"""A speech request's engine stream, as the gateway hands it to the speech routes
(`POST /v1/tts`, `POST /v1/audio/speech`, the TTS WebSocket in signaling/): opened and
read like the engine's TTSStream, with every engine failure turned into the one error
type routes map, GatewayError: `engine_error` for text or options the engine refused,
`engine_unavailable` (503) for a worker that is restarting or died; in the words
public_engine_error gives clients, never the engine's own."""

from __future__ import annotations

from ...engine.base import SynthesisOptions
from ...engine.errors import EngineCrashed, EngineStreamError, EngineUnavailable, public_engine_error
from ...engine.stream import StreamChunk, TTSStream
from ..errors import GatewayError

ENGINE_FAILURES = (EngineStreamError, EngineCrashed, EngineUnavailable)


def engine_failure(exc: Exception) -> GatewayError:
    """What a route answers for an engine failure."""
    if isinstance(exc, EngineStreamError):
        return GatewayError("engine_error", public_engine_error(exc))
    return GatewayError("engine_unavailable", public_engine_error(exc), 503)


class SpeechStream:
    """One speech request's text in, its chunks out (engine/stream.py's TTSStream)."""

    def __init__(self, stream: TTSStream) -> None:
        self._stream = stream

    def push_text(self, text: str) -> None:
        self._stream.push_text(text)

    def flush(self) -> None:
        self._stream.flush()

    def end_input(self) -> None:
        self._stream.end_input()

    def cancel(self) -> None:
        self._stream.cancel()

    def __aiter__(self) -> SpeechStream:
        return self

    async def __anext__(self) -> StreamChunk:
        try:
            return await self._stream.__anext__()
        except ENGINE_FAILURES as exc:
            raise engine_failure(exc) from None


def open_speech(engine, options: SynthesisOptions) -> SpeechStream:
    """A new stream on `engine` (the gateway's EngineClient); GatewayError when it cannot open."""
    try:
        return SpeechStream(engine.stream(options))
    except ENGINE_FAILURES as exc:
        raise engine_failure(exc) from None
