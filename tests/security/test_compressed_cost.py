"""Issue 53, finding 7: a compressed format costs its price against the speech slots.

Before, every speech request took one slot whatever its format, though 300 s of audio cost 5.7 s of
CPU as aac and 0.07 s as wav; four aac encodes at once took 187 % CPU on two cores and made 4-5 % of
every session's frames late. Now a compressed request (mp3, aac, opus) takes COMPRESSED_SLOTS of the
slots and of the budget, and the compressed encodes share one thread, so together they take at most
one core. bench/bench_aac_encodes.py measures the late frames.
"""

from __future__ import annotations

from tests.conftest import in_process_gateway
from voxgate.gateway.peerless.http_audio import slots_of, threads_of

from sec_helpers import http_json


async def speak(url: str, key: str, fmt: str) -> tuple[int, dict | None]:
    status, body, _ = await http_json("POST", url + "/v1/audio/speech", headers={"X-API-Key": key},
                                      body={"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": fmt})
    return status, body


async def test_an_aac_request_takes_more_of_the_speech_slots_than_a_wav_one():
    assert slots_of("aac") > slots_of("wav") and slots_of("mp3") > slots_of("pcm")
    assert threads_of("aac") is threads_of("mp3") is not threads_of("wav")
    async with in_process_gateway(api_key=["a1", "a2", "victim"], tts_max_concurrent=4) as (app, url):
        admission = app["gateway"].admission
        # Two aac requests in flight (their slots as serve_speech takes them) fill the four slots.
        held = [admission.speech_slot(key, slots_of("aac")) for key in ("a1", "a2")]
        status, body = await speak(url, "victim", "wav")
        assert (status, body["error"]["reason"]) == (503, "tts_concurrency"), body
        held.pop().release()
        # Two slots left: a wav request fits, an aac one too, and each is served.
        assert (await speak(url, "victim", "wav"))[0] == 200
        assert (await speak(url, "victim", "aac"))[0] == 200
        held.pop().release()
        assert app["gateway"].tts_active == 0
