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
import logging
import os
import sys

from aiohttp import web

from voxgate.engine import tone
from voxgate.rtc_client import OfferRefused, RtcClient

from tests.conftest import in_process_gateway
from tests.llm_standin import serve_chat_completions, serve_openai_route

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


# --listen for several calls at once. Callers speak the tone engine's symbols (tone.encode): the
# VAD hears them as speech, and a stand-in recognizer (--stt-url) reads them back exactly, so each
# call's words are known without a speech recognizer; the replies are the tone engine's too.
ASKS = {"a": "What time is it?", "b": "Tell me a story.", "c": "Where is the station?"}
REPLIES = {ASKS["a"]: "It is nine.", ASKS["b"]: "Once upon a time, a gateway spoke to many callers at once.",
           ASKS["c"]: "Next to the park."}
PARTIAL = "Let me see, "
SORRY = "Sorry."


async def start_tone_stt() -> tuple[web.AppRunner, str]:
    """An OpenAI-compatible /v1/audio/transcriptions that decodes the tone engine's symbols."""
    import io
    import wave

    import numpy as np

    async def transcriptions(request: web.Request) -> web.Response:
        upload = (await request.post())["file"]
        assert isinstance(upload, web.FileField)
        with wave.open(io.BytesIO(upload.file.read())) as w:
            pcm, rate = np.frombuffer(w.readframes(w.getnframes()), "<i2"), w.getframerate()
        return web.json_response({"text": tone.decode(pcm, rate)})

    return await serve_openai_route("/v1/audio/transcriptions", transcriptions)


