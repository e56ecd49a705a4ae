"""A session's turns cut for the recognizer (gateway/caller/stt.py): --stt-max-turn-s, and `stt_busy` when it can't keep up.

The recognizer here is a stand-in that holds every turn until the test lets
it go, so what is asked of it, and when, is seen exactly; the cutting, the
bounds and the events are the gateway's own. A session's frames are 20 ms of
16 kHz audio, each filled with its own index so that what reached the
recognizer can be traced back to the frames the caller sent.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestServer

from voxgate.gateway.caller.stt import MAX_PENDING_PER_SESSION, WAITING_PER_SLOT, SpeechToText, TurnTranscriber

from tests.conftest import in_process_gateway

FRAME = 320  # samples in a 20 ms frame at 16 kHz
LOOKBACK_MS = 400


class HeldRecognizer:
    """Answers each turn with the frame indices it was given, once `release` is set."""

    name = "held"
    threaded = False

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.asked: list[np.ndarray] = []

    def recognize(self, pcm: np.ndarray) -> str:
        raise AssertionError("not threaded")

    async def recognize_async(self, pcm: np.ndarray) -> str:
        self.asked.append(pcm)
        await self.release.wait()
        frames = pcm.reshape(-1, FRAME)[:, 0]
        return f"frames {frames[0]}-{frames[-1]}"

    async def close(self) -> None:
        pass


def frame(index: int) -> np.ndarray:
    return np.full(FRAME, index, np.int16)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def feed(turns: TurnTranscriber, first: int, last: int) -> None:
    """Frames `first`..`last` (inclusive), frame i captured at 20 * i ms."""
    for i in range(first, last + 1):
        turns.frame(frame(i), 20.0 * i)


def short_turn(turns: TurnTranscriber, k: int) -> None:
    """The k-th second of the call: the VAD's speech.started at 600 ms into it, speech.stopped at 900 ms.
    The turn is cut from 700 ms before speech.started (lookback and margin): k s - 100 ms to k s + 900 ms."""
    t = 50 * k
    feed(turns, t, t + 29)
    turns.started(20.0 * (t + 30))
    feed(turns, t + 30, t + 44)
    turns.stopped(20.0 * (t + 45))
    feed(turns, t + 45, t + 49)


async def test_a_turn_longer_than_max_turn_is_recognized_in_pieces_while_the_caller_still_speaks():
    recognizer = HeldRecognizer()
    stt = SpeechToText(recognizer, max_concurrent=2, timeout_s=30.0, max_turn_s=1.0)
    events: list[dict] = []
    turns = TurnTranscriber(stt, events.append, lookback_ms=lambda: LOOKBACK_MS)
    feed(turns, 0, 49)  # a second of silence before the caller
    turns.started(1000.0)  # the VAD decided at 1 s: the turn is taken from 1000 - 400 - 300 = 300 ms
    feed(turns, 50, 113)  # 1000 .. 2280 ms
    await settle()
    # One piece already at the recognizer, a second of audio (frames 15-64: 300 .. 1300 ms), before speech.stopped.
    assert len(recognizer.asked) == 1
    assert list(recognizer.asked[0].reshape(-1, FRAME)[:, 0]) == list(range(15, 65))
    feed(turns, 114, 174)  # to 3500 ms
    turns.stopped(3500.0)
    await settle()
    recognizer.release.set()
    await settle()
    await asyncio.gather(*turns._pending)
    spans = [(e["start_ms"], e["end_ms"]) for e in events]
    assert [e["type"] for e in events] == ["speech.transcript"] * 4, events
    # Contiguous pieces of at most a second each, in the order spoken, the last one what was left at speech.stopped.
    assert spans == [(300, 1300), (1300, 2300), (2300, 3300), (3300, 3500)]
    assert [e["text"] for e in events] == ["frames 15-64", "frames 65-114", "frames 115-164", "frames 165-174"]
    assert [len(pcm) for pcm in recognizer.asked] == [50 * FRAME, 50 * FRAME, 50 * FRAME, 10 * FRAME]
    assert stt.errors == {} and turns.dropped == 0


async def test_one_session_with_too_many_turns_still_being_recognized_gets_stt_busy_for_the_next():
    recognizer = HeldRecognizer()
    stt = SpeechToText(recognizer, max_concurrent=2, timeout_s=30.0, max_turn_s=30.0)
    events: list[dict] = []
    turns = TurnTranscriber(stt, events.append, lookback_ms=lambda: LOOKBACK_MS)
    for k in range(MAX_PENDING_PER_SESSION + 1):  # short turns, a second apart, none recognized yet
        short_turn(turns, k)
    await settle()
    # The fifth turn is refused at once, with its span; the four before it wait for the recognizer.
    assert [(e["type"], e.get("code")) for e in events] == [("error", "stt_busy")]
    assert (events[0]["start_ms"], events[0]["end_ms"]) == (3900, 4900)
    assert stt.errors == {"stt_busy": 1} and turns.dropped == 1
    recognizer.release.set()
    await asyncio.gather(*turns._pending)
    assert [e["type"] for e in events[1:]] == ["speech.transcript"] * MAX_PENDING_PER_SESSION
    assert [e["start_ms"] for e in events[1:]] == sorted(e["start_ms"] for e in events[1:])
    # Caught up: the next turn is recognized again.
    short_turn(turns, MAX_PENDING_PER_SESSION + 1)
    await asyncio.gather(*turns._pending)
    assert events[-1]["type"] == "speech.transcript" and stt.errors == {"stt_busy": 1}


async def test_turns_beyond_what_the_process_may_keep_waiting_get_stt_busy_and_the_rest_are_recognized():
    recognizer = HeldRecognizer()
    stt = SpeechToText(recognizer, max_concurrent=1, timeout_s=30.0, max_turn_s=30.0)
    assert stt.max_waiting == WAITING_PER_SLOT
    sessions = 5  # 5 x 4 turns: one recognized, 16 waiting, 3 refused
    events: list[list[dict]] = [[] for _ in range(sessions)]
    transcribers = [TurnTranscriber(stt, out.append, lookback_ms=lambda: LOOKBACK_MS) for out in events]
    for k in range(MAX_PENDING_PER_SESSION):
        for turns in transcribers:
            short_turn(turns, k)
        await settle()
    total = sessions * MAX_PENDING_PER_SESSION
    # One turn at the recognizer, 16 waiting for it; the last three were refused at once, but their
    # errors wait for their sessions' earlier turns, so that each session's events stay in order.
    assert (stt.running, stt.waiting, len(recognizer.asked)) == (1, WAITING_PER_SLOT, 1)
    assert not any(events) and stt.errors == {}
    recognizer.release.set()
    await asyncio.gather(*(task for turns in transcribers for task in turns._pending))
    assert stt.errors == {"stt_busy": total - 1 - WAITING_PER_SLOT}
    outcomes = [(e["type"], e.get("code")) for out in events for e in out]
    assert outcomes.count(("error", "stt_busy")) == total - 1 - WAITING_PER_SLOT
    assert outcomes.count(("speech.transcript", None)) == 1 + WAITING_PER_SLOT
    # Each session's events still go out in the order its caller spoke, refused turns in their place.
    for out in events:
        assert len(out) == MAX_PENDING_PER_SESSION
        assert [e["start_ms"] for e in out] == sorted(e["start_ms"] for e in out)
    assert (stt.running, stt.waiting, stt.turns) == (0, 0, 1 + WAITING_PER_SLOT)



async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.01)


async def test_the_gateway_counts_each_turns_outcome_in_metrics():
    """A real gateway with --stt-url at a server that holds every request until told: 5 sessions give
    4 turns each, one at a time reaches the server (--stt-max-concurrent 1), 16 wait, the rest are
    stt_busy; /metrics counts each turn's outcome."""
    release = asyncio.Event()
    requests = []

    async def transcriptions(request: web.Request) -> web.Response:
        requests.append(await request.post())
        await release.wait()
        return web.json_response({"text": "held"})

    standin = web.Application()
    standin.router.add_post("/v1/audio/transcriptions", transcriptions)
    server = TestServer(standin, host="127.0.0.1")
    await server.start_server()
    try:
        async with in_process_gateway(stt_url=str(server.make_url("/v1")), stt_max_concurrent=1) as (app, url):
            stt = app["gateway"].stt
            sessions: list[list[dict]] = [[] for _ in range(5)]
            transcribers = [TurnTranscriber(stt, out.append, lookback_ms=lambda: LOOKBACK_MS) for out in sessions]
            for turns in transcribers:
                short_turn(turns, 0)
            await until(lambda: len(requests) == 1)
            for k in range(1, MAX_PENDING_PER_SESSION):
                for turns in transcribers:
                    short_turn(turns, k)
            await until(lambda: stt.waiting == WAITING_PER_SLOT)
            release.set()
            await asyncio.gather(*(task for turns in transcribers for task in turns._pending))
            async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
                text = await resp.text()
    finally:
        release.set()
        await server.close()
    counted = dict(re.findall(r'^voxgate_stt_turns_total\{outcome="(\w+)"\} (\S+)$', text, re.M))
    assert counted == {"transcript": "17.0", "stt_busy": "3.0", "stt_timeout": "0.0", "stt_failed": "0.0"}, counted
    outcomes = [e.get("code", e["type"]) for out in sessions for e in out]
    assert (outcomes.count("speech.transcript"), outcomes.count("stt_busy"), len(requests)) == (17, 3, 17)
