"""The feeder's audio path (gateway/media/feeder.py): what it keeps back from the listener.

The engine worker schedules by when a listener runs out of audio; the feeder
tells it how much of the audio sent the listener cannot hear yet
(`listener_lag_s`). Checked here against the real resampler and framer fed
the way an engine feeds them: a first window, then longer windows.
"""

from __future__ import annotations

import numpy as np
import pytest

from voxgate.gateway.media.encoder import OpusSettings
from voxgate.gateway.media.feeder import KEEP_MS, MAX_TRIM_MS, SILENCE_LEVEL, LeadingSilence, listener_lag_s
from voxgate.gateway.media.frames import FRAME_S, Framer
from voxgate.gateway.media.resample import StreamResampler, held_back_s


@pytest.mark.parametrize("engine_rate", [16000, 22050])
def test_the_lag_is_what_the_resampler_and_framer_keep_on_average(engine_rate):
    wire_rate = OpusSettings().input_rate
    resampler, framer = StreamResampler(engine_rate, wire_rate), Framer(wire_rate)
    rng = np.random.default_rng(1)
    sent_s = heard_s = 0.0
    lags = []
    # Piper's windows: 12 frames of 256 samples first, then larger ones, as a sentence grows.
    for frames in [12, 48, 192, 256, 256, 37, 12, 48, 100, 256]:
        pcm = (rng.standard_normal(frames * 256) * 3000).astype(np.int16)
        sent_s += len(pcm) / engine_rate
        heard_s += len(framer.push(resampler.process(pcm))) / wire_rate
        lags.append(sent_s - heard_s)
    lag = listener_lag_s(engine_rate, wire_rate)
    # On average within 5 ms (16,000 Hz: 26.4 against 29.6 ms; 22,050: 41.1 against 40.1), and the
    # most ever kept is at most 20 ms more (the resampler's block swings).
    assert abs(np.mean(lags) - lag) < 0.006 and max(lags) < lag + 0.025, (lags, lag)


def test_nothing_is_held_at_the_wire_rate_but_part_of_a_frame():
    assert held_back_s(24000, 24000) == 0.0
    assert listener_lag_s(24000, 24000) == pytest.approx(FRAME_S / 2)
    assert held_back_s(22050, 24000) > 0.005


RATE = 22050


def tone(ms: float, level: float = 3000.0) -> np.ndarray:
    t = np.arange(int(RATE * ms / 1000)) / RATE
    return (level * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


def silence(ms: float) -> np.ndarray:
    return np.zeros(int(RATE * ms / 1000), np.int16) + np.int16(2)  # the voice's own: within +-2


def onset(pcm: np.ndarray) -> int:
    return int(np.flatnonzero(np.abs(pcm.astype(np.int32)) > SILENCE_LEVEL)[0])


def test_an_utterances_leading_silence_is_cut_keeping_a_few_ms_before_the_onset():
    lead = LeadingSilence(RATE)
    speech = tone(100)
    out = lead.cut(np.concatenate([silence(45), speech]))
    keep = int(RATE * KEEP_MS / 1000)
    assert onset(out) == keep and len(out) == keep + len(speech) - onset(speech)
    assert lead.trimmed == len(silence(45)) + onset(speech) - keep
    later = silence(30)
    assert np.array_equal(lead.cut(later), later)  # once: a pause inside the utterance stays


def test_a_chunk_of_silence_alone_is_held_and_the_onset_still_keeps_its_few_ms():
    lead = LeadingSilence(RATE)
    assert len(lead.cut(silence(40))) == 0
    out = lead.cut(np.concatenate([np.full(10, 2, np.int16), tone(50)]))
    keep = int(RATE * KEEP_MS / 1000)
    assert onset(out) == keep
    assert lead.trimmed == len(silence(40)) + 10 + onset(tone(50)) - keep


def test_no_more_than_max_trim_ms_is_cut_however_quietly_it_begins():
    lead = LeadingSilence(RATE)
    out = lead.cut(silence(MAX_TRIM_MS + 300))
    assert lead.trimmed_s == pytest.approx(MAX_TRIM_MS / 1000, abs=0.001)
    assert lead.done and len(out) == len(silence(MAX_TRIM_MS + 300)) - lead.trimmed


async def test_the_feeder_cuts_the_voices_leading_silence_and_moves_the_words_back_with_it():
    """The real voice's chunks through the feeder: the frames it queues start at the speech, and the words'
    times are on those frames (what played_text and audio.words read), not on the engine's audio."""
    import asyncio
    from types import SimpleNamespace

    from voxgate.engine.base import SynthesisOptions
    from voxgate.engine.stream import StreamChunk
    from voxgate.gateway.media.encoder import OpusEncoder
    from voxgate.gateway.media.feeder import Feeder
    from voxgate.gateway.media.playout import Playout, UtterancePlay
    from voxgate.gateway.media.session_metrics import SessionMetrics

    from tests.speech import the_voice

    chunks = [StreamChunk(pcm=c.pcm, sample_rate=c.sample_rate, text=c.text, words=c.words)
              for c in the_voice().synthesize("Your order ships on Thursday.", SynthesisOptions())]
    engine_first_word_ms = chunks[0].words[0].start * 1000
    assert engine_first_word_ms > 40  # the voice's own leading silence

    class Stream:
        first_text_at = None

        def __aiter__(self):
            return self._chunks()

        async def _chunks(self):
            for chunk in chunks:
                yield chunk

    play = UtterancePlay(id="u")
    playout = Playout(b"")
    playout.add(play)
    utterances = [SimpleNamespace(id="u", stream=Stream(), play=play, started_sent=False)]
    feeder = Feeder(OpusEncoder(), playout, next_utterance=lambda: utterances.pop() if utterances else None,
                    emit=lambda event: None, metrics=SessionMetrics())
    for _ in range(500):
        if play.input_done or feeder.task.done():
            break
        await asyncio.sleep(0.01)
    assert play.input_done, feeder.task.exception() if feeder.task.done() else "still feeding"
    feeder.stop()
    # The words moved back with the cut: the first starts within the kept few ms (and the aligner's own slack
    # before the onset), where the engine had it at 58 ms; every word by the same amount.
    assert play.words[0][1] < 15, play.words[0]
    shift = engine_first_word_ms - play.words[0][1]
    last = chunks[-1].words[-1].end * 1000 + sum(c.duration for c in chunks[:-1]) * 1000  # on the engine's audio
    assert abs(play.words[-1][2] - (last - shift)) < 0.01, (play.words[-1], last, shift)
