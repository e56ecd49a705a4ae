"""Finding 3: clients choose among the server's voice names; they never name a file.

Before: `session.update`, Twilio's `customParameters.voice`, `/v1/offer`,
`POST /v1/tts` and `POST /v1/sessions` all took any string ending in `.onnx`,
and the Piper worker loaded and cached each distinct path for ever (the
embedded model under `/./` and `//` variants took it from 251 to 1018 MB).
"""

from __future__ import annotations

import json
import os

import aiohttp
import pytest

from voxgate.engine.base import EngineError, SynthesisOptions
from voxgate.engine.piper.piper_engine import PiperEngine, embedded_voice_path
from voxgate.rtc_client import OfferRefused, RtcClient

from sec_helpers import http_json

A_PATH = "/tmp/../tmp/voice.onnx"


def embedded_path_variants() -> list[str]:
    path = str(embedded_voice_path())
    head, tail = os.path.split(path)
    return [f"{head}/./{tail}", f"{head}//{tail}", f".//{path}"]


async def test_tts_refuses_a_path_for_voice_on_the_piper_worker(piper_server):
    for variant in embedded_path_variants():
        status, body, _ = await http_json("POST", piper_server.url + "/v1/tts", body={"text": "Hi.", "voice": variant})
        assert status == 400 and body["error"]["code"] == "unknown_voice", (variant, status, body)
        assert variant not in body["error"]["message"] or len(variant) <= 80
    status, body, _ = await http_json("POST", piper_server.url + "/v1/tts", body={"text": "Hi.", "voice": "joe"})
    assert status == 200


async def test_every_way_to_ask_for_a_voice_takes_names_only(tone_server):
    url = tone_server.url
    status, body, _ = await http_json("POST", url + "/v1/tts", body={"text": "Hi.", "voice": A_PATH})
    assert (status, body["error"]["code"]) == (400, "unknown_voice")
    assert "tone" in body["error"]["message"]  # it says which names there are

    status, body, _ = await http_json("POST", url + "/v1/sessions", body={"voice": A_PATH})
    assert (status, body["error"]["code"]) == (400, "unknown_voice")

    with pytest.raises(OfferRefused) as refused:
        await RtcClient(url, voice=A_PATH).connect()
    assert refused.value.status == 400 and refused.value.code == "unknown_voice"

    async with RtcClient(url) as client:
        client.send({"type": "session.update", "voice": A_PATH})
        event = await client.wait_for_any(("error", "session.updated"))
        assert event["type"] == "error" and event["code"] == "unknown_voice", event
        client.send({"type": "session.update", "voice": "tone"})
        assert (await client.wait_for("session.updated"))["voice"] == "tone"

    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url.replace("http", "ws") + "/v1/telephony/twilio") as ws:
            await ws.send_str(json.dumps({"event": "start", "streamSid": "MZ1", "start": {
                "streamSid": "MZ1", "callSid": "CA1", "customParameters": {"voice": A_PATH}}}))
            reply = json.loads((await ws.receive(timeout=20)).data)
            assert reply["event"] == "error" and reply["code"] == "unknown_voice", reply


def _voice_dir(tmp_path, names):
    model = embedded_voice_path()
    for name in names:
        os.symlink(model, tmp_path / f"{name}.onnx")
        os.symlink(str(model) + ".json", tmp_path / f"{name}.onnx.json")
    return str(tmp_path)


def test_the_worker_resolves_catalog_names_only_and_bounds_its_cache(tmp_path):
    # Whole units in float32: names and the cache are what this checks, not the graph's fast paths
    # (each load takes 1.9 s instead of 3.4).
    engine = PiperEngine(voice_dir=_voice_dir(tmp_path, ["amy", "bea", "cy"]), device="cpu", threads=1, max_loaded_voices=2,
                         split=False, prior_precision="float32")
    assert engine.voices() == ["joe", "amy", "bea", "cy"]
    for path in [str(tmp_path / "amy.onnx"), str(embedded_voice_path()), *embedded_path_variants()]:
        with pytest.raises(EngineError):
            engine.resolve_voice(path)
    engine.load()
    # Room for one voice beside the default: bea's load puts amy out, and amy comes back on demand.
    for name in ("amy", "bea", "amy"):
        assert sum(len(c.pcm) for c in engine.synthesize("Hi.", SynthesisOptions(voice=name))) > 0
        assert len(engine._voices) <= 2 and "joe" in engine._voices  # the default stays loaded


def test_operator_paths_name_voices_by_file(tmp_path):
    _voice_dir(tmp_path, ["lessac"])
    engine = PiperEngine(voice=str(tmp_path / "lessac.onnx"))
    assert engine.default_voice == "lessac" and engine.voices()[0] == "lessac"
    with pytest.raises(EngineError):
        PiperEngine(voice="no-such-voice")
