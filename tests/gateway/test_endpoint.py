"""The end of a turn as a decision (gateway/caller/endpoint.py), with the real VAD and the real Whisper recognizer.

A caller's microphone is fed in real time, frame by frame, through the VAD
into a session's transcriber and endpointer, wired as gateway/sessions/session.py does.
A turn that reads as finished ends after the short silence; a pause inside a
sentence whose text does not read as finished does not end it; partial
transcripts come during a long turn, one decode at a time.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from voxgate.gateway.caller.endpoint import FALLING_ST, Endpointer, TurnSettings, end_pitch_st, judge, reads_finished
from voxgate.gateway.caller.stt import SpeechToText, TurnTranscriber
from voxgate.gateway.caller.stt_whisper import Whisper
from voxgate.gateway.caller.vad import VoiceActivityDetector

from tests.listening_corpus import espeak
from tests.transcripts import espeak_paused

FRAME = 320  # 20 ms at 16 kHz


@pytest.fixture(scope="module")
def stt() -> SpeechToText:
    return SpeechToText(Whisper(workers=2), max_concurrent=2)


class Caller:
    """A microphone into the VAD, transcriber and endpointer, as gateway/sessions/session.py wires them."""

    def __init__(self, stt: SpeechToText, settings: TurnSettings) -> None:
        self.events: list[tuple[float, dict]] = []
        self.vad = VoiceActivityDetector()
        self.vad.pause_ms = settings.pause_ms
        self.transcriber = TurnTranscriber(stt, self.emit, lookback_ms=lambda: 400)
        self.endpointer = Endpointer(self.transcriber, settings, self.emit, lambda: self.vad.speaking)
        self.ms = 0.0
        self.speech_ended_at: float | None = None

    def emit(self, event: dict) -> None:
        self.events.append((time.perf_counter(), event))

    async def say(self, pcm: np.ndarray) -> None:
        """The audio, one frame every 20 ms of this loop's time (as a microphone's)."""
        began = time.perf_counter()
        for i in range(0, len(pcm) - FRAME + 1, FRAME):
            frame = pcm[i : i + FRAME]
            self.transcriber.frame(frame, self.ms)
            self.endpointer.frame(self.ms)
            for event in self.vad.process(frame):
                self.endpointer.event(event, int(self.ms) + 20)
            self.ms += 20
            await asyncio.sleep(max(0.0, began + (i + FRAME) / 16000 - time.perf_counter()))

    def finals(self) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in self.events if e["type"] == "speech.transcript" and e["final"]]


def test_the_text_rule():
    assert reads_finished("I want to cancel my appointment on Friday.")
    assert reads_finished("What time do you close?")
    for unfinished in ("I'd like to book", "My order was...", "I want to", "Yes, and", "So, um.", "because.", "Hmm,"):
        assert not reads_finished(unfinished), unfinished
    assert reads_finished("yes i want to cancel it", punctuated=False)
    assert not reads_finished("yes i want to", punctuated=False)
    # Long sentences read as finished; short ones may be the start of one (bench/bench_turn_rule.py).
    assert judge("I want to cancel my appointment on Friday.") == "finished"
    assert judge("Can you tell me how much the new plan costs?") == "finished"
    assert judge("I need to change.") == "pitch"
    assert judge("Hello. I want to cancel.") == "pitch"
    assert judge("Could you send?") == judge("Can you tell me?") == "short"
    assert judge("What time is it?") == "finished"
    assert judge("I'd like to book") == "unfinished"
    assert judge("yes i want to cancel it", punctuated=False) == "finished"


@pytest.mark.parametrize("voice", ["en-us", "en-gb+f3", "en-us-nyc+m5"])
def test_a_statements_pitch_falls_at_its_end_and_not_at_a_pause_inside_it(voice):
    assert end_pitch_st(espeak("I want to cancel my appointment on Friday.", voice, 16000)) < FALLING_ST
    paused = espeak_paused("I need to change", "the address on my account.", voice, 16000, 600)
    level = np.convolve(np.abs(paused.astype(np.int32)) > 300, np.ones(16 * 300), "same")
    pause = int(np.flatnonzero((level == 0) & (np.arange(len(paused)) > 4800))[0])  # 300 ms of quiet
    assert end_pitch_st(paused[:pause]) > FALLING_ST


async def test_a_finished_turn_ends_after_the_short_silence_and_an_unfinished_pause_does_not(stt):
    settings = TurnSettings(min_silence_ms=250, max_silence_ms=2500, partial_ms=0)
    caller = Caller(stt, settings)
    silence = np.zeros(16000 * 3, np.int16)
    await caller.say(np.zeros(8000, np.int16))
    # The caller pauses 700 ms inside a sentence, on words that do not read as finished.
    await caller.say(espeak_paused("I'd like to book", "a table for two.", "en-us", 16000, 700))
    ended = time.perf_counter()
    speaking = asyncio.ensure_future(caller.say(silence))
    while not caller.finals() and not speaking.done():
        await asyncio.sleep(0.02)
    speaking.cancel()
    finals = caller.finals()
    assert len(finals) == 1, caller.events
    at, event = finals[0]
    assert "like" in event["text"].lower() and "table" in event["text"].lower(), event  # both halves
    # Ended by the rule (finished, or a statement whose pitch stayed level: halfway), not the longest silence.
    print(f"\nfinal {(at - ended) * 1000:.0f} ms after the speech ended: {event['text']!r}; {caller.endpointer.decided}")
    assert at - ended < 0.8 * settings.max_silence_ms / 1000, (at - ended, caller.endpointer.decided)
    assert caller.endpointer.decided["finished"] + caller.endpointer.decided["level"] == 1


async def test_a_turn_that_does_not_read_as_finished_waits_for_the_longest_silence(stt):
    settings = TurnSettings(min_silence_ms=250, max_silence_ms=1200, partial_ms=0)
    caller = Caller(stt, settings)
    await caller.say(np.zeros(8000, np.int16))
    await caller.say(espeak("My order was, um", "en-us", 16000))
    ended = time.perf_counter()
    speaking = asyncio.ensure_future(caller.say(np.zeros(16000 * 3, np.int16)))
    while not caller.finals() and not speaking.done():
        await asyncio.sleep(0.02)
    speaking.cancel()
    at, event = caller.finals()[0]
    print(f"\nfinal {(at - ended) * 1000:.0f} ms after the speech ended: {event['text']!r}")
    assert caller.endpointer.decided["unfinished"] == 1
    assert at - ended > 0.9 * settings.max_silence_ms / 1000 - 0.1, (at - ended)


async def test_partials_come_during_a_long_turn_one_decode_at_a_time(stt):
    settings = TurnSettings(min_silence_ms=250, max_silence_ms=1200, partial_ms=400)
    caller = Caller(stt, settings)
    in_flight = []
    recognize = stt.recognize

    async def counted(pcm, owner=None):
        in_flight.append(stt.running)
        return await recognize(pcm, owner)

    stt.recognize = counted  # type: ignore[method-assign]
    try:
        await caller.say(np.zeros(8000, np.int16))
        await caller.say(espeak("Can you tell me how much the new plan costs per month?", "en-us", 16000))
        while not caller.finals():
            await caller.say(np.zeros(3200, np.int16))
    finally:
        del stt.recognize
    partials = [e for _, e in caller.events if e["type"] == "speech.transcript" and not e["final"]]
    assert len(partials) >= 2, caller.events
    assert all(e["text"] for e in partials)
    assert [e["end_ms"] for e in partials] == sorted(e["end_ms"] for e in partials)
    # Never two of this session's at once: a partial starts only with nothing of it in flight.
    assert max(in_flight) <= 1, in_flight
    assert caller.events[-1][1]["final"] is True


async def test_a_pause_longer_than_the_vads_hangover_on_a_finished_looking_word_is_still_a_pause(stt):
    # "I need to change." reads as finished, its pitch level: it waits halfway (725 ms); the caller goes on at
    # 700 ms, past the VAD's hangover (500 ms), so its first voiced frame (speech.resumed), not a speech.started
    # 200 ms later, is what keeps the turn open.
    settings = TurnSettings(min_silence_ms=250, max_silence_ms=1200, partial_ms=0)
    caller = Caller(stt, settings)
    await caller.say(np.zeros(8000, np.int16))
    await caller.say(espeak_paused("I need to change", "the address on my account.", "en-us", 16000, 700))
    while not caller.finals():
        await caller.say(np.zeros(3200, np.int16))
    await caller.say(np.zeros(16000, np.int16))
    finals = [e["text"] for _, e in caller.finals()]
    assert len(finals) == 1 and "address" in finals[0].lower(), (finals, caller.endpointer.decided)
