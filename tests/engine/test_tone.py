"""The tone test engine (engine/tone.py): text in, decodable symbols out, each made once."""

from __future__ import annotations

import numpy as np

from voxgate.engine import tone


def test_every_byte_decodes_back_at_each_rate():
    text = bytes(range(256)).decode("latin-1")  # every byte value, as UTF-8 pairs above 127
    for rate in (16000, 24000, 48000):
        assert tone.decode(tone.encode(text, rate), rate) == text


def test_encode_is_the_symbols_in_order():
    text = "Hé, 9!"
    expected = np.concatenate([tone.symbol(b) for b in text.encode("utf-8")])
    assert np.array_equal(tone.encode(text), expected)
    assert len(tone.encode(text)) == round(len(text.encode("utf-8")) * tone.SYMBOL_S * tone.SAMPLE_RATE)


def test_a_caller_changing_its_audio_does_not_change_the_next_callers():
    """The symbols are cached for the process; what encode() returns is the caller's own."""
    first = tone.encode("a")
    first[:] = 0
    again = tone.encode("a")
    assert again.any() and np.array_equal(again, tone.symbol(ord("a")))


def test_empty_text_is_no_audio():
    assert tone.encode("").size == 0
