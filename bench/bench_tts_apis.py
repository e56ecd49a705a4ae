"""First audio through each way in, for the same sentences in one run: OpenAI's speech API,
the TTS WebSocket, and a WebRTC session.

    python bench/bench_tts_apis.py [--rounds 3] [--out bench/results/tts-apis.json]

One `voxgate serve --engine piper` (the real voice, default settings) as its own process.
For each of eight sentences of 10-13 words with no comma, in turn and one request at a time:
- openai: `client.audio.speech.with_streaming_response.create(response_format="pcm")` through
  the official `openai` client (made once, as apps do), from the call to its first bytes (client);
- tts/ws: on an open `/v1/tts/ws` connection, from sending the sentence's `text` and `end` to
  its first `audio` message (client);
- session: an aiortc client's `speak` on an open session; `audio.started`'s `ttfa_ms`, from
  the text reaching the server to its first packet leaving (server), and the client's own
  time from sending `speak` to receiving `audio.started` (client, over the data channel).
The order of the three turns round per sentence; a warm-up sentence of each goes first.
Figures: medians and ratios to the session's server TTFA (the issue's bound: openai <= 1.5x).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import ARTIFACTS, arg_parser, finish, free_port, machine, print_machine, section, summary_ms, wait_ready  # noqa: E402

SENTENCES = [
    "The library opens at nine and closes at six on weekdays.",
    "Please bring your card when you borrow a book from the desk.",
    "Our garden has tomatoes and beans and a row of tall sunflowers.",
    "The train to the city leaves every twenty minutes from platform two.",
    "She painted the old fence green before the summer rain arrived.",
    "We will meet at the corner cafe after the morning meeting ends.",
    "The museum keeps its oldest maps in a cool room downstairs.",
    "A small boat crossed the lake while the sun went down slowly.",
]


async def openai_first_byte(client, text: str) -> float:
    started = time.perf_counter()
    async with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=text,
                                                                  response_format="pcm") as response:
        first = None
        async for _ in response.iter_bytes():
            first = first or time.perf_counter() - started
    return first


async def ws_first_audio(ws, cid: str, text: str) -> float:
    started = time.perf_counter()
    await ws.send_str(json.dumps({"type": "text", "context_id": cid, "text": text}))
    await ws.send_str(json.dumps({"type": "end", "context_id": cid}))
    first = None
    async for msg in ws:
        m = json.loads(msg.data)
        if m["type"] == "audio" and first is None:
            first = time.perf_counter() - started
            assert base64.b64decode(m["audio"])
        elif m["type"] == "error":
            raise RuntimeError(m)
        elif m["type"] == "done":
            return first


async def session_ttfa(rtc, uid: str, text: str) -> tuple[float, float]:
    started = time.perf_counter()
    rtc.send({"type": "speak", "text": text, "id": uid})
    event = await rtc.wait_for("audio.started", id=uid, timeout=30)
    client_s = time.perf_counter() - started
    await rtc.wait_for("utterance.done", id=uid, timeout=60)
    return event["ttfa_ms"] / 1000.0, client_s


async def run(url: str, rounds: int) -> dict:
    import aiohttp
    import openai

    from voxgate.rtc_client import RtcClient

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    figures = {"openai": [], "ws": [], "session_server": [], "session_client": []}
    rows = []
    async with aiohttp.ClientSession() as http, RtcClient(url) as rtc:
        async with http.ws_connect(url.replace("http://", "ws://") + "/v1/tts/ws") as ws:
            assert (await ws.receive_json())["type"] == "ready"
            n = 0
            plan = [SENTENCES[0]] + SENTENCES * rounds  # the first is a warm-up
            for i, text in enumerate(plan):
                order = ["openai", "ws", "session"]
                order = order[i % 3:] + order[: i % 3]
                row = {"text": text}
                for way in order:
                    n += 1
                    if way == "openai":
                        row["openai_ms"] = await openai_first_byte(client, text) * 1000
                    elif way == "ws":
                        row["ws_ms"] = await ws_first_audio(ws, f"c{n}", text) * 1000
                    else:
                        server_s, client_s = await session_ttfa(rtc, f"u{n}", text)
                        row["session_server_ms"], row["session_client_ms"] = server_s * 1000, client_s * 1000
                print(f"  {'warm-up ' if i == 0 else ''}{row['openai_ms']:6.1f} openai  {row['ws_ms']:6.1f} ws  "
                      f"{row['session_server_ms']:6.1f} session (server)  {row['session_client_ms']:6.1f} (client)  {text[:40]}", flush=True)
                if i == 0:
                    continue
                rows.append(row)
                figures["openai"].append(row["openai_ms"] / 1000)
                figures["ws"].append(row["ws_ms"] / 1000)
                figures["session_server"].append(row["session_server_ms"] / 1000)
                figures["session_client"].append(row["session_client_ms"] / 1000)
    summary = {k: summary_ms(v) for k, v in figures.items()}
    base = statistics.median(figures["session_server"])
    ratios = {
        "openai_over_session": round(statistics.median(figures["openai"]) / base, 2),
        "ws_over_session": round(statistics.median(figures["ws"]) / base, 2),
        "session_client_over_server": round(statistics.median(figures["session_client"]) / base, 2),
    }
    return {"summary": summary, "ratios_of_medians": ratios, "rows": rows}


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="times through the eight sentences")
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    os.makedirs(ARTIFACTS, exist_ok=True)
    log = open(os.path.join(ARTIFACTS, "bench-tts-apis-server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1",
                               "--engine", "piper"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url)
        section("first audio per way in (ms)")
        results = asyncio.run(run(url, 1 if args.quick else args.rounds))
    finally:
        server.terminate()
        server.wait(20)
    s, r = results["summary"], results["ratios_of_medians"]
    section("medians")
    print(f"openai first byte {s['openai']['p50']} ms, tts/ws first audio {s['ws']['p50']} ms, "
          f"session TTFA {s['session_server']['p50']} ms (server) / {s['session_client']['p50']} ms (client's audio.started)")
    print(f"ratios to the session's TTFA: openai {r['openai_over_session']}x (bound 1.5x), tts/ws {r['ws_over_session']}x")
    results["machine"] = info
    results["args"] = vars(args)
    results["engine"] = "piper (the default voice), normal media priority"
    finish("tts-apis", results, started, args.out)


if __name__ == "__main__":
    main()
