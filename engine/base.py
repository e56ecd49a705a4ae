"""The one streaming interface every speech engine sits behind.

An engine runs inside the worker process. It turns one speakable unit of text
(a clause or sentence chosen by the segmenter) into a sequence of audio chunks.

Engines that stream inside a unit (Piper on onnxruntime, the torch port) are
`stepwise`: `start()` makes a job for a unit and `step(jobs)` advances jobs by
one bounded step each (an encoder pass over one capped sentence, or one window
of frames), so the worker can order steps by playout deadline. The others (the
tone engine, CosyVoice) are driven through `synthesize()`, one chunk per call.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

# What the piper engine's prior (text encoder and duration predictor) runs in on the CPU
# (engine/piper/graph_quant.py): its convolutions as int8 products, or all of it as exported.
# The choices and the default are the setting's (--engine-prior-precision).
from ..config import PRIOR_PRECISIONS as PRIOR_PRECISIONS, Settings, threads_or_every_core

DEFAULT_PRIOR_PRECISION = Settings.engine_prior_precision

@dataclass(frozen=True)
class WordTiming:
    """A word of the chunk's text and when it is spoken, in seconds from the chunk's start."""

    text: str
    start: float
    end: float


@dataclass
class AudioChunk:
    """Mono int16 PCM plus the text it speaks."""

    pcm: np.ndarray
    sample_rate: int
    text: str = ""
    words: list[WordTiming] = field(default_factory=list)
    # Which unit of its stream this chunk speaks (the worker numbers units; engines
    # leave it). The last chunk of a unit has unit_end set.
    unit_index: int = 0
    unit_end: bool = True

    @property
    def duration(self) -> float:
        return len(self.pcm) / float(self.sample_rate)


@dataclass
class SynthesisOptions:
    """Per-stream knobs. None means the voice's own default."""

    voice: str | None = None
    rate: float = 1.0  # speaking rate: 2.0 is twice as fast
    noise_scale: float | None = None
    noise_w_scale: float | None = None

    def to_dict(self) -> dict:
        return {
            "voice": self.voice,
            "rate": self.rate,
            "noise_scale": self.noise_scale,
            "noise_w_scale": self.noise_w_scale,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> "SynthesisOptions":
        data = data or {}
        return cls(
            voice=data.get("voice"),
            rate=float(data.get("rate") or 1.0),
            noise_scale=data.get("noise_scale"),
            noise_w_scale=data.get("noise_w_scale"),
        )


class SynthesisJob:
    """One unit of text on its way to audio; `Engine.step` advances it."""

    # Seconds of audio the listener has buffered ahead of this job's next
    # chunk, set by the worker before each step (0: someone is waiting now).
    # None: nobody listens live (a direct call), windows just grow.
    slack_s: float | None = None
    # Streams per core with steps to run, set by the worker with slack_s.
    load: float = 1.0
    chunks_made: int = 0  # chunks this job has handed back (emit counts them)

    def emit(self, pcm: np.ndarray, sample_rate: int, text: str, words: list[WordTiming], unit_end: bool) -> AudioChunk:
        """The job's next chunk, counted: how every stepwise engine hands back audio."""
        self.chunks_made += 1
        return AudioChunk(pcm=pcm, sample_rate=sample_rate, text=text, words=words, unit_end=unit_end)

    @property
    def done(self) -> bool:
        raise NotImplementedError


class StopSignal:
    """Lets the worker stop a running step whose audio is not needed yet.

    When a listener starts waiting for first audio, steps of streams with
    seconds of audio buffered are stopped and redone later, so that the new
    listener's steps have the cores. Engines check `requested` between model
    calls, or hook `on_request` to abort a call in progress, and then raise
    `StepStopped` with the job as it was before the step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requested = False
        self._hooks: list = []

    def request(self) -> None:
        with self._lock:
            if self.requested:
                return
            self.requested = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def on_request(self, hook) -> None:
        with self._lock:
            if not self.requested:
                self._hooks.append(hook)
                return
        hook()


class StepStopped(Exception):
    """A step was stopped by its StopSignal; its job is unchanged and can step again."""


class EngineError(RuntimeError):
    """Raised by an engine for a problem the user can fix (unknown voice, bad option)."""


class Engine(ABC):
    """A speech engine, loaded once per worker process."""

    name: str = "engine"
    # Tags (from the inline speech-tag set) this engine renders itself; others are
    # rendered by the stream (breaks, spelling) or dropped.
    supported_tags: frozenset[str] = frozenset()
    # True for engines with start()/step(): see the module's docstring.
    stepwise: bool = False

    @abstractmethod
    def load(self) -> None:
        """Load models. Called once in the worker before any synthesis."""

    @abstractmethod
    def voices(self) -> list[str]:
        """Names a client may pass as SynthesisOptions.voice."""

    @abstractmethod
    def sample_rate(self, voice: str | None = None) -> int:
        """Output sample rate for a voice."""

    @abstractmethod
    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        """Yield the audio for one speakable unit, in order.

        The worker calls next() once per scheduling step, so a generator that
        yields often lets other streams in and lets cancel act between chunks.
        """

    def start(self, text: str, options: SynthesisOptions) -> SynthesisJob:
        """A job for one unit of text (stepwise engines); no model work yet."""
        raise NotImplementedError(f"the {self.name} engine is not stepwise")

    def step(
        self, jobs: Sequence[SynthesisJob], threads: int = 1, stop: StopSignal | None = None
    ) -> list[AudioChunk | None]:
        """Advance each job by one bounded step (stepwise engines).

        Returns one entry per job: its next chunk, or None when the step made
        no audio (an encoder pass; or the job is done: see `job.done`).
        `threads` is how many cores this call may use; `stop` may end it early
        (StepStopped), for engines that support that.
        """
        raise NotImplementedError(f"the {self.name} engine is not stepwise")

    def close(self) -> None:  # noqa: B027 - an optional hook: most engines hold nothing to release
        """Release models and devices."""

    def info(self) -> dict:
        return {
            "engine": self.name,
            "voices": self.voices(),
            "sample_rate": self.sample_rate(),
            "supported_tags": sorted(self.supported_tags),
        }


class StepwiseEngine(Engine):
    """An engine with start()/step() that runs on a device with a budget of threads (the
    Piper engine and its torch port): the options they share are taken here, once."""

    stepwise = True

    def __init__(self, voice: str | None = None, device: str = "auto", threads: int | None = None, **_: object) -> None:
        self.voice_option = voice  # --voice as given; each engine resolves its own default
        self.device_name = device  # --device: "auto", "cpu", "cuda"...
        # The most intra-op threads one step may use: every core by default; the
        # worker asks for that when a step runs alone and for one thread under load.
        self.threads = threads_or_every_core(threads)  # --engine-threads


def words_by_length(text: str, duration: float, start: float = 0.0) -> list[WordTiming]:
    """Spread a text's words over a duration in proportion to their length.

    Used where an engine gives no alignment, or its alignment does not map onto
    the written words (numbers that espeak expands, say).
    """
    words = text.split()
    if not words or duration <= 0:
        return []
    total = sum(len(w) + 1 for w in words)
    t = start
    out = []
    for w in words:
        d = duration * (len(w) + 1) / total
        out.append(WordTiming(w, t, t + d))
        t += d
    return out
