"""The embedded Piper voice on onnxruntime."""

import numpy as np
import pytest

from voxgate.engine.base import EngineError, SynthesisOptions
from voxgate.engine.piper.piper_engine import PiperEngine, choose_providers
from tests.speech import recognize, the_voice, word_error_rate


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    return the_voice()


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
    chunks = synth(engine, text)
    assert len(chunks) > 1  # streamed inside the sentence
    # Each chunk times its words from its own start; lay them on the unit's clock.
    words, offset = [], 0.0
    for chunk in chunks:
        words += [(w.text, offset + w.start, offset + w.end) for w in chunk.words]
        assert all(0.0 <= w.start < chunk.duration + 1e-6 for w in chunk.words[:-1] if chunk is not chunks[-1])
        offset += chunk.duration
    assert [w for w, _, _ in words] == text.split()
    assert "".join(c.text for c in chunks).split() == text.split()
    starts = [s for _, s, _ in words]
    assert starts == sorted(starts)
    assert all(e > s for _, s, e in words)
    assert words[-1][2] <= offset + 0.05


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
