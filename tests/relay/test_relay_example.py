"""examples/relay_app.py, run as its own process, answers a phone caller through Voxgate's relay:
the caller's turn goes to a stand-in OpenAI-compatible LLM (tests/llm_standin.py) and its streamed
tokens are spoken on the call."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aiohttp
import numpy as np
from aiohttp import web

from voxgate.client import VoxgateSession

from tests.conftest import free_port, in_process_gateway
from tests.listening_corpus import espeak
from tests.llm_standin import serve_chat_completions
from tests.relay.relay_app import stt_standin
from tests.telephony.twilio_standin import TwilioStandIn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = ["The", " store", " opens", " at", " nine."]


async def test_the_example_speaks_the_llm_tokens_for_the_callers_turn():
    asked: list = []

    async def completions(request: web.Request) -> web.StreamResponse:
        asked.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for token in TOKENS:
            chunk = {"choices": [{"index": 0, "delta": {"content": token}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    llm, llm_url = await serve_chat_completions(completions)
    stt, stt_url = await stt_standin(["when do you open"])
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(ROOT, "examples", "relay_app.py"), "--llm-url", llm_url, "--model", "stand-in",
        "--port", str(port), stdout=asyncio.subprocess.PIPE)
    try:
        async with in_process_gateway(stt_url=stt_url, relay_allow_private=True,
                                      relay_url=f"ws://127.0.0.1:{port}/") as (_, url):
            assert proc.stdout is not None  # the example started while the gateway did
            assert b"listening" in await asyncio.wait_for(proc.stdout.readline(), 30)
            phone = TwilioStandIn(url, call_sid="CAexample")
            await phone.connect()
            await phone.start()  # no relay_url parameter: the server's --relay-url
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/v1/sessions", params={"call_sid": "CAexample"}) as resp:
                    [state] = (await resp.json())["sessions"]
            watcher = VoxgateSession(url, session_id=state["session_id"], role="watcher")
            await watcher.open()
            try:
                await phone.send_audio(np.concatenate([np.zeros(1600, np.int16), espeak("When do you open?", "en-us+klatt", 8000),
                                                       np.zeros(6400, np.int16)]), speed=3.0)
                done = await watcher.wait_for("utterance.done", timeout=20)
            finally:
                await watcher.close()
                await phone.close()
    finally:
        proc.kill()
        await proc.wait()
        await llm.cleanup()
        await stt.cleanup()
    assert state["relay"]["url"] == f"ws://127.0.0.1:{port}/"
    assert asked[0]["messages"] == [{"role": "user", "content": "when do you open"}]
    assert done["text"] == "".join(TOKENS) and done["audio_ms"] > 0
