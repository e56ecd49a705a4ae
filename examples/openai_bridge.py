"""Speak an OpenAI-compatible LLM's streamed replies in a Voxgate session.

Works with any server that streams chat completions as server-sent events
(OpenAI, vLLM, llama.cpp, Ollama's /v1, LM Studio): lines of
`data: {"choices": [{"delta": {"content": "..."}}]}` ending with `data: [DONE]`.

    # A session made here: open the page address it prints to hear the replies
    # (each reply waits in the session until a listener joins):
    python examples/openai_bridge.py --gateway http://127.0.0.1:8080 \\
        --llm-url http://127.0.0.1:11434/v1 --model llama3.2 "Tell me a joke."

    # Or drive a session a browser or a phone call already has:
    python examples/openai_bridge.py --session-id 3f2a... "Hello!"

With no prompt arguments, prompts are read from stdin, one per line.

    # A voice agent: the caller's speech is the prompt. On a server started with
    # --stt pocketsphinx (or --stt-url), each caller turn's speech.transcript goes
    # to the LLM and its streamed reply is spoken, until the session ends:
    python examples/openai_bridge.py --listen --session-id 3f2a...

When the listener interrupts (a barge-in), the assistant's turn in the
history keeps only what was heard, so the model knows where it was cut off;
the turn that interrupted is the next prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import AsyncIterator

import aiohttp

from voxgate.client import Outcome, VoxgateSession


async def chat_tokens(
    http: aiohttp.ClientSession, base_url: str, model: str, messages: list[dict], api_key: str | None = None
) -> AsyncIterator[str]:
    """The content deltas of one streamed chat completion."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": messages, "stream": True}
    async with http.post(base_url.rstrip("/") + "/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"LLM request failed ({resp.status}): {(await resp.text())[:300]}")
        async for raw in resp.content:  # one line at a time
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" lines
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) == 0:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        yield content


async def answer(session: VoxgateSession, http: aiohttp.ClientSession, args: argparse.Namespace, history: list[dict]) -> Outcome:
    outcome = await session.say_stream(chat_tokens(http, args.llm_url, args.model, history, args.llm_key))
    assert isinstance(outcome, Outcome)
    # Keep only what was heard, so the next turn starts from there.
    history.append({"role": "assistant", "content": outcome.played_text if outcome.interrupted else outcome.text})
    return outcome


async def converse(session: VoxgateSession, http: aiohttp.ClientSession, args: argparse.Namespace, history: list[dict]) -> None:
    """Caller speech -> transcript -> LLM tokens -> speech, turn after turn, until the session closes.
    Transcripts that come while a reply plays wait their turn (a barge-in's is the next prompt)."""
    async for event in session.events():
        kind = event.get("type")
        if kind == "speech.transcript" and event.get("final", True) and event.get("text"):  # partials: not yet
            history.append({"role": "user", "content": event["text"]})
            report(await answer(session, http, args, history), heard_from_caller=event["text"])
        elif kind == "error" and str(event.get("code", "")).startswith("stt_"):
            print(f"a caller turn was not recognized ({event['code']}): {event.get('message')}", file=sys.stderr, flush=True)
        elif kind == "session.closed":
            return


def report(outcome: Outcome, **extra) -> None:
    status = f"interrupted ({outcome.reason}) after {outcome.played_ms} ms" if outcome.interrupted else "done"
    print(json.dumps({**extra, "id": outcome.id, "status": status, "heard": outcome.played_text}), flush=True)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompt", nargs="*", help="user turns; read from stdin when none are given")
    parser.add_argument("--gateway", default=os.environ.get("VOXGATE_URL", "http://127.0.0.1:8080"))
    parser.add_argument("--api-key", default=os.environ.get("VOXGATE_API_KEY"))
    parser.add_argument("--session-id", help="attach to this session instead of making one")
    parser.add_argument("--listen", action="store_true",
                        help="answer the caller's speech (speech.transcript; the server needs --stt) until the session ends")
    parser.add_argument("--llm-url", default=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"))
    parser.add_argument("--llm-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    parser.add_argument("--system", default="You are a helpful voice assistant. Answer briefly, in plain spoken sentences.")
    args = parser.parse_args(argv)

    history = [{"role": "system", "content": args.system}]
    async with VoxgateSession(args.gateway, api_key=args.api_key, session_id=args.session_id) as session, aiohttp.ClientSession() as http:
        if session.join_url:
            # Speech waits in the session for a listener: without one, every reply waits.
            print(f"open {session.join_url} in a browser to hear the replies; "
                  "each one waits until a listener joins", flush=True)
        if args.listen:
            await converse(session, http, args, history)
            return 0
        prompts = args.prompt or (line.strip() for line in sys.stdin)
        for prompt in prompts:
            if not prompt:
                continue
            history.append({"role": "user", "content": prompt})
            report(await answer(session, http, args, history))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
