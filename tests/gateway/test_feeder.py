"""The feeder's audio path (gateway/feeder.py): what it keeps back from the listener.

The engine worker schedules by when a listener runs out of audio; the feeder
tells it how much of the audio sent the listener cannot hear yet
(`listener_lag_s`). Checked here against the real resampler and framer fed
the way an engine feeds them: a first window, then longer windows.
"""

from __future__ import annotations

import numpy as np
import pytest

from voxgate.gateway.encoder import OpusSettings
from voxgate.gateway.feeder import listener_lag_s
from voxgate.gateway.frames import FRAME_S, Framer
from voxgate.gateway.resample import StreamResampler, held_back_s


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
