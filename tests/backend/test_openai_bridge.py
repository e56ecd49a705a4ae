"""examples/openai_bridge.py against a stand-in OpenAI-compatible server.

No LLM API is reachable here, so a small aiohttp server on loopback plays
one: it checks the request and streams chat-completion chunks as
server-sent events, the way OpenAI and vLLM do. The bridge runs as the
example's own process; a WebRTC listener on the tone engine checks that the
exact reply text was spoken.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aiohttp import web

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient

from tests.llm_standin import serve_chat_completions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = ["Sure", "!", " The", " store", " opens", " at", " nine", ",", " and", " closes", " at", " six", "."]


async def start_llm(requests: list) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        requests.append({"body": await request.json(), "auth": request.headers.get("Authorization")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive\n\n")
        role = {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        await resp.write(f"data: {json.dumps(role)}\n\n".encode())
        for token in TOKENS:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.03)
        end = {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await resp.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
        return resp

    return await serve_chat_completions(completions)


async def test_bridge_speaks_the_streamed_reply(tone_server):
    requests: list = []
    runner, llm_url = await start_llm(requests)
    try:
        async with RtcClient(tone_server.url) as listener:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, os.path.join(ROOT, "examples", "openai_bridge.py"),
                "--gateway", tone_server.url, "--session-id", listener.session_id,
                "--llm-url", llm_url, "--llm-key", "sk-test", "--model", "stand-in-model",
                "When does the store open?",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()[-2000:]
            result = json.loads(out.decode().strip().splitlines()[-1])
            assert result["status"] == "done"
            await listener.wait_tail(await listener.wait_for("utterance.done"))
            spoken = tone.decode(listener.audio.pcm(), listener.audio.sample_rate)
        reply = "".join(TOKENS)
        assert spoken == reply
        assert result["heard"] == reply
        [req] = requests
        assert req["auth"] == "Bearer sk-test"
        assert req["body"]["model"] == "stand-in-model" and req["body"]["stream"] is True
        assert req["body"]["messages"][-1] == {"role": "user", "content": "When does the store open?"}
    finally:
        await runner.cleanup()


async def test_bridge_prints_the_page_address_that_hears_it(tone_server):
    """A session the bridge makes itself: it prints the page's join address (its speech waits for
    a listener), and a listener that joins through that address's session id and token hears it."""
    from urllib.parse import parse_qs, urlsplit

    requests: list = []
    runner, llm_url = await start_llm(requests)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(ROOT, "examples", "openai_bridge.py"),
        "--gateway", tone_server.url, "--llm-url", llm_url, "--model", "stand-in-model",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    # The prompt on stdin, which stays open, so the bridge's session outlives the reply's last frames.
    proc.stdin.write(b"Hello?\n")
    await proc.stdin.drain()
    try:
        first = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "in a browser" in first and "waits until a listener joins" in first, first
        url = urlsplit(next(word for word in first.split() if word.startswith("http")))
        assert f"{url.scheme}://{url.netloc}" == tone_server.url and url.path == "/"
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        async with RtcClient(tone_server.url, session_id=query["session_id"], token=query["token"]) as listener:
            done = await listener.wait_for("utterance.done", timeout=30)
            await listener.wait_tail(done)
            spoken = tone.decode(listener.audio.pcm(), listener.audio.sample_rate)
            proc.stdin.close()
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert spoken == "".join(TOKENS)
        assert json.loads(out.decode().strip().splitlines()[-1])["status"] == "done"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await runner.cleanup()