async def start_failing_llm(requests: list) -> tuple[web.AppRunner, str]:
    """Replies by the last user turn; the first request for ASKS["a"] breaks off mid-reply."""
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append(body)
        ask = body["messages"][-1]["content"]
        fail = ask == ASKS["a"] and sum(r["messages"][-1]["content"] == ask for r in requests) == 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for token in ([PARTIAL] if fail else [w + " " for w in REPLIES[ask].split(" ")]):
            chunk = {"choices": [{"index": 0, "delta": {"content": token}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        if fail:
            await asyncio.sleep(0.1)
            assert request.transport is not None
            request.transport.close()  # the stream breaks off mid-reply (an unfinished chunked body)
            return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return await serve_chat_completions(completions)


async def speak(caller: RtcClient, text: str) -> None:
    caller.mic.play(tone.encode(text, 16000), 16000)  # any rate: the client resamples


async def backend_of(gw, session_id: str, other_than: str | None = None, timeout: float = 10.0) -> str:
    """The session's writer once it has one (not `other_than`): the bridge has attached."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        session = gw.sessions.get(session_id)
        writer = session.writer if session is not None else None
        if writer is not None and writer != other_than:
            return writer
        assert loop.time() < deadline, f"no backend attached to {session_id} within {timeout} s"
        await asyncio.sleep(0.02)


async def admitted_caller(url: str) -> RtcClient:
    """A connected caller, retrying while admission says at_capacity, as a real client does on a 503: the
    gateway runs in this test's own loop beside three aiortc clients, so its loop-lag figure counts their
    work too (a fresh clone's first connections measured 114 ms once)."""
    for _ in range(40):
        caller = RtcClient(url, mic=True)
        try:
            await caller.connect()
            return caller
        except OfferRefused as exc:
            await caller.close()
            if exc.code != "at_capacity":
                raise
            await asyncio.sleep(0.25)
    raise AssertionError("no caller was admitted within 10 s")


async def test_bridge_serves_three_calls_through_a_hang_up_an_llm_failure_and_a_dropped_connection(caplog):
    caplog.set_level(logging.INFO)
    requests: list = []
    llm, llm_url = await start_failing_llm(requests)
    stt, stt_url = await start_tone_stt()
    proc = None
    try:
        async with in_process_gateway(stt_url=stt_url) as (app, url):
            gw = app["gateway"]
            callers = {}
            for name in ASKS:
                callers[name] = caller = await admitted_caller(url)
                caller.send({"type": "session.update", "vad": {"hangover_ms": 200}})
                await caller.wait_for("session.updated")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, os.path.join(ROOT, "examples", "openai_bridge.py"), "--listen", "--poll-s", "0.1",
                "--gateway", url, "--llm-url", llm_url, "--model", "stand-in", "--apology", SORRY,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            writers = {name: await backend_of(gw, c.session_id) for name, c in callers.items()}
            hung_up = asyncio.Event()

            async def call_a() -> list[dict]:
                a = callers["a"]
                await speak(a, ASKS["a"])
                broken = await a.wait_for("utterance.done", timeout=15)
                sorry = await a.wait_for("utterance.done", timeout=15)
                # The bridge's WebSocket drops (a proxy restart, say): it reconnects and the call goes on.
                link = gw.sessions[a.session_id].listeners[writers["a"]].__self__
                await link.socket.close()
                await backend_of(gw, a.session_id, other_than=writers["a"])
                await hung_up.wait()  # and it still serves after another caller hung up
                await speak(a, ASKS["a"])
                again = await a.wait_for("utterance.done", timeout=15)
                return [broken, sorry, again]

            async def call_b() -> dict:
                b = callers["b"]
                await speak(b, ASKS["b"])
                started = await b.wait_for("audio.started", timeout=15)
                await b.wait_frames_after(started, 10)
                await b.close()  # the caller hangs up mid-reply
                hung_up.set()
                return started

            async def call_c() -> dict:
                await speak(callers["c"], ASKS["c"])
                return await callers["c"].wait_for("utterance.done", timeout=15)

            (broken, sorry, again), _, done_c = await asyncio.wait_for(asyncio.gather(call_a(), call_b(), call_c()), 40)
            for name in ("a", "c"):
                await callers[name].close()
            # Every call ended: one line each.
            stderr_lines: list[str] = []
            while sum("call ended" in line for line in stderr_lines) < 3:
                line = await asyncio.wait_for(proc.stderr.readline(), 10)
                assert line, stderr_lines
                stderr_lines.append(line.decode())
            proc.terminate()
            out, err = await asyncio.wait_for(proc.communicate(), 10)
            bridge_log = "".join(stderr_lines) + err.decode()
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await llm.cleanup()
        await stt.cleanup()
    assert proc.returncode == 0, bridge_log
    assert broken["text"].strip() == PARTIAL.strip() and sorry["text"] == SORRY
    assert again["text"].strip() == REPLIES[ASKS["a"]] and done_c["text"].strip() == REPLIES[ASKS["c"]]
    # One line per call's end, the failure logged once, the reconnection said; no traceback anywhere.
    assert "Traceback" not in bridge_log, bridge_log
    assert bridge_log.count("the LLM failed mid-reply") == 1 and "backend connection back" in bridge_log, bridge_log
    assert [line for line in bridge_log.splitlines() if callers["b"].session_id in line and "call ended" in line]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    # The history after the failure: the apology, then the question asked again.
    last = [r for r in requests if r["messages"][-1]["content"] == ASKS["a"]][-1]["messages"]
    assert [m["role"] for m in last[1:]] == ["user", "assistant", "user"] and last[2]["content"] == SORRY
    reports = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert len(reports) == 3 and all(r["status"] == "done" for r in reports), reports  # b's reply never finished


async def test_a_caller_hanging_up_mid_reply_is_a_normal_end_of_the_call():
    """--listen --session-id: the caller hangs up while the reply plays; the bridge logs the call's
    end in one line and exits 0 once its session has ended (it crashed with session_closed)."""
    requests: list = []
    llm, llm_url = await start_failing_llm(requests)
    stt, stt_url = await start_tone_stt()
    try:
        async with in_process_gateway(stt_url=stt_url) as (app, url):
            caller = RtcClient(url, mic=True)
            await caller.connect()
            caller.send({"type": "session.update", "vad": {"hangover_ms": 200}})
            await caller.wait_for("session.updated")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, os.path.join(ROOT, "examples", "openai_bridge.py"), "--listen",
                "--gateway", url, "--session-id", caller.session_id, "--poll-s", "0.1", "--llm-url", llm_url, "--model", "stand-in",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                await backend_of(app["gateway"], caller.session_id)
                await speak(caller, ASKS["b"])
                started = await caller.wait_for("audio.started", timeout=15)
                await caller.wait_frames_after(started, 10)
            finally:
                await caller.close()  # hangs up mid-reply
            out, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        await llm.cleanup()
        await stt.cleanup()
    log = err.decode()
    assert proc.returncode == 0 and "Traceback" not in log, log
    assert [line for line in log.splitlines() if "call ended" in line] != [], log
