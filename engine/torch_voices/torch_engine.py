"""Piper voices on torch, streaming inside a sentence and batching across streams.

The ONNX engine speaks a sentence per model call, so a long sentence's first
audio waits for all of it. Here the clause goes through text encoder and
duration predictor in one call, and then the flow and the vocoder run on
successive windows of output frames, each with enough context either side
that its samples equal a whole-sentence decode. The first window is small, so
the first audio goes out after a fraction of the sentence's work; later
windows grow to cut the cost of their context.

Several streams' steps can run as one forward pass: `start()` makes a job per
unit of text, and `step(jobs)` advances each job by one chunk, batching the
encoder calls, flow segments and decoder windows of all the jobs it is given.
`synthesize()` is `step()` on a single job, so both paths run the same code.

torch is imported only when this engine is created.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, cast

import numpy as np

from ..base import AudioChunk, EngineError, StepwiseEngine, SynthesisJob, SynthesisOptions
from ..piper.piper_engine import DEFAULT_VOICE, PiperEngine
from ..piper.piper_words import Sentence, split_words_over, word_timings
from ..text.units import cap_phonemes, cap_text
from ..piper.windows import FIRST_WINDOW_FRAMES, Window, WindowSchedule, chunk_text, flow_end, says_last_word, words_in_window

try:
    import torch
except ImportError as exc:  # the registry imports this module only when asked for "torch"
    raise EngineError(
        'the torch engine needs PyTorch: pip install ".[gpu]" in the voxgate clone (or pip install torch)'
    ) from exc

from .torch_vits import Aligned, _bucket
from .torch_voice import _TorchVoice, choose_device

log = logging.getLogger(__name__)

# Later windows grow up to this (the shared schedule allows more): batched
# windows are padded to the longest, so on a GPU many short ones beat a few long.
BATCH_WINDOW_FRAMES = 64
FLOW_SEGMENT_FRAMES = 128  # the flow runs ahead of the vocoder in segments at least this long
# Jobs per forward pass. A GPU wants wide batches; on a CPU the convolutions
# already use every core, and a wide batch only adds padding and cache misses.
MAX_BATCH = {"cpu": 4, "cuda": 64}


@dataclass
class _Sentence(Sentence):
    """A sentence on torch, from phonemes to emitted windows."""

    aligned: Aligned | None = None
    z: "torch.Tensor | None" = None  # flow output, filled ahead of the vocoder
    flowed: int = 0  # frames of z computed
    decoded: int = 0  # frames turned into audio

    @property
    def frames(self) -> int:
        return self.aligned.frames if self.aligned is not None else 0

    @property
    def z_p(self) -> "torch.Tensor":
        """The prior's latent, once the sentence is aligned."""
        assert self.aligned is not None, "the sentence is not aligned yet"
        return self.aligned.z_p

    @property
    def flow_out(self) -> "torch.Tensor":
        """The flow's output so far, once a flow segment has run."""
        assert self.z is not None, "no flow segment has run yet"
        return self.z


@dataclass
class TorchJob(SynthesisJob):
    """One unit of text on its way to audio; advance it with TorchEngine.step()."""

    text: str
    options: SynthesisOptions
    voice: _TorchVoice
    length_scale: float
    noise_scale: float
    noise_w: float
    pending: list[_Sentence]
    generator: "torch.Generator | None" = None
    current: _Sentence | None = None

    @property
    def done(self) -> bool:
        return self.current is None and not self.pending


@dataclass
class _FlowTask:
    sentence: _Sentence
    src_start: int
    src_end: int
    keep_start: int
    keep_end: int


@dataclass
class _Window:
    job: TorchJob
    sentence: _Sentence
    span: Window

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @property
    def src_start(self) -> int:
        return self.span.src_start

    @property
    def src_end(self) -> int:
        return self.span.src_end


