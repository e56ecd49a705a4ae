"""Speak an OpenAI-compatible LLM's streamed replies in Voxgate sessions.

Works with any server that streams chat completions as server-sent events
(OpenAI, vLLM, llama.cpp, Ollama's /v1, LM Studio): lines of
`data: {"choices": [{"delta": {"content": "..."}}]}` ending with `data: [DONE]`.

A voice agent for every call (docs/backends.md walks through it). On a server
started with --stt pocketsphinx (or --stt-url), each caller turn's
speech.transcript goes to the LLM and its streamed reply is spoken:

    python examples/openai_bridge.py --listen --gateway http://127.0.0.1:8080 \\
        --llm-url http://127.0.0.1:11434/v1 --model llama3.2

With --listen alone it answers every session its API key owns (GET /v1/sessions:
those it made with POST /v1/sessions; on a server without keys, every session),
each in a task of its own, as soon as it appears, and runs until stopped
(Ctrl-C). With --session-id (as many as you like) it answers those sessions
only and exits once they have all ended. Each call's end is one log line. An
LLM that fails mid-reply is logged, and the caller hears a short apology;
a backend WebSocket that drops is opened again and the call goes on with its
history, for as long as the session lives.

Or speak prompts in one session, made here (open the page address it prints
to hear the replies; each waits in the session until a listener joins):

    python examples/openai_bridge.py --gateway http://127.0.0.1:8080 \\
        --llm-url http://127.0.0.1:11434/v1 --model llama3.2 "Tell me a joke."

    # Or in a session a browser or a phone call already has:
    python examples/openai_bridge.py --session-id 3f2a... "Hello!"

With no prompt arguments, prompts are read from stdin, one per line.

When the listener interrupts (a barge-in), the assistant's turn in the
history keeps only what was heard, so the model knows where it was cut off;
the turn that interrupted is the next prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import AsyncIterator

import aiohttp

from voxgate.client import Outcome, VoxgateError, VoxgateSession, list_sessions

log = logging.getLogger("openai_bridge")

# What the caller hears when the LLM fails mid-reply (what it had said before plays first): --apology.
APOLOGY = "Sorry, I lost my train of thought. Could you say that again?"
# Reconnecting a dropped backend WebSocket: the first wait, doubling up to the last, for at most this long.
RECONNECT_FIRST_S, RECONNECT_MAX_S, RECONNECT_GIVE_UP_S = 0.25, 5.0, 120.0
# The turns of a call the LLM is sent, besides the system prompt: the oldest go first.
MAX_HISTORY = 40
# The LLM's stream: an answer must start, and each piece follow the last, within this long.
LLM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=30.0)


async def chat_tokens(
    http: aiohttp.ClientSession, base_url: str, model: str, messages: list[dict], api_key: str | None = None
) -> AsyncIterator[str]:
    """The content deltas of one streamed chat completion."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": messages, "stream": True}
    async with http.post(base_url.rstrip("/") + "/chat/completions", json=body, headers=headers,
                         timeout=LLM_TIMEOUT) as resp:
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
    """One reply, streamed from the LLM. If the LLM fails, what it had said is finished
    (say_stream ends the utterance), the failure is logged and the caller hears --apology.
    A VoxgateError (the session or its connection ended, the server refused) is raised."""
    del history[1:-MAX_HISTORY]  # a long call's history stays bounded (history[0] is the system prompt)
    try:
        outcome = await session.say_stream(chat_tokens(http, args.llm_url, args.model, history, args.llm_key))
    except VoxgateError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
        log.warning("session %s: the LLM failed mid-reply (%s: %s); apologizing", session.session_id,
                    type(exc).__name__, exc)
        history.append({"role": "assistant", "content": args.apology})
        outcome = await session.say(args.apology)
        assert isinstance(outcome, Outcome)
        return outcome
    assert isinstance(outcome, Outcome)
    # Keep only what was heard, so the next turn starts from there.
    history.append({"role": "assistant", "content": outcome.played_text if outcome.interrupted else outcome.text})
    return outcome


