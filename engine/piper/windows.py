"""The window schedule: which frames of a sentence to turn into audio next.

A convolutional stage (VITS's flow, its HiFi-GAN decoder) can run on any span
of frames and give exactly the samples a whole-sentence run gives, as long as
the span is fed `context` real frames on each side (its receptive field) and
those are cut off afterwards ("discard and stitch").

The first window is small because a listener is waiting for it. Later windows
grow with the audio the listener already has: a bigger window wastes less on
context, and the audio already sent covers the time it takes. A cap keeps
every step bounded, so a long sentence never holds a core for long.

Both the ONNX engine and the torch engine plan their windows here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..base import WordTiming

# About 139 ms of audio at 22,050 Hz and 256 samples per frame. What a
# listener can play of it is less: the gateway's resampler to 48 kHz (soxr HQ)
# holds back about 19 ms, and the rest goes out in whole 20 ms frames, so 12
# frames play 120 ms; 8 frames (the value from 085d3ed to 8d7abe8) played
# 60 ms. With 8, the next chunk (a window of 32-48 frames, with 12 of context
# each side, and the flow up to it) reached the gateway 40-55 ms after the
# first on 2 idle cores and about 80 ms after it beside a browser on the same
# cores: the page benchmark's stream ran dry after every first chunk, and the
# pre-roll the gateway then adds delayed every later utterance by 50-70 ms
# (by hand, logging the playout). With 12 (a next window of 48-72 frames) it
# did not run dry once; the page's TTFA went from 168-206 to 110-141 ms p50
# (bench_streaming's page section). 4 more frames cost a first chunk about
# 3 ms on 2 threads.
FIRST_WINDOW_FRAMES = 12
# About 3 s of audio, some 0.3 s of one core: a step no longer than that.
MAX_WINDOW_FRAMES = 256
# Each window of a sentence may be this many times the one before. Every seam
# costs the decoder's context twice over (24 frames, as much work as a 24-frame
# window), so windows must grow fast; decoding runs 8-10x faster than real time
# on one core, so a window 4x the last is ready before the last has played.
GROWTH = 4
# A window may also hold this many times the frames the listener already has
# buffered: a stream with half a second to spare gets its sentence in one window.
COVER = 6
# Once the listener has audio, a sentence's tail shorter than 1/FOLD_FRACTION
# of the window before it joins that window. Under load, windows sized to the
# buffered audio left tails of 12-50 frames, each paying 12 frames of context:
# 7.5 % more decoder frames than the audio at 8 streams on 2 cores.
FOLD_FRACTION = 2
# ... and no longer than FOLD_COVER times the audio the listener has buffered:
# at 2-4 streams per core a stream still decodes 2-5x faster than real time,
# so the longer step ends before the buffered audio does. A listener with
# nothing buffered (a first window, or one that ran dry) never waits for it.
FOLD_COVER = 2


def load_factor(load: float) -> int:
    """How many times its size alone a window is at `load` (streams per core with steps to run).

    Alone on its core, once. Under load, a stream's next chunk comes only after
    the other streams' steps on its core (about ceil(load) - 1 of them) and its
    own next step, so each chunk must cover about that many steps: ceil(load)
    first windows do. With first windows of 8 frames that had not been enough
    (59-87 ms of audio in hand when the second chunk of 4 streams on 2 cores
    arrived, 2 of 40 streams dry in streaming-int8.json), and ceil(load) + 1
    was tried: 150-193 ms in hand. Once the first window became 12 frames
    (FIRST_WINDOW_FRAMES says why), ceil(load) alone kept 130-190 ms in hand
    (streaming-first12-ceil-throughput.json, streaming-final.json), where the
    + 1 kept 300-323 ms and made every first chunk under load larger (60
    frames at 8 streams instead of 48; streaming-first12.json).
    """
    return max(1, math.ceil(load - 1e-9))


@dataclass(frozen=True)
class Window:
    """Frames [start, end) to emit, computed from frames [src_start, src_end)."""

    start: int
    end: int
    src_start: int
    src_end: int

    @property
    def keep(self) -> slice:
        """The emitted frames' place inside the computed ones."""
        return slice(self.start - self.src_start, self.end - self.src_start)


