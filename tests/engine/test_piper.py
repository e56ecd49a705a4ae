"""The embedded Piper voice on onnxruntime."""

import numpy as np
import pytest

from voxgate.engine.base import EngineError, SynthesisOptions
from voxgate.engine.piper_engine import PiperEngine, choose_providers
from tests.speech import recognize, word_error_rate


@pytest.fixture(scope="module")
def engine():
    e = PiperEngine(threads=1)
    e.load()
    return e


def synth(engine, text, **options):
    return list(engine.synthesize(text, SynthesisOptions(**options)))


def test_speech_is_intelligible(engine):
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    chunks = synth(engine, text)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert chunks[0].sample_rate == 22050
    assert 2.0 < len(pcm) / 22050 < 6.0
    heard = recognize(pcm, 22050)
    assert word_error_rate(text, heard) < 0.4, heard


def test_word_timings_cover_the_words_in_order(engine):
    text = "Please call Stella and ask her to bring these things."
    [chunk] = synth(engine, text)
    assert [w.text for w in chunk.words] == text.split()
    starts = [w.start for w in chunk.words]
    assert starts == sorted(starts)
    assert all(w.end > w.start for w in chunk.words)
    assert chunk.words[-1].end <= chunk.duration + 0.05


def test_speaking_rate_changes_duration(engine):
    text = "This sentence is spoken at two different rates."
    normal = sum(c.duration for c in synth(engine, text))
    fast = sum(c.duration for c in synth(engine, text, rate=2.0))
    assert fast < normal * 0.8  # noise_w makes durations vary a little from run to run


def test_unknown_voice_says_what_to_do(engine):
    with pytest.raises(EngineError, match="embedded"):
        synth(engine, "Hi.", voice="nobody")


def test_cuda_request_without_cuda_is_a_clear_error():
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EngineError, match="--device cpu"):
        choose_providers("cuda")
    assert choose_providers("auto") == ["CPUExecutionProvider"]
