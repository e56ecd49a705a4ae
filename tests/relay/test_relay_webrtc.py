"""A ConversationRelay application holds a conversation with a WebRTC caller through Voxgate.

A real aiortc caller joins a session made with `POST /v1/sessions {"relay": ...}`; Voxgate opens
the application's WebSocket (tests/relay/relay_app.py, written from the vendors' documentation)
and plays the vendor's part: the greeting, the caller's turn as a `prompt` (a stand-in recognizer
over --stt-url gives its words), the application's `text` tokens as speech, a barge-in whose
`interrupt` carries exactly what the caller heard, and `end` whose handoffData reaches the
session's maker in `session.closed`. Every message the application receives fits the schema.
"""

from __future__ import annotations

import json

import aiohttp
import numpy as np

from voxgate.client import VoxgateSession
from voxgate.rtc_client import RtcClient

from tests.conftest import in_process_gateway
from tests.listening_corpus import espeak
from tests.relay.relay_app import RelayApp, stt_standin

LONG = [w + " " for w in ("Our", "store", "opens", "at", "nine", "tomorrow", "and", "closes", "at", "six", "in", "the",
                          "evening", "every", "day", "of", "the", "week", "except", "on", "public", "holidays", "when",
                          "it", "opens", "at", "ten", "and", "closes", "at", "four.")]


def turn(phrase: str, rate: int) -> np.ndarray:
    """A caller's turn: a little silence, the phrase, and silence past the VAD's hangover."""
    return np.concatenate([np.zeros(int(0.2 * rate), np.int16), espeak(phrase, "en-us+klatt", rate),
                           np.zeros(int(0.8 * rate), np.int16)])


async def test_greeting_prompt_tokens_barge_in_and_end_with_handoff_over_webrtc():
    stt, stt_url = await stt_standin(["when do you open", "actually never mind"])
    handoff = {"reason": "done", "customer": "42"}
    app = RelayApp([LONG, ["Sure.", " Bye for now."]], handoff=handoff)
    await app.start()
    try:
        async with in_process_gateway(stt_url=stt_url, relay_allow_private=True) as (_, url):
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/sessions", json={"relay": {
                        "url": app.url, "welcomeGreeting": "Hello.", "customParameters": {"customer": "42"},
                        "authToken": "secret-token", "ttsProvider": "ElevenLabs"}}) as resp:
                    assert resp.status == 201, await resp.text()
                    made = await resp.json()
            maker = VoxgateSession(url, session_id=made["session_id"], role="watcher")
            await maker.open()
            caller = RtcClient(url, mic=True, session_id=made["session_id"], token=made["client_token"])
            try:
                await caller.connect()
                await app.wait(lambda: app.of_type("setup"))
                greeting = await caller.wait_for("utterance.done", id="relay-greeting")
                assert greeting["audio_ms"] > 0 and greeting["text"] == "Hello."
                # The caller asks; the application's tokens are spoken.
                caller.mic.play(turn("When do you open?", 48000))
                started = await caller.wait_for("utterance.started", timeout=20)
                await caller.wait_frames_after(started, 40)  # most of a second of the reply heard
                caller.mic.play(turn("Actually, never mind.", 48000))
                interrupted = await maker.wait_for("utterance.interrupted", id=started["id"], timeout=20)
                await app.wait(lambda: app.of_type("interrupt"))
                closed = await maker.wait_for("session.closed", timeout=20)
                last_reply = [e for e in maker.history if e["type"] == "utterance.done"][-1]
            finally:
                await caller.close()
                await maker.close()
    finally:
        await app.stop()
        await stt.cleanup()
    assert app.invalid == []
    [setup] = app.of_type("setup")
    assert setup["sessionId"] == "VX" + made["session_id"] and setup["customParameters"] == {"customer": "42"}
    assert setup["callType"] == "CLIENT" and setup["direction"] == "inbound"
    # Signed as Twilio signs: base64(HMAC-SHA1(auth token, URL)).
    from voxgate.signaling.twilio_stream import twilio_signature
    assert app.headers[0]["X-Twilio-Signature"] == twilio_signature("secret-token", app.url)
    prompts = app.of_type("prompt")
    assert [p["voicePrompt"] for p in prompts] == ["when do you open", "actually never mind"]
    assert all(p["last"] is True and p["lang"] == "en-US" for p in prompts)
    [interrupt] = app.of_type("interrupt")
    assert interrupt["utteranceUntilInterrupt"] == interrupted["played_text"] and interrupted["played_text"]
    assert interrupt["durationUntilInterruptMs"] == interrupted["played_ms"]
    assert interrupted["reason"] == "barge_in"
    # `end` came after the second reply, which played to its end first; its handoffData reached the maker.
    assert closed["handoff_data"] == json.dumps(handoff)
    assert last_reply["text"] == "Sure. Bye for now." and last_reply["audio_ms"] > 0
