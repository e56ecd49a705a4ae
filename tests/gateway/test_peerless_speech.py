"""gateway/peerless/peerless_speech.py: one utterance with no peer (its stream, its admission slot, its audio
cap, one cancel), and an HTTP request's speech as response bytes, on the gateway's tone engine.
Over HTTP: tests/http/test_tts_http.py, test_openai_speech.py, tests/security/test_tts_limits.py."""

from __future__ import annotations

import asyncio

import pytest

from voxgate.engine.base import SynthesisOptions
from voxgate.engine.errors import EngineUnavailable
from voxgate.gateway.errors import GatewayError
from voxgate.gateway.peerless.peerless_speech import format_names, open_http_speech, open_utterance

pytestmark = pytest.mark.asyncio(loop_scope="module")
# `gw`: tests/gateway/conftest.py's tone-engine gateway, one for the module.
TEXT = "The train leaves every twenty minutes from the second platform."


def http_speech(gw, fmt: str = "wav", family: str = "tts", max_audio_s: float = 60.0, shed=None):
    return open_http_speech(gw.engine, gw.admission, "caller", "key:a", SynthesisOptions(), max_audio_s,
                            family, fmt, shed or (lambda why: None))


async def read_all(speech, text: str = TEXT) -> bytes:
    await speech.begin(text, 16000)
    data = await speech.head()
    async for piece in speech.pieces():
        data += piece
    return data + await speech.finish()


async def test_an_http_request_is_its_utterances_audio_formatted_and_close_frees_its_slot(gw):
    speech = http_speech(gw)
    assert gw.tts_active == 1
    try:
        data = await read_all(speech)
    finally:
        speech.close()
    assert gw.tts_active == 0
    rate = gw.engine.info["sample_rate"]
    assert (speech.content_type, speech.sample_rate) == ("audio/wav", rate)
    assert data[:4] == b"RIFF" and len(data) == 44 + 2 * speech.utterance.samples
    assert 1.0 < speech.utterance.audio_s < 10.0
    speech.close()  # a second close is harmless: the slot is not given back twice
    assert gw.tts_active == 0


async def test_the_audio_cap_ends_synthesis_at_its_sample(gw):
    speech = http_speech(gw, max_audio_s=0.5)
    try:
        await speech.begin(" ".join([TEXT] * 3), 16000)
        await speech.head()
        pieces = [piece async for piece in speech.pieces()]
    finally:
        speech.close()
    assert speech.utterance.samples == int(0.5 * speech.utterance.sample_rate)
    assert all(pieces), "the stream ends at the cap: no chunk is read past it"


async def test_a_compressed_format_takes_its_price_in_slots_and_each_family_has_its_formats(gw):
    assert "mulaw" in format_names("tts") and "mulaw" not in format_names("openai")
    assert {"mp3", "aac", "flac"} <= set(format_names("openai"))
    speech = http_speech(gw, "aac", "openai")
    try:
        assert gw.tts_active == 2
        data = await read_all(speech, "Hello.")
        assert speech.content_type == "audio/aac" and data[:1] == b"\xff"
    finally:
        speech.close()
    assert gw.tts_active == 0


async def test_cancel_mid_utterance_stops_it_and_an_engine_that_cannot_open_leaks_no_slot(gw):
    utterance = open_utterance(gw.engine, gw.admission, "caller", SynthesisOptions(), 60.0, "test")
    utterance.push_text(" ".join([TEXT] * 4))
    utterance.end_input()
    first = await utterance.first()
    assert first is not None
    utterance.cancel()
    assert gw.tts_active == 0
    # Cancelled: the stream ends (or raises) at once, without the rest of the text's audio.
    rest = 0
    try:
        async with asyncio.timeout(5.0):
            async for _, pcm in utterance.chunks():
                rest += len(pcm)
    except GatewayError:
        pass
    assert rest < first.sample_rate  # under a second of the text's several

    class Restarting:
        def stream(self, options):
            raise EngineUnavailable("the engine is restarting")

    with pytest.raises(GatewayError) as raised:
        open_utterance(Restarting(), gw.admission, "caller", SynthesisOptions(), 60.0, "test")
    assert (raised.value.code, gw.tts_active) == ("engine_unavailable", 0)
