"""The unit cap: no text, tags included, becomes an unbounded engine step.

The security regression (issue 12): an unclosed `<` followed by 2,000
characters made the segmenter hand the engine one 2,001-character unit, which
took 18 s to synthesize while another session's "Hi." waited 17 s.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from voxgate.engine.base import SynthesisOptions
from voxgate.engine.runtime.client import EngineClient, EngineConfig
from voxgate.engine.text.segmenter import Segmenter, SegmenterConfig
from voxgate.engine.text.units import MAX_UNIT_CHARS, MAX_UNIT_PHONEMES, cap_phonemes, cap_text
from voxgate.engine.piper.windows import FIRST_WINDOW_FRAMES, MAX_WINDOW_FRAMES
from tests.speech import the_voice

HOSTILE = "<" + " ".join(f"word{i}" for i in range(400))[:2000]
# What the worker test speaks: two caps' worth of the same text (about 65 s of audio,
# several seconds of synthesis). The whole of HOSTILE is 330 s of audio, 28 s of synthesis.
HOSTILE_SPOKEN = HOSTILE[: 2 * MAX_UNIT_CHARS]
# One window at most: the largest, plus a folded-in tail shorter than half a first window.
LONGEST_CHUNK = (MAX_WINDOW_FRAMES + FIRST_WINDOW_FRAMES // 2) * 256


def segment(text: str, step: int) -> list:
    seg = Segmenter()
    units = []
    for i in range(0, len(text), step):
        units += seg.push(text[i : i + step])
    return units + seg.end()


def test_an_unclosed_tag_is_cut_at_the_cap_pushed_whole_or_piece_by_piece():
    for step in (len(HOSTILE), 7, 1):
        units = segment(HOSTILE, step)
        assert "".join(u.raw for u in units) == HOSTILE
        assert len(units) >= len(HOSTILE) // MAX_UNIT_CHARS
        assert all(len(u.raw) <= MAX_UNIT_CHARS for u in units), (step, max(len(u.raw) for u in units))
        assert all(u.raw.endswith(" ") for u in units[:-1])  # cut between words


def test_a_tag_that_closes_past_the_cap_is_cut_too():
    text = "Hello there <prosody rate='slow' " + "x" * 300 + "> and then some more words."
    units = segment(text, 5)
    assert all(len(u.raw) <= SegmenterConfig().max_chars for u in units)
    assert "".join(u.raw for u in units) == text


def test_a_short_tag_still_waits_for_its_end():
    seg = Segmenter()
    assert seg.push("Hello there, <break time=") == [] or seg.pending.startswith("<break")
    assert "<break" in seg.pending


def test_cap_text_cuts_after_a_space_and_loses_nothing():
    text = " ".join(["abcdefg"] * 100)
    pieces = cap_text(text, 50)
    assert "".join(pieces) == text
    assert all(len(p) <= 50 for p in pieces)
    assert all(p.endswith(" ") for p in pieces[:-1])
    # No space at all: a hard cut, still bounded.
    assert [len(p) for p in cap_text("x" * 120, 50)] == [50, 50, 20]


def test_cap_phonemes_cuts_at_word_gaps():
    phonemes = list("ab cd ef gh ij kl mn op")
    pieces = cap_phonemes(phonemes, 7)
    assert sum(pieces, []) == phonemes
    assert all(len(p) <= 7 for p in pieces)
    assert all(p[-1] == " " for p in pieces[:-1])


def test_the_engine_caps_text_that_skipped_the_segmenter():
    """Numbers expand: 60 characters of digits are hundreds of phonemes. No encoder
    pass sees more than the cap, and the audio still says all of it."""
    engine = the_voice()
    text = " ".join(["987654321987654321"] * 3) + ". " + "word " * 50
    job = engine.start(text, SynthesisOptions())
    assert all(len(p) <= MAX_UNIT_CHARS for p in job.pieces) and len(job.pieces) > 1
    sentences, chunks = {}, []
    while not job.done:
        chunk = engine.step([job])[0]
        if job.current is not None:  # the sentence this step encoded or windowed
            sentences[id(job.current)] = len(job.current.phonemes)
        if chunk is not None:
            chunks.append(chunk)
    assert len(sentences) > 2 and max(sentences.values()) <= MAX_UNIT_PHONEMES
    assert max(len(c.pcm) for c in chunks) <= LONGEST_CHUNK
    assert chunks[-1].unit_end and not any(c.unit_end for c in chunks[:-1])


async def _ttfa(client: EngineClient, text: str) -> tuple[float, list]:
    stream = client.stream(SynthesisOptions())
    t0 = time.perf_counter()
    stream.push_text(text)
    stream.end_input()
    first = None
    chunks = []
    async for chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
        chunks.append(chunk)
    return first, chunks


async def test_hostile_unclosed_tag_does_not_delay_another_sessions_first_audio():
    """Real worker, real voice, two cores' worth of steps (the default).

    "Hi." alone, then "Hi." while another stream speaks the hostile text as
    fast as the worker makes it (its reader never waits, the worst case), once
    it is well into it (3 s of audio out). The ratio of the medians must stay
    within 2x (it was 350x before the cap).
    """
    client = EngineClient(EngineConfig(engine="piper", parallel=2))
    await client.start()
    try:
        # Alone before and after the hostile stream, so that drift in the
        # machine's speed shows in both medians alike.
        alone = [(await _ttfa(client, "Hi."))[0] for _ in range(3)]
        hostile = client.stream(SynthesisOptions())
        hostile.push_text(HOSTILE_SPOKEN)
        hostile.end_input()
        hostile_chunks = []
        progress = asyncio.Event()

        async def read_hostile():
            async for chunk in hostile:
                hostile_chunks.append(chunk)
                progress.set()

        def hostile_audio_s() -> float:
            return sum(c.duration for c in hostile_chunks)

        reader = asyncio.ensure_future(read_hostile())
        while hostile_audio_s() < 3.0:
            progress.clear()
            await asyncio.wait_for(progress.wait(), 60)
        loaded = []
        for _ in range(3):
            ttfa, _ = await _ttfa(client, "Hi.")
            loaded.append(ttfa)
            assert not reader.done(), "the hostile text must still be speaking"
            progress.clear()  # and it goes on speaking between the "Hi."s
            await asyncio.wait_for(progress.wait(), 60)
        await asyncio.wait_for(reader, 300)
        alone += [(await _ttfa(client, "Hi."))[0] for _ in range(3)]
    finally:
        await client.close()
    ratio = statistics.median(loaded) / statistics.median(alone)
    assert ratio <= 2.0, (alone, loaded)
    # The hostile text went through in bounded steps: capped units, bounded windows.
    by_unit: dict[int, str] = {}
    for chunk in hostile_chunks:
        by_unit[chunk.unit_index] = by_unit.get(chunk.unit_index, "") + chunk.text
        assert len(chunk.pcm) <= LONGEST_CHUNK
    assert len(by_unit) >= len(HOSTILE_SPOKEN) // MAX_UNIT_CHARS
    assert all(len(" ".join(text.split())) <= MAX_UNIT_CHARS for text in by_unit.values())
    words = " ".join(by_unit[i] for i in sorted(by_unit)).split()
    assert words[-1] == HOSTILE_SPOKEN.split()[-1] and len(words) == len(HOSTILE_SPOKEN.split())
    assert np.concatenate([c.pcm for c in hostile_chunks]).size > 0
