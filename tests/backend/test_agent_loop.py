"""The agent loop: caller speech -> transcript -> LLM tokens -> speech (examples/openai_bridge.py --listen).

A real aiortc caller speaks espeak-ng turns to an in-process gateway with
`--stt pocketsphinx`; the bridge runs as the example's own process against a
stand-in OpenAI-compatible chat-completions server on loopback (streamed SSE).
The caller's first turn is the first prompt; the caller barges in on the long
reply, and the next request's history keeps only what the caller heard of it
(the `utterance.interrupted` event's played_text), then the turn that
interrupted as the next prompt, whose reply plays to its end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aiohttp import web

from voxgate.client import VoxgateSession
from voxgate.rtc_client import RtcClient

from tests.conftest import in_process_gateway
from tests.llm_standin import serve_chat_completions
from tests.speech import word_error_rate
from tests.transcripts import CLEAR_TURNS, turn_audio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = (" Of course. Your appointment on Friday is at ten in the morning with doctor Smith, and I can move it"
        " to another day next week, or cancel it now, or keep it as it is; just tell me which you would like"
        " and I will take care of it for you right away.").split(" ")[1:]
SHORT = ["The", " pharmacy", " is", " next", " to", " the", " station", "."]


async def start_llm(requests: list) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append(body)
        tokens = [w if i == 0 else " " + w for i, w in enumerate(LONG)] if len(requests) == 1 else SHORT
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for token in tokens:
            chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": token}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return await serve_chat_completions(completions)


async def test_caller_speech_to_llm_to_speech_keeps_only_what_was_heard_after_a_barge_in():
    requests: list = []
    llm, llm_url = await start_llm(requests)
    first, second = CLEAR_TURNS[1], CLEAR_TURNS[2]
    try:
        async with in_process_gateway(stt="pocketsphinx") as (_, url):
            watcher = VoxgateSession(url, role="watcher")
            await watcher.open()
            caller = RtcClient(url, mic=True, session_id=watcher.session_id, token=watcher.client_token)
            proc = None
            try:
                await caller.connect()
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, os.path.join(ROOT, "examples", "openai_bridge.py"), "--listen",
                    "--gateway", url, "--session-id", watcher.session_id, "--llm-url", llm_url, "--model", "stand-in",
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                caller.mic.play(turn_audio(*first, 48000))
                heard_1 = await watcher.wait_for("speech.transcript", timeout=30)
                started = await caller.wait_for("utterance.started", timeout=30)
                # The caller talks over the long reply: a barge-in.
                await caller.wait_frames_after(started, 50)  # a second of the reply heard
                caller.mic.play(turn_audio(*second, 48000))
                interrupted = await watcher.wait_for("utterance.interrupted", id=started["id"], timeout=30)
                heard_2 = await watcher.wait_for("speech.transcript", timeout=30)
                done = await watcher.wait_for("utterance.done", timeout=30)
            finally:
                await caller.close()
                await watcher.close()  # ends the session: the bridge's loop ends
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()[-2000:]
    finally:
        await llm.cleanup()
    assert word_error_rate(first[0], heard_1["text"]) <= 0.2 and word_error_rate(second[0], heard_2["text"]) <= 0.2
    assert interrupted["reason"] == "barge_in"
    reply = "".join(w if i == 0 else " " + w for i, w in enumerate(LONG))
    heard = interrupted["played_text"]
    assert heard and reply.startswith(heard) and len(heard) < len(reply) // 2, heard
    assert done["text"] == "".join(SHORT)
    # The LLM got the caller's words, and after the barge-in only what the caller heard of its reply.
    assert len(requests) == 2
    assert requests[0]["messages"][1:] == [{"role": "user", "content": heard_1["text"]}]
    assert requests[1]["messages"][1:] == [{"role": "user", "content": heard_1["text"]},
                                           {"role": "assistant", "content": heard},
                                           {"role": "user", "content": heard_2["text"]}]
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert [line["status"].split(" ")[0] for line in lines] == ["interrupted", "done"], lines
