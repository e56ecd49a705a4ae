"""A ConversationRelay application holds a phone conversation through Voxgate's Twilio bridge.

The Media Streams stand-in (tests/telephony/twilio_standin.py) joins a session made with
`POST /v1/sessions {"relay": ...}`: the greeting and the reply reach the phone as μ-law media,
the caller's turn reaches the application as a `prompt`, the phone's keys as `dtmf`, the
application's `sendDigits` goes back down the line as in-band DTMF tones (found again here by
Goertzel filters), and its `end` closes the call with handoffData in the maker's `session.closed`.
"""

from __future__ import annotations

import json
import re

import aiohttp
import numpy as np

from voxgate.client import VoxgateSession
from voxgate.gateway.media.encoder import ulaw_decode

from tests.conftest import in_process_gateway
from tests.listening_corpus import espeak
from tests.relay.relay_app import RelayApp, stt_standin
from tests.telephony.twilio_standin import TwilioStandIn


# The keypad's frequencies (ITU-T Q.23), written here rather than taken from gateway/phone/dtmf.py: a tone
# the module got wrong must not be found by a detector that shares its mistake.
ROWS = (697.0, 770.0, 852.0, 941.0)
COLUMNS = (1209.0, 1336.0, 1477.0, 1633.0)
KEYS = ("123A", "456B", "789C", "*0#D")
RATE, FRAME = 8000, 160


def heard_digits(frames: list[bytes]) -> str:
    """The DTMF keys in μ-law frames: per frame, the strongest row and column tone where both
    stand well above every other key frequency; a key counts once per run of at least three frames
    (60 ms: the tone engine's symbols, dual tones too, last 25 ms)."""
    freqs = ROWS + COLUMNS
    t = np.arange(FRAME) / RATE
    basis = np.array([np.exp(-2j * np.pi * f * t) for f in freqs]) * np.hanning(FRAME)  # less leakage
    per_frame = []
    for frame in frames:
        pcm = ulaw_decode(frame).astype(np.float64)
        power = np.abs(basis @ pcm) ** 2
        row, col = int(np.argmax(power[:4])), 4 + int(np.argmax(power[4:]))
        others = np.delete(power, [row, col])
        per_frame.append(KEYS[row][col - 4] if min(power[row], power[col]) > 10 * max(others.max(), 1e3) else "-")
    runs = re.findall(r"(([0-9*#A-D])\2{2,})", "".join(per_frame))
    return "".join(key for _, key in runs)


async def test_greeting_prompt_dtmf_both_ways_and_end_with_handoff_over_the_phone():
    stt, stt_url = await stt_standin(["when do you open"])
    handoff = {"reason": "transfer", "queue": "billing"}
    app = RelayApp([["The store", " opens at nine."]], end_on_digit="9", handoff=handoff)
    await app.start()
    try:
        async with in_process_gateway(stt_url=stt_url, relay_allow_private=True) as (_, url):
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/sessions", json={"relay": {
                        "url": app.url, "welcomeGreeting": "Hi.", "dtmfDetection": True}}) as resp:
                    assert resp.status == 201, await resp.text()
                    made = await resp.json()
            maker = VoxgateSession(url, session_id=made["session_id"], role="watcher")
            await maker.open()
            phone = TwilioStandIn(url, call_sid="CArelay0001")
            try:
                await phone.connect()
                await phone.start({"session_id": made["session_id"], "token": made["client_token"],
                                   "from": "+15550100", "to": "+15550199", "customer": "42"})
                greeting = await maker.wait_for("utterance.done", id="relay-greeting")
                turn = np.concatenate([np.zeros(1600, np.int16), espeak("When do you open?", "en-us+klatt", 8000),
                                       np.zeros(6400, np.int16)])
                await phone.send_audio(turn)
                reply = await maker.wait_for("utterance.done", id="r1")
                since = len(phone.received.media)
                for digit in "59":
                    await phone.send({"event": "dtmf", "streamSid": phone.stream_sid,
                                      "dtmf": {"track": "inbound_track", "digit": digit}})
                closed = await maker.wait_for("session.closed", timeout=20)
                tones = [m for _, m in phone.received.media[since:]]
            finally:
                await phone.close()
                await maker.close()
    finally:
        await app.stop()
        await stt.cleanup()
    assert app.invalid == []
    [setup] = app.of_type("setup")
    assert setup["callSid"] == "CArelay0001" and setup["callType"] == "PSTN"
    assert (setup["from"], setup["to"]) == ("+15550100", "+15550199")
    assert setup["customParameters"] == {"from": "+15550100", "to": "+15550199", "customer": "42"}  # never the token
    assert greeting["text"] == "Hi." and reply["text"] == "The store opens at nine." and reply["audio_ms"] > 0
    assert [p["voicePrompt"] for p in app.of_type("prompt")] == ["when do you open"]
    assert [d["digit"] for d in app.of_type("dtmf")] == ["5", "9"]
    assert app.of_type("error") == []  # sendDigits was taken
    assert heard_digits(tones) == "12#"
    assert closed["handoff_data"] == json.dumps(handoff)
