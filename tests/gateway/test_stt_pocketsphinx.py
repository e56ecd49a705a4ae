"""`--stt pocketsphinx` (gateway/caller/stt_pocketsphinx.py): the decoder works in worker processes.

pocketsphinx's decoder holds the GIL while it decodes. Run on a thread of the
gateway's process it stalled the event loop for most of each recognition
(about 1.1 s of a 1.4 s one on this machine), and with it every session's
frames. Here two real turns are recognized at once through the service while
a ticker on the loop measures its longest stall.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from voxgate.gateway.errors import SttError
from voxgate.gateway.caller.stt import SpeechToText
from voxgate.gateway.caller.stt_pocketsphinx import Pocketsphinx, decode

from tests.transcripts import CLEAR_TURNS, turn_audio


async def longest_stall(done: asyncio.Event) -> float:
    """The longest the loop went without running this coroutine, until `done`."""
    longest, last = 0.0, time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


async def recognize_watching_the_loop(stt: SpeechToText, clips: list) -> tuple[list[str], float, float]:
    """The clips recognized at once: (their texts, how long that took, the loop's longest stall meanwhile)."""
    done = asyncio.Event()
    ticker = asyncio.ensure_future(longest_stall(done))
    began = time.perf_counter()
    texts = await asyncio.gather(*(stt.recognize(clip) for clip in clips))
    took = time.perf_counter() - began
    done.set()
    return texts, took, await ticker


async def test_turns_are_decoded_in_worker_processes_and_the_event_loop_stays_free():
    clips = [turn_audio(phrase, voice, 16000) for phrase, voice in CLEAR_TURNS[:2]]
    stt = SpeechToText(Pocketsphinx(workers=2), max_concurrent=2)
    try:
        texts, took, stall = await recognize_watching_the_loop(stt, clips)
    finally:
        await stt.close()
    # The same text as the decoder gives in this process: nothing is lost on the way to a worker.
    assert texts == [" ".join(decode(clip).split()) for clip in clips]
    assert all(texts), texts
    print(f"\ntwo turns recognized in {took * 1000:.0f} ms; the loop's longest stall {stall * 1000:.1f} ms")
    assert stall < 0.1 * took, (stall, took)


async def test_a_worker_that_dies_fails_its_turn_and_the_next_turn_gets_a_fresh_one():
    clip = turn_audio(*CLEAR_TURNS[0], 16000)
    recognizer = Pocketsphinx(workers=1)
    stt = SpeechToText(recognizer, max_concurrent=1)
    try:
        turn = asyncio.ensure_future(stt.recognize(clip))
        await asyncio.sleep(0.05)  # the turn is with the worker
        for pid in list(recognizer._procs._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(SttError) as failed:
            await turn
        assert failed.value.code == "stt_failed"
        assert await stt.recognize(clip) == " ".join(decode(clip).split())
    finally:
        await stt.close()