def report(outcome: Outcome, **extra) -> None:
    status = f"interrupted ({outcome.reason}) after {outcome.played_ms} ms" if outcome.interrupted else "done"
    print(json.dumps({**extra, "id": outcome.id, "status": status, "heard": outcome.played_text}), flush=True)


class Call:
    """One session's conversation, in a task of its own: caller turns in, replies out, until the
    session ends. Its history outlives the backend WebSocket: a dropped one is opened again."""

    def __init__(self, session_id: str, http: aiohttp.ClientSession, args: argparse.Namespace) -> None:
        self.session_id = session_id
        self.http = http
        self.args = args
        self.history = [{"role": "system", "content": args.system}]
        self._lost_at: float | None = None  # when the backend connection went (loop time), while it is away
        self._delay = RECONNECT_FIRST_S

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                ended = await self._connected()
            except VoxgateError as exc:
                if exc.status in (401, 403):  # the key: trying again would not help
                    log.error("session %s: the gateway refused this backend (%s); check --api-key", self.session_id, exc)
                    return
                if exc.status == 404:
                    ended = "it no longer exists"
                else:
                    ended = None
                    why = str(exc)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                ended, why = None, f"{type(exc).__name__}: {exc}"
            else:
                why = "the WebSocket closed"
            if ended is not None:
                if ended:  # "": left to another backend, said already
                    log.info("session %s: call ended (%s)", self.session_id, ended)
                return
            # The session may live on (a gateway restart, a network blip): connect again and go on.
            now = loop.time()
            if self._lost_at is None:
                self._lost_at = now
            if now - self._lost_at > RECONNECT_GIVE_UP_S:
                log.warning("session %s: no backend connection for %.0f s (%s); leaving the call", self.session_id,
                            now - self._lost_at, why)
                return
            log.warning("session %s: backend connection lost (%s); reconnecting in %.2f s", self.session_id, why,
                        self._delay)
            await asyncio.sleep(self._delay)
            self._delay = min(RECONNECT_MAX_S, 2 * self._delay)

    async def _connected(self) -> str | None:
        """Converse over one backend WebSocket: the reason the session ended ("" when another
        backend writes to it), or None when the connection went with the session still open."""
        args = self.args
        async with VoxgateSession(args.gateway, api_key=args.api_key, session_id=self.session_id,
                                  end_on_exit=False) as session:
            if session.ready.get("role") != "writer":
                log.info("session %s: another backend (%s) writes to it; leaving it", self.session_id,
                         session.ready.get("writer"))
                return ""
            if self._lost_at is not None:
                log.info("session %s: backend connection back after %.1f s; the call goes on", self.session_id,
                         asyncio.get_running_loop().time() - self._lost_at)
                self._lost_at, self._delay = None, RECONNECT_FIRST_S
            try:
                await self._converse(session)
            except VoxgateError as exc:
                if exc.code != "session_closed":
                    raise
            return session.ended

    async def _converse(self, session: VoxgateSession) -> None:
        """Caller speech -> transcript -> LLM tokens -> speech, turn after turn, until the connection closes.
        Transcripts that come while a reply plays wait their turn (a barge-in's is the next prompt)."""
        async for event in session.events():
            kind = event.get("type")
            if kind == "speech.transcript" and event.get("final", True) and event.get("text"):  # partials: not yet
                self.history.append({"role": "user", "content": event["text"]})
                try:
                    outcome = await answer(session, self.http, self.args, self.history)
                except VoxgateError as exc:
                    if exc.code == "session_closed":
                        raise
                    log.warning("session %s: the reply was refused: %s", self.session_id, exc)
                    continue
                report(outcome, session_id=self.session_id, heard_from_caller=event["text"])
            elif kind == "error" and str(event.get("code", "")).startswith("stt_"):
                log.warning("session %s: a caller turn was not recognized (%s): %s", self.session_id, event["code"],
                            event.get("message"))


