"""Finding 14: `<prosody rate="nan">` is no rate, and clients get generic engine error text.

Before, "nan" passed the rate clamp (min/max leave NaN unchanged) and
onnxruntime's own error, with its source path, went back to the client.
"""

from __future__ import annotations

import math

import pytest

from voxgate.engine.errors import EngineStreamError
from voxgate.engine.text.tags import TagState, rate_factor

from sec_helpers import http_json


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "infinity", "nan%", "1e999"])
def test_rates_are_finite(value):
    factor = rate_factor(value)
    assert math.isfinite(factor) and 0.25 <= factor <= 4.0


def test_spans_never_carry_a_non_finite_rate():
    [piece] = TagState().pieces('<prosody rate="nan">Hello there.</prosody>')
    assert piece.rate == 1.0


def test_engine_internals_stay_in_the_log():
    from voxgate.engine.errors import ENGINE_ERROR_TEXT, public_engine_error

    exc = EngineStreamError("RuntimeError: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT : /opt/voxgate/lib/model.onnx")
    assert public_engine_error(exc) == ENGINE_ERROR_TEXT


async def test_nan_rate_speaks_on_the_real_voice(piper_server):
    status, body, headers = await http_json("POST", piper_server.url + "/v1/tts", body={
        "text": '<prosody rate="nan">Hello there.</prosody>', "format": "pcm"})
    assert status == 200, body