class TorchEngine(StepwiseEngine):
    name = "torch"

    def __init__(
        self,
        first_window: int = FIRST_WINDOW_FRAMES,
        max_window: int = BATCH_WINDOW_FRAMES,
        max_batch: int | None = None,
        half: bool | None = None,
        voice_dir: str | None = None,
        **common: Any,
    ) -> None:
        super().__init__(**common)  # voice, device, threads (StepwiseEngine)
        self.default_voice = self.voice_option or DEFAULT_VOICE
        self.first_window = max(1, int(first_window))
        self.max_window = max(self.first_window, int(max_window))
        self.schedule = WindowSchedule(self.first_window, self.max_window)
        self.max_batch = max_batch
        # Flow and vocoder in fp16: None picks it on CUDA only (bench/gpu_check.py
        # compares both there; on a CPU fp16 convolutions run, but several times slower).
        self.half = half
        self.device: torch.device | None = None
        self._voices: dict[str, _TorchVoice] = {}
        self._load_lock = threading.Lock()
        # Voice names resolve exactly as in the ONNX engine (it loads nothing until load()).
        self._names = PiperEngine(voice=self.voice_option, voice_dir=voice_dir)

    # Engine interface

    def load(self) -> None:
        self.device = choose_device(self.device_name)
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        self._voice(None)
        # The first run pays for espeak's start and torch's kernel choices; pay it here.
        for _ in self.synthesize("Ready.", SynthesisOptions()):
            pass
        log.info("torch voice %s loaded on %s", self.default_voice, self.device)

    def voices(self) -> list[str]:
        return self._names.voices()

    def sample_rate(self, voice: str | None = None) -> int:
        return self._voice(voice).sample_rate

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        job = self.start(text, options)
        while True:
            chunk = self.step([job])[0]
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        self._voices.clear()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def info(self) -> dict:
        info = super().info()
        info["device"] = str(self.device)
        info["first_window_frames"] = self.first_window
        info["max_window_frames"] = self.max_window
        info["max_batch"] = self.max_batch or MAX_BATCH.get(self.device.type if self.device else "cpu", 4)
        voice = self._voices.get(self._names.resolve_voice(None)[0])
        if voice is not None:
            info["decoder_dtype"] = str(voice.model.decoder_dtype).removeprefix("torch.")
        return info

    # Batched API

    def start(self, text: str, options: SynthesisOptions, seed: int | None = None) -> TorchJob:
        """Phonemize a unit of text into a job; no model work happens yet."""
        loaded = self._voice(options.voice)
        config = loaded.voice.config
        # Capped like the ONNX engine's units, so no encoder pass grows with the text.
        with loaded.phonemize_lock:
            sentences = [
                part
                for piece in cap_text(text)
                for p in loaded.voice.phonemize(piece)
                if p
                for part in cap_phonemes(p)
            ]
        pieces = split_words_over(text, sentences)
        pending = [
            _Sentence(text=piece, phonemes=ph, ids=loaded.voice.phonemes_to_ids(ph), last_of_unit=i == len(sentences) - 1)
            for i, (ph, piece) in enumerate(zip(sentences, pieces))
        ]
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return TorchJob(
            text=text,
            options=options,
            voice=loaded,
            length_scale=config.length_scale / max(options.rate, 0.1),
            noise_scale=config.noise_scale if options.noise_scale is None else float(options.noise_scale),
            noise_w=config.noise_w_scale if options.noise_w_scale is None else float(options.noise_w_scale),
            pending=pending,
            generator=generator,
        )

    def step(self, jobs: Sequence[SynthesisJob], threads: int = 1, stop: object = None) -> list[AudioChunk | None]:
        """Advance every job by one chunk in as few forward passes as possible.

        Returns one entry per job, in order: its next chunk, or None once the
        job has no more audio. Jobs may use different voices (one batch per
        voice). A job must not be stepped from two threads at once. `threads`
        is ignored: torch runs every pass on all its threads (set at load);
        so is `stop`: a batched pass serves several streams and runs to its end.
        """
        jobs = cast("Sequence[TorchJob]", jobs)  # this engine's own jobs (start_job)
        results: list[AudioChunk | None] = [None] * len(jobs)
        by_voice: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            by_voice.setdefault(id(job.voice), []).append(i)
        limit = self.max_batch or MAX_BATCH.get(self.device.type if self.device else "cpu", 4)
        with torch.inference_mode():
            for indices in by_voice.values():
                for k in range(0, len(indices), limit):
                    part = indices[k : k + limit]
                    for i, chunk in zip(part, self._step_voice([jobs[i] for i in part])):
                        results[i] = chunk
        return results

    def synthesize_batch(
        self, requests: Sequence[tuple[str, SynthesisOptions]], seeds: Sequence[int | None] | None = None
    ) -> list[list[AudioChunk]]:
        """Run several units to completion together; the chunks of each, in order."""
        jobs = [self.start(text, opts, seed=(seeds[i] if seeds else None)) for i, (text, opts) in enumerate(requests)]
        out: list[list[AudioChunk]] = [[] for _ in jobs]
        live = list(range(len(jobs)))
        while live:
            chunks = self.step([jobs[i] for i in live])
            still = []
            for i, chunk in zip(live, chunks):
                if chunk is not None:
                    out[i].append(chunk)
                    still.append(i)
            live = still
        return out

    # Internals

    def _voice(self, voice: str | None) -> _TorchVoice:
        name, path = self._names.resolve_voice(voice)
        loaded = self._voices.get(name)
        if loaded is None:
            with self._load_lock:
                loaded = self._voices.get(name)
                if loaded is None:
                    if self.device is None:
                        self.device = choose_device(self.device_name)
                    half = self.device.type == "cuda" if self.half is None else self.half
                    loaded = _TorchVoice(path, self.device, half)
                    self._voices[name] = loaded
        return loaded

    def _step_voice(self, jobs: list[TorchJob]) -> list[AudioChunk | None]:
        voice = jobs[0].voice
        model = voice.model

        # 1. Jobs between sentences: encoder and duration predictor, batched.
        fresh: list[tuple[TorchJob, _Sentence]] = []
        for job in jobs:
            if job.current is None and job.pending:
                job.current = first = job.pending.pop(0)
                fresh.append((job, first))
        if fresh:
            aligned = model.encode(
                [sentence.ids for _, sentence in fresh],
                [j.length_scale for j, _ in fresh],
                [j.noise_scale for j, _ in fresh],
                [j.noise_w for j, _ in fresh],
                [j.generator for j, _ in fresh],
            )
            for (job, sentence), a in zip(fresh, aligned):
                self._aligned(job, sentence, a)

        # 2. Plan each job's next vocoder window and the flow frames it needs.
        windows: list[_Window | None] = []
        flows: list[_FlowTask] = []
        for job in jobs:
            s = job.current
            if s is None:
                windows.append(None)
                continue
            window = self._plan_window(job, s)
            windows.append(window)
            need = min(s.frames, window.end + voice.dec_context)
            if s.flowed < need:
                # The first segment is only what the first window needs: it is on the
                # path to the first audio. Later ones run further ahead.
                ahead = 0 if s.flowed == 0 else FLOW_SEGMENT_FRAMES
                end = flow_end(s.frames, min(s.frames, max(need, s.flowed + ahead)), voice.flow_context)
                src_start = max(0, s.flowed - voice.flow_context)
                src_end = min(s.frames, end + voice.flow_context)
                flows.append(_FlowTask(s, src_start, src_end, s.flowed - src_start, end - src_start))

        # 3. Flow segments, batched.
        if flows:
            outs = model.flow_windows([f.sentence.z_p[:, f.src_start : f.src_end] for f in flows])
            for f, z in zip(flows, outs):
                s = f.sentence
                if s.z is None:
                    s.z = torch.empty(z.shape[0], s.frames, dtype=z.dtype, device=z.device)
                s.z[:, s.flowed : s.flowed + f.keep_end - f.keep_start] = z[:, f.keep_start : f.keep_end]
                s.flowed += f.keep_end - f.keep_start

        # 4. Vocoder windows, batched.
        live = [w for w in windows if w is not None]
        audio = model.decode([w.sentence.flow_out[:, w.src_start : w.src_end] for w in live]) if live else []
        results: list[AudioChunk | None] = []
        it = iter(audio)
        for w in windows:
            results.append(None if w is None else self._emit(w, next(it)))
        return results

    def _aligned(self, job: TorchJob, s: _Sentence, aligned: Aligned) -> None:
        s.aligned = aligned
        voice = job.voice
        id_samples = (aligned.durations.cpu().numpy() * voice.hop).astype(np.int64)
        duration = aligned.frames * voice.hop / voice.sample_rate
        # Same mapping from phoneme spans to written words as the ONNX engine.
        s.words = word_timings(s.text, s.phonemes, s.ids, id_samples, voice, duration)

    def _plan_window(self, job: TorchJob, s: _Sentence) -> _Window:
        slack = None if job.slack_s is None else job.slack_s * job.voice.sample_rate / job.voice.hop
        span = self.schedule.next(s.decoded, s.frames, s.windows, job.voice.dec_context, slack, job.load)
        src_start, src_end = span.src_start, span.src_end
        # Round the input up to the model's length bucket with real frames where the
        # sentence has them: extra context costs the same as padding and never hurts.
        short = _bucket(src_end - src_start) - (src_end - src_start)
        grow = min(short, s.frames - src_end)
        src_end += grow
        src_start = max(0, src_start - (short - grow))
        return _Window(job, s, Window(span.start, span.end, src_start, src_end))

    def _emit(self, w: _Window, wave: "torch.Tensor") -> AudioChunk:
        s, job, voice = w.sentence, w.job, w.job.voice
        hop = voice.hop
        samples = wave[(w.start - w.src_start) * hop : (w.end - w.src_start) * hop]
        pcm = (samples.float().clamp(-1.0, 1.0) * 32767.0).to(torch.int16).cpu().numpy()
        last_window = w.end >= s.frames
        s.decoded = w.end
        s.windows += 1

        # Words belong to the window in which they start; times from this chunk's start.
        t0 = w.start * hop / voice.sample_rate
        t1 = w.end * hop / voice.sample_rate
        words = words_in_window(s.words, t0, t1, last_window)
        if last_window:
            job.current = None
        unit_end = last_window and s.last_of_unit
        says_end = s.last_of_unit and says_last_word(s.words, t0, t1, last_window)
        text = chunk_text(" ".join(x.text for x in words), says_end)
        return job.emit(pcm, voice.sample_rate, text, words, unit_end)
