"""Issue 53, finding 2: one caller held every recognizer slot, and other callers' turns timed out.

A caller sending loud noise about 15 times faster than real time made one
"turn" of 72 s (pieces were cut by capture time, which follows arrival), and
a turn that timed out gave back its place in the session's queue while its
thread kept the recognizer slot. Here a piece is cut by its count of frames,
and a session holds one slot at most, until its decode really ends, while
another session's turns are recognized in the other. The recognizer is a
stand-in (its threads wait on an event), as in tests/gateway/test_stt.py; the
slots, the cutting and the timeouts are the gateway's own.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from voxgate.gateway.errors import SttError
from voxgate.gateway.caller.stt import SpeechToText, TurnTranscriber

FRAME = 320


class Recognizer:
    """Threaded, like pocketsphinx: the noisy caller's turns (samples of 1) hang until `let_go`."""

    name = "stand-in"
    threaded = True

    def __init__(self) -> None:
        self.let_go = threading.Event()
        self.sizes: list[int] = []

    def recognize(self, pcm: np.ndarray) -> str:
        self.sizes.append(len(pcm) // FRAME)
        if pcm[0] == 1:
            self.let_go.wait(30)
            return "noise"
        return "a question"

    async def recognize_async(self, pcm: np.ndarray) -> str:  # pragma: no cover - threaded
        raise NotImplementedError

    async def close(self) -> None:
        self.let_go.set()


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


async def test_a_session_holds_one_slot_until_its_decode_ends_and_others_are_recognized_meanwhile():
    recognizer = Recognizer()
    stt = SpeechToText(recognizer, max_concurrent=2, timeout_s=0.5)
    noisy, innocent = object(), object()
    noise, question = np.ones(50 * FRAME, np.int16), np.full(50 * FRAME, 2, np.int16)
    try:
        # The noisy caller's turn hangs past its timeout; its thread still decodes, and holds its slot.
        with pytest.raises(SttError) as timed_out:
            await stt.recognize(noise, noisy)
        assert timed_out.value.code == "stt_timeout" and stt.running == 1
        assert await stt.recognize(question, innocent) == "a question"
        # Its next turn waits for that decode to end, so the other slot stays free for the innocent caller.
        second = asyncio.ensure_future(stt.recognize(noise, noisy))
        await asyncio.sleep(0.05)
        assert stt.running == 1 and stt.waiting == 1
        assert await stt.recognize(question, innocent) == "a question"
        with pytest.raises(SttError):
            await second  # timed out waiting: it never reached the recognizer
        assert recognizer.sizes.count(50) == 3
        recognizer.let_go.set()
        await until(lambda: stt.running == 0)
        assert await stt.recognize(noise, noisy) == "noise"  # its slot back once the decode ended
    finally:
        await stt.close()


async def test_a_turn_faster_than_real_time_is_recognized_in_pieces_of_its_frame_count():
    recognizer = Recognizer()
    recognizer.let_go.set()
    stt = SpeechToText(recognizer, max_concurrent=2, timeout_s=10.0, max_turn_s=1.0)
    events: list[dict] = []
    turns = TurnTranscriber(stt, events.append, lookback_ms=lambda: 400)
    pcm = np.full(FRAME, 2, np.int16)
    for i in range(50):  # a second before the turn, in real time
        turns.frame(pcm, 20.0 * i)
    turns.started(1000.0)
    at = 1000.0
    for _ in range(600):  # 12 s of loud noise sent 15 times faster: capture times 1.33 ms apart
        at += 20.0 / 15
        turns.frame(pcm, at)
    turns.stopped(at + 20.0)
    # Pieces of at most --stt-max-turn-s of audio (50 frames), not one 12 s "turn": each piece is a
    # transcript, or stt_busy past the session's 4 pending (all were cut at once here).
    await until(lambda: len(events) >= 12)
    await asyncio.gather(*turns._pending, return_exceptions=True)
    assert recognizer.sizes and max(recognizer.sizes) <= 50
    await stt.close()
