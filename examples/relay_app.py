"""A ConversationRelay application (Twilio's and Telnyx's protocol) that speaks an LLM's streamed reply
to each thing the caller says: the loop of `openai_bridge.py --listen`, in the vendors' words. It runs
unchanged behind Twilio, Telnyx or Voxgate (docs/relay.md):

    python examples/relay_app.py --llm-url http://127.0.0.1:11434/v1 --model llama3.2 --port 8765
    voxgate serve --stt pocketsphinx --relay-url ws://127.0.0.1:8765/ --relay-allow-private
"""

import argparse
import json

import aiohttp
from aiohttp import web


async def relay(request: web.Request) -> web.WebSocketResponse:
    ws, history = web.WebSocketResponse(), []
    await ws.prepare(request)
    async with aiohttp.ClientSession() as http:
        async for message in ws:
            m = json.loads(message.data)
            if m["type"] == "prompt" and m["last"]:
                history += [{"role": "user", "content": m["voicePrompt"]}, {"role": "assistant", "content": ""}]
                body = {"model": ARGS.model, "messages": history[:-1], "stream": True}
                async with http.post(ARGS.llm_url.rstrip("/") + "/chat/completions", json=body) as resp:
                    async for line in resp.content:  # server-sent events: data: {...}
                        if line.startswith(b"data: {"):
                            token = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                            history[-1]["content"] += token
                            await ws.send_json({"type": "text", "token": token, "last": False})
                await ws.send_json({"type": "text", "token": "", "last": True})
            elif m["type"] == "interrupt":  # the model's turn keeps only what the caller heard
                history[-1]["content"] = m["utteranceUntilInterrupt"]
    return ws


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llm-url", required=True, help="an OpenAI-compatible API's base, e.g. http://127.0.0.1:11434/v1")
    parser.add_argument("--model", required=True, help="the model to ask")
    parser.add_argument("--port", type=int, default=8765, help="where this application listens (loopback)")
    ARGS = parser.parse_args()
    app = web.Application()
    app.router.add_get("/", relay)
    web.run_app(app, host="127.0.0.1", port=ARGS.port, print=lambda *_: print(f"listening on {ARGS.port}", flush=True))
