"""The CosyVoice 2 adapter, against a stand-in of its API (the real model is not run here)."""

import os
import sys

import numpy as np
import pytest

from voxgate.config import settings_from
from voxgate.engine import tone
from voxgate.engine.base import EngineError, SynthesisOptions
from voxgate.engine.runtime.client import EngineClient, EngineConfig
from voxgate.engine.torch_voices.cosyvoice2 import CosyVoice2Engine

STAND_INS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "stand_ins")


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(STAND_INS)
    monkeypatch.setenv("PYTHONPATH", STAND_INS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("VOXGATE_COSYVOICE_MODEL", str(tmp_path))
    monkeypatch.setenv("VOXGATE_COSYVOICE_PROMPT_WAV", str(tmp_path / "prompt.wav"))
    monkeypatch.setenv("VOXGATE_COSYVOICE_PROMPT_TEXT", "a prompt")
    monkeypatch.setenv("VOXGATE_ENGINE", "cosyvoice2")
    # The variables reach the engine as settings do, through voxgate/config.py.
    yield settings_from().engine_options
    for name in list(sys.modules):
        if name.startswith("cosyvoice"):
            del sys.modules[name]


def test_zero_shot_streams_chunks_with_words_timed(stand_in):
    engine = CosyVoice2Engine(device="cpu", **stand_in)
    engine.load()
    assert engine.sample_rate() == 24000 and engine.voices()[0] == "prompt"
    chunks = list(engine.synthesize("Hello from the stand-in.", SynthesisOptions()))
    assert len(chunks) == 4 and [c.unit_end for c in chunks] == [False, False, False, True]
    pcm = np.concatenate([c.pcm for c in chunks])
    assert tone.decode(pcm, 24000) == "Hello from the stand-in."
    words = chunks[-1].words
    assert [w.text for w in words] == ["Hello", "from", "the", "stand-in."]
    assert words[0].start == pytest.approx(-len(pcm) / 24000, abs=1e-3)  # timed back from the unit's end
    from cosyvoice.cli.cosyvoice import CALLS

    assert ("zero_shot", "Hello from the stand-in.", "a prompt", True) in CALLS


def test_builtin_speaker_uses_sft(stand_in):
    engine = CosyVoice2Engine(**stand_in)
    engine.load()
    chunks = list(engine.synthesize("Hi.", SynthesisOptions(voice="英文男")))
    assert tone.decode(np.concatenate([c.pcm for c in chunks]), 24000) == "Hi."


def test_missing_model_dir_and_missing_package_say_what_to_do(monkeypatch):
    with pytest.raises(EngineError, match="--cosyvoice-model DIR .*VOXGATE_COSYVOICE_MODEL"):
        CosyVoice2Engine().load()
    monkeypatch.setitem(sys.modules, "cosyvoice", None)
    with pytest.raises(EngineError, match="CosyVoice installed"):
        CosyVoice2Engine(model_dir="/nonexistent").load()


async def test_through_the_worker_process(stand_in):
    client = EngineClient(EngineConfig(engine="cosyvoice2", parallel=1, engine_options=stand_in))
    await client.start()
    try:
        assert client.info["engine"] == "cosyvoice2" and client.info["sample_rate"] == 24000
        stream = client.stream()
        stream.push_text("Streamed through the worker. And a second sentence here.")
        stream.end_input()
        chunks = [c async for c in stream]
        text = tone.decode(np.concatenate([c.pcm for c in chunks]), 24000)
        assert text == "Streamed through the worker. And a second sentence here."
    finally:
        await client.close()
