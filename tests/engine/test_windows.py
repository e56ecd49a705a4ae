"""engine.piper.windows: the window schedule's sizes, seams and tails (no model needed)."""

from __future__ import annotations

from voxgate.engine.base import WordTiming
from voxgate.engine.piper.windows import (
    FOLD_COVER, FOLD_FRACTION, WindowSchedule, chunk_text, flow_end, load_factor, says_last_word, words_in_window,
)


def plan(schedule: WindowSchedule, total: int, slack: float | None, load: float = 1.0, context: int = 12) -> list:
    windows, done, index = [], 0, 0
    while done < total:
        w = schedule.next(done, total, index, context, slack, load)
        windows.append(w)
        done, index = w.end, index + 1
    return windows


def test_windows_cover_the_sentence_once_with_context_inside_it():
    for total in (1, 11, 12, 50, 97, 300, 1000):
        for slack in (None, 0.0, 20.0):
            windows = plan(WindowSchedule(), total, slack)
            assert windows[0].start == 0 and windows[-1].end == total
            assert all(a.end == b.start for a, b in zip(windows, windows[1:]))
            assert all(0 <= w.src_start <= w.start < w.end <= w.src_end <= total for w in windows)


def test_a_short_tail_joins_the_window_before_it_once_the_listener_has_audio():
    schedule = WindowSchedule(first=12)  # the figures below are worked out for a first window of 12 frames
    # 20 frames buffered: windows of 6 x 20 = 120 frames. 150 frames would leave a
    # 30-frame tail window that pays 12 frames of context: it is folded in.
    assert [(w.start, w.end) for w in plan(schedule, 150, slack=20.0)] == [(0, 150)]
    # A tail of half the window or more is a window of its own.
    assert [(w.start, w.end) for w in plan(schedule, 120 + 120 // FOLD_FRACTION, slack=20.0)] == [(0, 120), (120, 180)]
    # Later windows of a direct call fold too: 12, then 48 and a 20-frame tail.
    assert [(w.start, w.end) for w in plan(schedule, 80, slack=None)] == [(0, 12), (12, 80)]


def test_a_first_window_with_nothing_buffered_stays_small():
    schedule = WindowSchedule(first=12)  # the figures below are worked out for a first window of 12 frames
    # Nobody has audio yet: a first window keeps its size (here 4 x 12 frames, at
    # 4 streams per core) even when the tail after it is short.
    for slack in (None, 0.0):
        assert plan(schedule, 4 * schedule.first + 20, slack, load=4.0)[0].end == 4 * schedule.first


def test_a_window_under_load_covers_the_other_streams_steps_and_its_own_next():
    # Alone: the first window. Under load: about one step of each other stream
    # on its core, and its own next one.
    assert [load_factor(x) for x in (0.5, 1.0, 1.5, 2.0, 2.5, 4.0)] == [1, 1, 2, 2, 3, 4]
    schedule = WindowSchedule(first=12)
    assert schedule.size(0, None, load=1.0) == 12
    assert schedule.size(0, 0.0, load=2.0) == 24  # 4 streams on 2 cores
    assert schedule.size(1, 0.0, load=2.0) == 24 * 4  # and it grows from there
    assert schedule.size(2, 0.0, load=1.0) == 12 * 16 < schedule.largest
    assert schedule.size(2, 0.0, load=2.0) == schedule.largest  # within the cap


def test_a_tail_the_buffered_audio_does_not_cover_is_not_folded():
    schedule = WindowSchedule(first=12)  # the figures below are worked out for a first window of 12 frames
    # 4 streams per core: a first window of 48 frames (COVER x slack stays under
    # it), a 14-frame tail after it. With a sliver of audio buffered, the step is
    # not made longer for the tail.
    assert plan(schedule, 48 + 14, slack=0.01, load=4.0)[0].end == 48
    # Covered (FOLD_COVER x 7 frames buffered = 14): folded; just short of it: not.
    assert plan(schedule, 48 + 14, slack=14 / FOLD_COVER, load=4.0)[0].end == 62
    assert plan(schedule, 48 + 14, slack=14 / FOLD_COVER - 0.1, load=4.0)[0].end == 48
    # A later window of a listener who has run dry (nothing buffered) is not lengthened either.
    w = schedule.next(done=100, total=100 + 48 + 20, index=1, context=12, slack_frames=0.0, load=1.0)
    assert w.end == 100 + 48


def test_folding_stays_within_the_cap():
    schedule = WindowSchedule(first=12)  # the figures below are worked out for a first window of 12 frames
    # The tail would fit the fold's fraction, but the window would pass the cap.
    windows = plan(schedule, schedule.largest + 40, slack=1000.0)
    assert [w.end - w.start for w in windows] == [schedule.largest, 40]
    # Only the sliver rule (a tail under first // 2) may go past the cap, by that sliver.
    for total in range(schedule.largest, 3 * schedule.largest, 7):
        for slack in (None, 0.0, 20.0, 1000.0):
            for w in plan(schedule, total, slack):
                assert w.end - w.start <= schedule.largest or w.end - w.start < schedule.largest + schedule.first // 2


def test_chunk_texts_join_exactly_when_a_sentences_last_window_says_no_word():
    # The last word starts at 0.5 s, in the second of three windows: the third
    # window holds only its tail. Joined, the chunks must give the sentence with
    # nothing after it (a trailing space had been left on the second chunk).
    words = [WordTiming("Hello", 0.0, 0.3), WordTiming("there.", 0.5, 0.9)]
    bounds = [(0.0, 0.4, False), (0.4, 0.8, False), (0.8, 1.0, True)]
    texts = []
    for t0, t1, last in bounds:
        said = " ".join(w.text for w in words_in_window(words, t0, t1, last))
        texts.append(chunk_text(said, says_last_word(words, t0, t1, last)))
    assert texts == ["Hello ", "there.", ""]
    assert "".join(texts) == "Hello there."
    # Mid-unit (another sentence follows), the same windows keep the space.
    assert "".join(chunk_text(" ".join(w.text for w in words_in_window(words, a, b, c)), False) for a, b, c in bounds) == "Hello there. "


def test_a_first_window_plays_over_100_ms_once_the_gateway_has_resampled_and_framed_it():
    # What a listener hears before the second chunk must cover the second step:
    # 40-55 ms through the gateway on 2 idle cores, about 80 beside a browser
    # (windows.py).
    # The gateway's resampler holds some audio back and the rest leaves in whole
    # 20 ms frames, so the first window's playable audio is less than its length.
    import numpy as np

    from voxgate.gateway.media.frames import FRAME_MS, Framer
    from voxgate.gateway.media.resample import StreamResampler

    rate, hop, wire = 22050, 256, 48000  # Piper's medium voices (joe) to Opus
    pcm = (np.random.default_rng(0).standard_normal(WindowSchedule().first * hop) * 3000).astype(np.int16)
    framer = Framer(wire)
    samples = framer.push(StreamResampler(rate, wire).process(pcm), last=False)
    assert len(samples) // framer.samples * FRAME_MS >= 100


def test_a_flow_segment_takes_the_rest_of_a_sentence_when_a_later_one_would_cost_more():
    # A segment to frame 24 with 32 frames of context computes up to 56. Left
    # 32 frames or fewer past that, a later segment would run 64 frames of
    # context for them: this one takes them. Left more, the first audio does not wait.
    assert flow_end(frames=56 + 32, end=24, context=32) == 88
    assert flow_end(frames=56 + 33, end=24, context=32) == 24
    assert flow_end(frames=30, end=24, context=32) == 30
    assert flow_end(frames=24, end=24, context=32) == 24
