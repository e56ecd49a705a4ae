"""The speech output (gateway/sessions/session_output.py) alone, without a Session or its queue.

A list of utterances stands in for the queue (what the output asks for, through its callbacks);
the engine stream is test_session.py's FakeStream, so the test decides when audio arrives. The
feeder, the encode pool, libopus and the playout are real.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tests.gateway.test_session import Events, FakeStream, Samples
from voxgate.gateway.media.clock import SessionClock
from voxgate.gateway.media.encoder import OpusSettings
from voxgate.gateway.media.playout import UtterancePlay
from voxgate.gateway.sessions.session_output import SpeechOutput


@dataclass
class Options:
    opus: OpusSettings = field(default_factory=OpusSettings)
    words: bool = True


@dataclass
class Speech:
    id: str
    stream: FakeStream
    play: UtterancePlay
    started_sent: bool = False


class Queue:
    """The utterance queue as the output sees it."""

    def __init__(self) -> None:
        self.utterances: list[Speech] = []
        self.done: list[str] = []
        self.interrupts: list[str] = []

    def add(self, output: SpeechOutput, uid: str) -> FakeStream:
        stream = FakeStream()
        utt = Speech(uid, stream, UtterancePlay(id=uid, ready_at=time.perf_counter()))
        self.utterances.append(utt)
        output.playout.add(utt.play)
        output.wake()
        return stream

    def next_to_feed(self) -> Speech | None:
        return next((u for u in self.utterances if not u.play.input_done), None)

    def finished(self, play: UtterancePlay) -> None:
        self.utterances = [u for u in self.utterances if u.play is not play]
        self.done.append(play.id)


def make() -> tuple[SpeechOutput, Queue, Events, Samples]:
    queue, events, samples = Queue(), Events(), Samples()
    output = SpeechOutput("test", options=Options(), clock=SessionClock(), metrics=samples, emit=events,
                          next_utterance=queue.next_to_feed, on_done=queue.finished, interrupt=queue.interrupts.append)
    return output, queue, events, samples


async def play_until(output: SpeechOutput, events: Events, kind: str) -> int:
    for frames in range(2000):
        if events.of(kind):
            return frames
        output.playout.next_frame()
        await asyncio.sleep(0.001)  # lets the encode pool's results come back
    raise AssertionError(f"no {kind}: {events}")


async def test_it_plays_what_the_queue_hands_it_and_says_when_each_is_done():
    output, queue, events, samples = make()
    stream = queue.add(output, "a")  # queued before anything is attached: nothing feeds it yet
    await asyncio.sleep(0.01)
    assert not output.has_output and events == []
    output.attach("opus")
    assert output.has_output and output.wire_rate() == output.encoder.sample_rate
    stream.say(["one", "two"])
    stream.finish()
    await play_until(output, events, "utterance.done")
    assert [e["type"] for e in events] == ["utterance.started", "audio.started", "audio.words", "utterance.done"]
    assert [w["word"] for w in events.of("audio.words")[0]["words"]] == ["one", "two"]
    assert events.of("utterance.done")[0]["text"] == "one two" and events.of("utterance.done")[0]["audio_ms"] >= 400
    assert queue.done == ["a"] and queue.utterances == [] and len(samples.ttfa_s) == 1
    assert output.playing_id() is None


async def test_a_restart_after_a_cancel_takes_a_fresh_encoder_and_times_the_silence():
    output, queue, events, samples = make()
    cancels: list[float] = []
    samples.cancel_to_silence = cancels.append  # type: ignore[method-assign]
    output.attach("opus")
    stream = queue.add(output, "a")
    stream.say(["one", "two", "three"])
    await play_until(output, events, "audio.started")
    assert output.playing_id() == "a"
    encoder, feeder = output.encoder, output.feeder
    cancelled_at = time.perf_counter()
    output.playout.clear()
    queue.utterances.clear()
    output.restart(cancelled_at)
    assert output.encoder is not encoder and output.feeder is not feeder
    await asyncio.sleep(0)
    assert feeder is not None and feeder.task.done()
    output.on_departure(cancelled_at + 0.03)  # the next frame out is silence: 30 ms after the cancel
    output.on_departure(cancelled_at + 0.05)  # and only the first counts
    assert len(cancels) == 1 and abs(cancels[0] - 0.03) < 1e-6
    output.close()
    output.restart()  # closed: nothing starts again
    await asyncio.sleep(0)
    assert output.feeder is not None and output.feeder.task.done()
