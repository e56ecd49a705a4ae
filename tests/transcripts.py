"""Caller turns for the recognizer (gateway/caller/stt.py): the corpus's espeak-ng callers, and WER over turns."""

from __future__ import annotations

import numpy as np

from tests.listening_corpus import INTERRUPTIONS, espeak
from tests.speech import word_error_rate, words

# The corpus's espeak-ng voices that pocketsphinx's US English model hears best (none is the bot's).
STT_VOICES = ("en-us+klatt", "en-us+klatt2", "en-us+f2")
# What callers ask a phone bot, besides the corpus's interruptions.
QUESTIONS = (
    "What time does the store open tomorrow?",
    "I would like to check the status of my order.",
    "Can you tell me how much the new plan costs?",
    "I want to cancel my appointment on Friday.",
    "Is there a pharmacy near the train station?",
    "How long will the delivery take?",
    "Please send the receipt to my email address.",
    "My card was charged twice this month.",
    "Do you have any tables free tonight at eight?",
    "I need to change the address on my account.",
)
# Turns pocketsphinx gets word for word offline, in three voices: through the live path, a word
# lost on the way shows as an error (the fast test's turns; the bench takes every turn).
CLEAR_TURNS = (
    ("Actually, I would rather talk about something else.", "en-us+f2"),
    ("I want to cancel my appointment on Friday.", "en-us+klatt2"),
    ("Is there a pharmacy near the train station?", "en-us+klatt"),
    ("My card was charged twice this month.", "en-us+klatt2"),
)
GAP_S = 1.2  # silence after a turn: past the VAD's hangover (500 ms), so each phrase is a turn of its own


def every_turn() -> list[tuple[str, str]]:
    """(phrase, voice): every interruption and question of the corpus in every STT voice."""
    return [(phrase, voice) for voice in STT_VOICES for phrase in INTERRUPTIONS + QUESTIONS]


def turn_audio(phrase: str, voice: str, rate: int) -> np.ndarray:
    """One caller turn as a microphone sends it: 300 ms of silence, the phrase, GAP_S of silence."""
    return np.concatenate([np.zeros(int(0.3 * rate), np.int16), espeak(phrase, voice, rate),
                           np.zeros(int(GAP_S * rate), np.int16)])


def corpus_wer(references: list[str], hypotheses: list[str]) -> float:
    """Word errors over all turns, per reference word."""
    errors = sum(word_error_rate(r, h) * len(words(r)) for r, h in zip(references, hypotheses))
    return errors / max(1, sum(len(words(r)) for r in references))


def espeak_paused(first: str, second: str, voice: str, rate: int, pause_ms: int) -> np.ndarray:
    """One sentence spoken with a pause inside it ("I'd like to book ... a table for two."): espeak-ng's
    SSML break, so the intonation runs on through the pause as a person's does; at the corpus's level."""
    import io
    import subprocess
    import wave

    import soxr

    from tests.listening_corpus import SPEECH_RMS, _to_level, _trim

    ssml = f'<speak>{first} <break time="{int(pause_ms)}ms"/> {second}</speak>'
    out = subprocess.run(["espeak-ng", "-m", "-v", voice, "-s", "175", "--stdout", ssml],
                         check=True, capture_output=True, timeout=30).stdout
    with wave.open(io.BytesIO(out)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        native = w.getframerate()
    pcm = _trim(soxr.resample(pcm.astype(np.float32), native, rate), rate)
    return _to_level(pcm, rate, SPEECH_RMS)