async def serve(http: aiohttp.ClientSession, args: argparse.Namespace, stop: asyncio.Event) -> None:
    """--listen: a Call task per session, until `stop` (or, with --session-id, until they have all ended)."""
    calls: dict[str, asyncio.Task] = {}

    def start(session_id: str) -> None:
        log.info("session %s: answering", session_id)
        task = asyncio.ensure_future(Call(session_id, http, args).run())
        task.add_done_callback(lambda t: _call_done(session_id, t))
        calls[session_id] = task

    watching = not args.session_id
    for session_id in args.session_id or []:
        start(session_id)
    listing_failed = False
    try:
        while not stop.is_set():
            for session_id in [s for s, task in calls.items() if task.done()]:
                del calls[session_id]
            if watching:
                try:
                    listed = await list_sessions(args.gateway, api_key=args.api_key, http=http)
                    if listing_failed:
                        log.info("listing sessions works again")
                    listing_failed = False
                except (VoxgateError, aiohttp.ClientError, OSError) as exc:
                    if not listing_failed:  # once, not every poll, while the gateway is away
                        log.warning("cannot list the gateway's sessions (%s); trying every %g s", exc, args.poll_s)
                    listing_failed = True
                    listed = []
                for state in listed:
                    if state["session_id"] not in calls and state.get("writer") is None:
                        start(state["session_id"])
            elif not calls:
                return  # every session given has ended
            try:
                await asyncio.wait_for(stop.wait(), args.poll_s)
            except asyncio.TimeoutError:
                pass
    finally:
        for task in calls.values():
            task.cancel()
        if calls:
            await asyncio.wait(calls.values())


def _call_done(session_id: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:  # a bug: the one place for a traceback
        log.error("session %s: the call's task failed", session_id, exc_info=task.exception())


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompt", nargs="*", help="user turns; read from stdin when none are given")
    parser.add_argument("--gateway", default=os.environ.get("VOXGATE_URL", "http://127.0.0.1:8080"))
    parser.add_argument("--api-key", default=os.environ.get("VOXGATE_API_KEY"))
    parser.add_argument("--session-id", action="append",
                        help="a session to answer (repeat it for several with --listen) instead of making one")
    parser.add_argument("--listen", action="store_true",
                        help="answer the callers' speech (speech.transcript; the server needs --stt) in every session "
                             "of this API key, or in those given with --session-id, each in its own task")
    parser.add_argument("--poll-s", type=float, default=1.0, help="with --listen alone: how often to look for new sessions")
    parser.add_argument("--llm-url", default=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"))
    parser.add_argument("--llm-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    parser.add_argument("--system", default="You are a helpful voice assistant. Answer briefly, in plain spoken sentences.")
    parser.add_argument("--apology", default=APOLOGY, help="what the caller hears when the LLM fails mid-reply")
    args = parser.parse_args(argv)
    if not 0.05 <= args.poll_s <= 60:
        parser.error("--poll-s must be from 0.05 to 60")
    if not args.listen and args.session_id and len(args.session_id) > 1:
        parser.error("prompts go to one session: give --session-id once, or use --listen")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async with aiohttp.ClientSession() as http:
        if args.listen:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await serve(http, args, stop)
            log.info("stopped" if stop.is_set() else "every session has ended")
            return 0
        history = [{"role": "system", "content": args.system}]
        session_id = args.session_id[0] if args.session_id else None
        async with VoxgateSession(args.gateway, api_key=args.api_key, session_id=session_id) as session:
            if session.join_url:
                # Speech waits in the session for a listener: without one, every reply waits.
                print(f"open {session.join_url} in a browser to hear the replies; "
                      "each one waits until a listener joins", flush=True)
            prompts = args.prompt or (line.strip() for line in sys.stdin)
            for prompt in prompts:
                if not prompt:
                    continue
                history.append({"role": "user", "content": prompt})
                report(await answer(session, http, args, history))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