@dataclass(frozen=True)
class WindowSchedule:
    first: int = FIRST_WINDOW_FRAMES
    largest: int = MAX_WINDOW_FRAMES

    def size(self, index: int, slack_frames: float | None, load: float = 1.0) -> int:
        """Frames of the `index`-th window of a sentence.

        Windows grow by GROWTH from the first; and, when the listener's
        buffered audio is known (`slack_frames`), to COVER times that. A direct
        call (nobody listening live, `None`) just grows. Under `load` (streams
        per core with steps to run), every window is `load_factor(load)` times
        larger: each stream's next step comes that much later, so each chunk
        must cover that much more time, and fewer seams leave more of the
        cores for the audio itself.
        """
        size = self.first * load_factor(load) * GROWTH ** min(index, 8)
        if slack_frames is not None:
            size = max(size, int(COVER * max(slack_frames, 0.0)))
        return max(self.first, min(self.largest, size))

    @staticmethod
    def _covers(rest: int, index: int, slack_frames: float | None) -> bool:
        """Whether the listener's buffered audio covers decoding `rest` more frames now."""
        if slack_frames is None:
            return index > 0  # a direct call: whoever reads it has the earlier windows
        return FOLD_COVER * slack_frames >= rest

    def next(
        self, done: int, total: int, index: int, context: int, slack_frames: float | None = None, load: float = 1.0
    ) -> Window:
        """The window after `done` of `total` frames, with `context` frames each side."""
        size = self.size(index, slack_frames, load)
        end = min(total, done + size)
        rest = total - end
        if 0 < rest < self.first // 2:
            end = total  # fold a sliver of a tail into this window
        elif 0 < rest < size // FOLD_FRACTION and total - done <= self.largest and self._covers(rest, index, slack_frames):
            # The listener has audio enough to wait for the tail too, so a tail
            # window would cost its context on a few frames for no gain in
            # latency: fold the tail in, within the cap on a step.
            end = total
        return Window(done, end, max(0, done - context), min(total, end + context))


def flow_end(frames: int, end: int, context: int) -> int:
    """Where a flow segment that must reach `end` should stop, of a sentence's `frames`.

    At `end`, unless what it would leave is no longer than its `context`: a
    later segment would run that context twice over (once as this one's right
    side, once as its own left) to save this step at most `context` frames,
    so the segment takes the rest of the sentence. A short first sentence
    under load had flowed 1.8x its frames (bench_streaming's 8 streams). On an
    idle worker this puts up to `context` more frames of flow (some 3 ms on 2
    threads for Piper's 32) before the first audio of a short sentence, and
    takes twice that off the step after it, the one the first chunk's audio
    has to cover.
    """
    return frames if frames - (end + context) <= context else end


def chunk_text(text: str, says_unit_end: bool) -> str:
    """What a chunk says: with a trailing space unless it says its unit's last
    word, so that a unit's chunk texts joined give its words with single
    spaces between and nothing after. A sentence's last window may say no word
    at all (its last word started in the window before), so the chunk that says
    the last word is not always the one that ends the unit."""
    if text and not says_unit_end and not text.endswith(" "):
        text += " "
    return text


def says_last_word(words: list[WordTiming], t0: float, t1: float, last: bool) -> bool:
    """Whether the window [t0, t1) of a sentence says its last word (see `words_in_window`)."""
    return last or (bool(words) and t0 <= words[-1].start < t1)


def words_in_window(words: list[WordTiming], t0: float, t1: float, last: bool) -> list[WordTiming]:
    """The words that start in [t0, t1) (and any after, in a sentence's last window), timed from t0."""
    return [
        WordTiming(w.text, w.start - t0, w.end - t0)
        for w in words
        if (t0 <= w.start < t1) or (last and w.start >= t1)
    ]
