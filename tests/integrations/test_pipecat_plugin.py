"""voxgate.integrations.pipecat inside a real pipecat pipeline (pipecat's Pipeline,
PipelineWorker and WorkerRunner), against a real gateway with the embedded voice:
the speech comes back as TTSAudioRawFrames, intelligible, with a TTSTextFrame per
word on the audio's clock, and an interruption cancels the context on the gateway."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("pipecat", reason='the pipecat extra: pip install -e ".[pipecat]"')

from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.tts_service import TextAggregationMode  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from tests.speech import heard_well, recognize, word_error_rate, words  # noqa: E402
from voxgate.integrations.pipecat import VoxgateTTSService  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
RATE = 24000  # pipecat's default output rate: the gateway resamples the voice's 22050 to it


class Collector(FrameProcessor):
    """The end of the pipeline: every downstream frame, with when it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []
        self.started = asyncio.Event()
        self.stopped = asyncio.Event()
        self.first_audio = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append((time.perf_counter(), frame))
            if isinstance(frame, StartFrame):
                self.started.set()
            elif isinstance(frame, TTSAudioRawFrame):
                self.first_audio.set()
            elif isinstance(frame, TTSStoppedFrame):
                self.stopped.set()
        await self.push_frame(frame, direction)

    def of(self, kind) -> list[tuple[float, Frame]]:
        return [(t, f) for t, f in self.frames if isinstance(f, kind)]


async def run_pipeline(tts: VoxgateTTSService, drive) -> Collector:
    """Runs [tts, collector] in pipecat's runner; `drive(worker, collector)` feeds it, then it ends."""
    collector = Collector()
    worker = PipelineWorker(Pipeline([tts, collector]), params=PipelineParams(audio_out_sample_rate=RATE),
                            cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)

    async def feed():
        await asyncio.wait_for(collector.started.wait(), 30)
        try:
            await drive(worker, collector)
        finally:
            await worker.queue_frame(EndFrame())

    await asyncio.wait_for(asyncio.gather(runner.run(), feed()), 60)
    return collector


def spoken(collector: Collector) -> np.ndarray:
    frames = [f for _, f in collector.of(TTSAudioRawFrame)]
    assert all(f.sample_rate == RATE and f.num_channels == 1 for f in frames)
    return np.frombuffer(b"".join(f.audio for f in frames), dtype="<i2")


async def test_a_sentence_speaks_through_a_pipecat_pipeline_with_word_frames(piper_server, first_audio_report):
    tts = VoxgateTTSService(url=piper_server.url)
    sent_at = {}

    async def drive(worker, collector):
        sent_at["t"] = time.perf_counter()
        await worker.queue_frame(TTSSpeakFrame(SENTENCE))
        await asyncio.wait_for(collector.stopped.wait(), 30)

    collector = await run_pipeline(tts, drive)
    assert collector.of(TTSStartedFrame) and collector.of(TTSStoppedFrame)
    audio = collector.of(TTSAudioRawFrame)
    assert len(audio) > 3, "the speech came as one piece, not streamed"
    first_ms = (audio[0][0] - sent_at["t"]) * 1000.0
    first_audio_report["pipecat_first_audio_ms"] = round(first_ms, 1)
    print(f"pipecat plugin: first audio {first_ms:.1f} ms after the TTSSpeakFrame")
    # Streamed: the first audio is through the pipeline long before the last.
    assert audio[0][0] - sent_at["t"] < 0.5 * (audio[-1][0] - sent_at["t"]), (first_ms, audio[-1][0] - sent_at["t"])

    pcm = spoken(collector)
    duration_s = len(pcm) / RATE
    assert 2.0 < duration_s < 8.0, duration_s
    heard = recognize(pcm, RATE)
    assert word_error_rate(SENTENCE, heard) < 0.5, heard

    # One TTSTextFrame per word, in order, on pipecat's clock: spread over the speech.
    texts = collector.of(TTSTextFrame)
    assert words(" ".join(f.text for _, f in texts)) == words(SENTENCE)
    pts = [f.pts for _, f in texts]
    assert all(p is not None for p in pts) and pts == sorted(pts)
    spread_s = (pts[-1] - pts[0]) / 1e9
    assert 0.5 * duration_s < spread_s < duration_s, (spread_s, duration_s)


async def test_an_llm_turn_streamed_token_by_token_is_one_context(piper_server, first_audio_report):
    tts = VoxgateTTSService(url=piper_server.url, text_aggregation_mode=TextAggregationMode.TOKEN)
    reply = "Sure, I can help with that. The meeting moves to Tuesday at noon."
    tokens = [t + " " for t in reply.split()]
    sent_at = {}

    async def drive(worker, collector):
        sent_at["t"] = time.perf_counter()
        await worker.queue_frame(LLMFullResponseStartFrame())
        for token in tokens:
            await worker.queue_frame(LLMTextFrame(token))
        await worker.queue_frame(LLMFullResponseEndFrame())
        await asyncio.wait_for(collector.stopped.wait(), 30)

    collector = await run_pipeline(tts, drive)
    audio = collector.of(TTSAudioRawFrame)
    assert {f.context_id for _, f in audio} == {audio[0][1].context_id}
    first_ms = (audio[0][0] - sent_at["t"]) * 1000.0
    first_audio_report["pipecat_tokens_first_audio_ms"] = round(first_ms, 1)
    print(f"pipecat plugin, token mode: first audio {first_ms:.1f} ms after the turn began")
    pcm = spoken(collector)
    assert heard_well(reply, pcm, RATE), recognize(pcm, RATE)
    assert words(" ".join(f.text for _, f in collector.of(TTSTextFrame))) == words(reply)


async def test_an_interruption_cancels_the_context_and_the_next_turn_speaks(piper_server):
    tts = VoxgateTTSService(url=piper_server.url)
    long_text = " ".join(["This sentence is long, so the listener has time to interrupt it."] * 4)
    second = "Okay, stopping now."
    cancelled = asyncio.Event()
    marks = {}

    async def drive(worker, collector):
        await worker.queue_frame(TTSSpeakFrame(long_text))
        await asyncio.wait_for(collector.first_audio.wait(), 30)
        first_context = collector.of(TTSAudioRawFrame)[0][1].context_id
        await worker.queue_frame(InterruptionFrame())
        # The gateway acknowledges the cancel on the same connection.
        await asyncio.wait_for(cancelled.wait(), 10)
        marks["interrupted"] = len(collector.frames)
        collector.stopped.clear()
        await worker.queue_frame(TTSSpeakFrame(second))
        await asyncio.wait_for(collector.stopped.wait(), 30)
        marks["first"] = first_context

    original = tts._receive_messages

    async def watching():
        # Notes the gateway's `cancelled` as the service's own receive loop reads it.
        ws = tts._get_websocket()
        real_recv = ws.recv

        async def recv(*a, **k):
            message = await real_recv(*a, **k)
            if '"cancelled"' in str(message):
                cancelled.set()
            return message

        ws.recv = recv
        return await original()

    tts._receive_messages = watching
    collector = await run_pipeline(tts, drive)
    after = [f for _, f in collector.frames[marks["interrupted"]:] if isinstance(f, TTSAudioRawFrame)]
    assert after and all(f.context_id != marks["first"] for f in after), "audio of the cancelled turn came after it"
    heard = recognize(np.frombuffer(b"".join(f.audio for f in after), dtype="<i2"), RATE)
    assert word_error_rate(second, heard) < 0.5, heard
