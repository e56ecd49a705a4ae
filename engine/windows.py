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

from dataclasses import dataclass

from .base import WordTiming

# About 140 ms of audio at 22,050 Hz and 256 samples per frame: little work,
# and enough audio to cover the next window's time on a busy core.
FIRST_WINDOW_FRAMES = 12
# About 3 s of audio, some 0.3 s of one core: a step no longer than that.
MAX_WINDOW_FRAMES = 256
# A later window may hold this many times the frames the listener has
# buffered. Decoding runs some 8-10x faster than real time on one core, so
# even with 3-4 steps queued per core the window is ready before the audio ahead of it runs out.
GROWTH = 2


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

    def size(self, index: int, slack_frames: float | None) -> int:
        """Frames of the `index`-th window of a sentence.

        With the listener's buffered audio known (`slack_frames`), the window
        grows with it; without (a direct call, nobody listening live), windows
        double from the first.
        """
        if slack_frames is None:
            size = self.first << min(index, 16)
        else:
            size = int(GROWTH * max(slack_frames, 0.0))
        return max(self.first, min(self.largest, size))

    def next(
        self, done: int, total: int, index: int, context: int, slack_frames: float | None = None
    ) -> Window:
        """The window after `done` of `total` frames, with `context` frames each side."""
        end = min(total, done + self.size(index, slack_frames))
        if 0 < total - end < self.first // 2:
            end = total  # fold a sliver of a tail into this window
        return Window(done, end, max(0, done - context), min(total, end + context))


def words_in_window(words: list[WordTiming], t0: float, t1: float, last: bool) -> list[WordTiming]:
    """The words that start in [t0, t1) (and any after, in a sentence's last window), timed from t0."""
    return [
        WordTiming(w.text, w.start - t0, w.end - t0)
        for w in words
        if (t0 <= w.start < t1) or (last and w.start >= t1)
    ]
