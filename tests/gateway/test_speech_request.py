"""A speech request's engine failures reach the speech routes as the one error type they map."""

from __future__ import annotations

import pytest

from voxgate.engine.base import SynthesisOptions
from voxgate.engine.errors import ENGINE_ERROR_TEXT, EngineCrashed, EngineStreamError, EngineUnavailable
from voxgate.gateway.errors import GatewayError
from voxgate.gateway.peerless.speech_request import SpeechStream, open_speech


class FailingStream:
    """A stream whose next chunk is the engine's failure, as TTSStream raises it."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def __anext__(self):
        raise self.error


class RestartingEngine:
    def stream(self, options: SynthesisOptions):
        raise EngineUnavailable("the engine is restarting")


@pytest.mark.parametrize("error, code, status, message", [
    (EngineStreamError("onnxruntime: /opt/model.onnx: bad input"), "engine_error", 400, ENGINE_ERROR_TEXT),
    (EngineCrashed("the engine worker died"), "engine_unavailable", 503, "the engine worker died"),
    (EngineUnavailable("the engine is restarting"), "engine_unavailable", 503, "the engine is restarting"),
])
async def test_a_failed_chunk_is_a_gateway_error_without_the_engines_words(error, code, status, message):
    with pytest.raises(GatewayError) as raised:
        await SpeechStream(FailingStream(error)).__anext__()  # type: ignore[arg-type]
    assert (raised.value.code, raised.value.status, raised.value.message) == (code, status, message)


def test_a_stream_that_cannot_open_is_a_503():
    with pytest.raises(GatewayError) as raised:
        open_speech(RestartingEngine(), SynthesisOptions())
    assert (raised.value.code, raised.value.status) == ("engine_unavailable", 503)
