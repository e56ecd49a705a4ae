"""`--stt-url`: caller turns recognized by an OpenAI-compatible /v1/audio/transcriptions server.

A stand-in server on loopback (an aiohttp app speaking OpenAI's API) runs
pocketsphinx on the WAV it is sent, answers 500, hangs past --stt-timeout-s,
or redirects elsewhere, turn by turn. Each failed turn gives exactly one
`error` and no transcript, and the session goes on speaking; every request
carries --stt-model and a 16 kHz mono WAV of the turn, and the API key goes
to that URL only (not to a redirect's target, not into events or the log).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from aiohttp import web

from voxgate.client import VoxgateSession
from voxgate.gateway.caller.stt_pocketsphinx import Pocketsphinx
from voxgate.rtc_client import RtcClient

from tests.conftest import free_port
from tests.conftest import in_process_gateway
from tests.speech import word_error_rate
from tests.transcripts import CLEAR_TURNS, turn_audio

KEY = "sk-standin-9f3a7c"
MODEL = "whisper-standin"
SHORT_TURN = ("Hello there.", "en-us+klatt2")


class StandIn:
    """An OpenAI-compatible transcription server: each request takes the next of `modes`."""

    def __init__(self, modes: list[str], redirect_to: str = "") -> None:
        self.modes = list(modes)
        self.redirect_to = redirect_to
        self.requests: list[dict] = []
        self.release = asyncio.Event()  # ends a hanging request
        # Its decoder in a worker process, loaded now (decoding in this process would stall the event loop).
        self.recognizer = Pocketsphinx(workers=1)
        self.thread = ThreadPoolExecutor(1)

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        upload = form["file"]
        assert isinstance(upload, web.FileField)
        with wave.open(io.BytesIO(upload.file.read())) as w:
            audio = (w.getnchannels(), w.getsampwidth(), w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2"))
        self.requests.append({"auth": request.headers.get("Authorization"), "model": form.get("model"), "wav": audio})
        mode = self.modes.pop(0)
        if mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if mode == "hang":
            await self.release.wait()
            return web.json_response({"text": "too late"})
        if mode == "redirect":
            raise web.HTTPTemporaryRedirect(self.redirect_to)
        text = await asyncio.get_running_loop().run_in_executor(self.thread, self.recognizer.recognize, audio[3])
        return web.json_response({"text": text})



async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def next_outcome(events) -> dict:
    """The next speech.transcript or error."""
    async for event in events:
        if event["type"] in ("speech.transcript", "error"):
            return event
    raise AssertionError("the session closed")


async def test_stt_url_turns_failures_timeouts_and_the_key(caplog):
    caplog.set_level(logging.DEBUG)
    elsewhere: list = []
    thief = web.Application()

    async def steal(request: web.Request) -> web.Response:
        elsewhere.append(dict(request.headers))
        return web.json_response({"text": "stolen"})

    thief.router.add_post("/v1/audio/transcriptions", steal)
    thief_runner, thief_url = await serve(thief)
    standin = StandIn(["ok", "500", "hang", "redirect"], redirect_to=thief_url + "/v1/audio/transcriptions")
    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", standin.transcriptions)
    runner, standin_url = await serve(app)
    # One turn recognized (2.1 s of speech), then three that fail: those need speech, not words, so they are
    # 0.7 s each (the suite waits on every turn in real time).
    turns = [CLEAR_TURNS[2], SHORT_TURN, SHORT_TURN, SHORT_TURN]
    outcomes = []
    try:
        async with in_process_gateway(stt_url=standin_url + "/v1", stt_model=MODEL, stt_api_key=KEY,
                                      stt_timeout_s=3.0) as (_, url):
            backend = VoxgateSession(url)
            await backend.open()
            client = RtcClient(url, mic=True, session_id=backend.session_id, token=backend.client_token)
            try:
                await client.connect()
                for phrase, voice in turns:
                    events = backend.events()
                    client.mic.play(turn_audio(phrase, voice, 48000))
                    outcomes.append(await asyncio.wait_for(next_outcome(events), 30))
                    await events.aclose()
                # The session still speaks after the failures.
                spoken = await backend.say("Still here.")
                assert not spoken.interrupted and spoken.played_ms > 0
                history = list(backend.history)
            finally:
                await client.close()
                await backend.close()
    finally:
        standin.release.set()
        standin.thread.shutdown()
        standin.recognizer.shutdown()
        await runner.cleanup()
        await thief_runner.cleanup()
    kinds = [(e["type"], e.get("code")) for e in history if e["type"] in ("speech.transcript", "error")]
    assert kinds == [("speech.transcript", None), ("error", "stt_failed"), ("error", "stt_timeout"),
                     ("error", "stt_failed")], kinds
    assert all(e["start_ms"] < e["end_ms"] for e in outcomes)
    assert word_error_rate(turns[0][0], outcomes[0]["text"]) <= 0.25, outcomes[0]
    # Every request: the model, the key, and the turn as a 16 kHz mono PCM16 WAV of about the turn's length.
    assert len(standin.requests) == 4
    for request, event in zip(standin.requests, outcomes):
        channels, width, rate, pcm = request["wav"]
        assert (request["auth"], request["model"], channels, width, rate) == (f"Bearer {KEY}", MODEL, 1, 2, 16000)
        assert abs(len(pcm) / 16 - (event["end_ms"] - event["start_ms"])) <= 40  # 20 ms frames, the capture clock slewing
        assert np.abs(pcm).max() > 1000  # speech, not silence
    # The key went to --stt-url only: not to where it redirected, not into any event or log line.
    assert elsewhere == []
    assert KEY not in json.dumps(history) and KEY not in caplog.text
