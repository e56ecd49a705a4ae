"""A Piper voice, loaded: the split stages and their sessions (which voices there are and the
onnxruntime providers: piper_catalog.py).

Loading is where a voice's graph has its layer norms fused (`graph_fuse`),
is split (`piper_split`) into the stages that let a sentence stream, where
the prior's attention gets its position terms banded (`graph_band`) and its
convolutions in int8 (`graph_quant`), each checked against the graph
before it, and where the split is checked: each stage run in
windows (`windows`) must match one run over the same frames before a listener
hears a seam. A graph that will not split, or fails the check, is kept whole,
and the log says why. Synthesis with a loaded voice is `piper_engine.py`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

from ..base import DEFAULT_PRIOR_PRECISION, EngineError
from .graph_band import MAX_BAND_DURATION_DIFF, MIN_BAND_SNR_DB, band_relative_attention
from .graph_fuse import fuse_layer_norms
from .graph_quant import compare_priors, quantize_prior
from .piper_catalog import (  # noqa: F401 (piper_engine and tests take them from here)
    DEFAULT_VOICE, EMBEDDED_NAMES, MAX_LOADED_VOICES, choose_providers, embedded_voice_path, voice_catalog,
)
from .piper_split import SplitError, Stage, VoiceGraphs, flow_input, split_voice
from .windows import FIRST_WINDOW_FRAMES, WindowSchedule

log = logging.getLogger(__name__)

# Sentences a rewritten prior (banded, int8) is checked on before a listener
# hears it (graph_quant.compare_priors), with inputs shorter than any
# attention window beside them (`LoadedVoice._probe_feeds`).
PRIOR_PROBES = (
    "Hello there.",
    "Thanks for waiting while I looked up the details of the order you placed last Tuesday.",
)

# Windowed output must match a one-shot run of the same stage this closely.
# With the receptive field as context, float rounding alone leaves 120-130 dB;
# a decoder context of 8 frames instead of its 12 gives about 60.
MIN_SEAM_SNR_DB = 60.0


# Whether onnxruntime's pool threads may spin between the ops of a run on
# every core: "auto" (when the step runs alone and the rest of the machine is
# quiet, `other_load`), "always" or "never" (config.SPIN_POLICIES, --engine-spin).
# Spinning threads always stop when the run returns
# ("session.force_spinning_stop"): without that stop each stage's pool (prior,
# flow, decoder) spun on after its run and fought the next stage's threads for
# the same cores, which had made spinning look 1.7x slower than sleeping. With
# it, the first chunk of a long sentence on 2 idle cores took 0.87-0.90x the
# time of sleeping threads; beside one busy process, spinning took 1.53x and
# auto (which then sleeps) 0.88x (bench/bench_streaming.py --only spinning;
# bench/results/streaming-spin.json).


class StageSessions:
    """onnxruntime sessions for a voice's stages, all at one intra-op thread count."""

    def __init__(
        self, graphs: VoiceGraphs | None, whole: bytes, threads: int, providers: list[str], spin: bool = False
    ) -> None:
        self.threads = threads
        self.spin = spin
        if graphs is None:
            self.whole = _session(whole, threads, providers, spin)
            self.prior = self.flow = self.decoder = None
        else:
            self.whole = None
            self.prior = _session(graphs.prior.model.SerializeToString(), threads, providers, spin)
            self.flow = _session(graphs.flow.model.SerializeToString(), threads, providers, spin) if graphs.flow else None
            self.decoder = _session(graphs.decoder.model.SerializeToString(), threads, providers, spin)


def _session(model: bytes, threads: int, providers: list[str], spin: bool):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, sess_options=options, providers=providers)


class LoadedVoice:
    """A Piper voice: its phonemizer and config, split stages, and sessions per thread count."""

    def __init__(
        self, path: Path, providers: list[str], threads: int, split: bool = True, spin: str = "auto",
        precision: str = DEFAULT_PRIOR_PRECISION, band: bool = True,
    ) -> None:
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
        # Fewer ops for the same sums (graph_fuse says what and why); the
        # fallback to whole units runs the rewritten graph too.
        self.fused_layer_norms = fuse_layer_norms(model)
        # No session of its own: only phonemize() and phonemes_to_ids() are used.
        self.voice = PiperVoice(session=None, config=config)
        # espeak-ng keeps global state; one phonemizer call at a time.
        self.phonemize_lock = threading.Lock()
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
        # The prior's rewrites, each checked against the graph it rewrote: the
        # attention's position terms on their band (graph_band), then the
        # convolutions in int8 on the CPU (graph_quant). They go where the prior
        # is served: the split prior, or the whole graph of a voice that
        # synthesizes whole units.
        self.why_float = "" if precision == "int8" else f"--engine-prior-precision {precision}"
        if precision == "int8" and providers[:1] != ["CPUExecutionProvider"]:
            self.why_float = "int8 runs on the CPU only"
        self.band = band  # False: the dense position terms, as exported (bench_streaming's baseline)
        self.banded_terms = 0
        if self.graphs is not None:
            prior = self._rewrite_prior(self.graphs.prior.model)
            self.graphs = replace(self.graphs, prior=replace(self.graphs.prior, model=prior))
        else:
            model = self._rewrite_prior(model)
        whole = b"" if self.graphs is not None else model.SerializeToString()
        self.spin = spin  # one of config.SPIN_POLICIES, checked by PiperEngine
        self.sessions, self.spinning = self._sessions(whole, threads, providers)
        if self.graphs is not None:
            try:
                self._check_windows()
            except SplitError as exc:
                self.why_whole = str(exc)
                self.graphs = None
                model = self._rewrite_prior(model)  # the split prior's rewrites were its own
                self.sessions, self.spinning = self._sessions(model.SerializeToString(), threads, providers)
        # Counted in the graph that is served, not where it was rewritten.
        served = self.graphs.prior.model if self.graphs is not None else model
        self.int8_convs = sum(node.op_type == "MatMulInteger" for node in served.graph.node)
        if self.graphs is None:
            log.warning("piper voice %s: whole-unit synthesis, no streaming inside sentences: %s", path, self.why_whole)
        elif self.graphs.flow is None:
            log.info("piper voice %s: the flow runs with the encoder (%s)", path, self.graphs.flow_note)

    def _rewrite_prior(self, model) -> "onnx.ModelProto":
        """`model` (holding the prior) with the rewrites that pass their checks."""
        if self.band:
            model, self.banded_terms = self._banded(model)
        if not self.why_float:  # int8 was asked for, can run here, and has not failed its check
            model = self._quantized(model)
        return model

    def _banded(self, model) -> tuple["onnx.ModelProto", int]:
        """(`model` with its relative-position terms banded, how many), or (`model`, 0) when that fails its check."""
        import onnx

        rewritten = onnx.ModelProto()
        rewritten.CopyFrom(model)
        count = band_relative_attention(rewritten)
        if not count:
            log.info("piper voice %s: no relative-position attention to band", self.path)
            return model, 0
        try:
            why = self._check_prior(
                model, rewritten, what="the banded prior", max_duration_diff=MAX_BAND_DURATION_DIFF, min_snr_db=MIN_BAND_SNR_DB
            )
        except Exception as exc:  # noqa: BLE001 (a voice that loads as it is must not fail to load for a rewrite)
            why = f"the check could not run ({type(exc).__name__}: {str(exc)[:200]})"
        if why:
            log.warning(
                "piper voice %s: the attention keeps its dense position terms, as exported (the voice loads and "
                "speaks the same; its prior runs a few percent slower): %s", self.path, why,
            )
            return model, 0
        return rewritten, count

    def _quantized(self, model) -> "onnx.ModelProto":
        """`model` with its prior's convolutions in int8, or `model` itself (and why) when that fails its check.

        When the rewrite with the pointwise convolutions fails its check, the
        wide ones alone (the text encoder's feed-forward layers) are tried
        before the prior stays float32: they change the prior least."""
        import onnx

        first_why = ""
        for pointwise in (True, False):
            rewritten = onnx.ModelProto()
            rewritten.CopyFrom(model)
            try:
                count = quantize_prior(rewritten, pointwise=pointwise)
            except SplitError as exc:
                self.why_float = f"the prior cannot be told from the flow: {exc}"
                log.info("piper voice %s: the prior stays float32: %s", self.path, self.why_float)
                return model
            if not count:
                continue
            try:
                why = self._check_prior(model, rewritten)
            except Exception as exc:  # noqa: BLE001 (a voice that loads in float32 must not fail to load for int8)
                why = f"the check could not run ({type(exc).__name__}: {str(exc)[:200]})"
            if not why:
                if first_why:
                    log.warning("piper voice %s: the prior's pointwise convolutions stay float32: %s", self.path, first_why)
                return rewritten
            first_why = first_why or why
        self.why_float = first_why or "the prior has no convolution to rewrite"
        if first_why:
            log.warning("piper voice %s: the prior stays float32: %s", self.path, self.why_float)
        else:
            log.info("piper voice %s: the prior stays float32: %s", self.path, self.why_float)
        return model

    def prior_feed(self, ids: list[int]) -> dict:
        """The prior's inputs for one sentence's phoneme ids, the noise off (deterministic)."""
        config = self.voice.config
        return {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([0.0, config.length_scale, 0.0], dtype=np.float32),
            "sid": self.speaker,
        }

    def text_ids(self, text: str) -> list[int]:
        """`text`'s phoneme ids, as one sentence."""
        with self.phonemize_lock:
            sentences = self.voice.phonemize(text)
        return self.voice.phonemes_to_ids([p for sentence in sentences for p in sentence])

    def _probe_feeds(self) -> list[dict]:
        """PRIOR_PROBES, and inputs of 3 and 5 ids (no phoneme, one), shorter than
        an attention window: where a rewrite's edge cases are."""
        with self.phonemize_lock:
            one = [p for sentence in self.voice.phonemize("Hello") for p in sentence][:1]
        ids = [self.text_ids(text) for text in PRIOR_PROBES]
        ids += [self.voice.phonemes_to_ids([]), self.voice.phonemes_to_ids(one)]
        return [self.prior_feed(i) for i in ids]

    def _check_prior(self, model, rewritten, **limits) -> str:
        """compare_priors on probe sentences, with the noise at zero so that both runs are deterministic."""
        import onnxruntime
        from onnx.utils import Extractor

        def prior_run(m):
            outputs = [flow_input(m.graph)] + ([self.alignment] if self.alignment else [])
            if not set(outputs) <= {o.name for o in m.graph.output}:  # a whole graph, or a prior holding the flow
                m = Extractor(m).extract_model([i.name for i in m.graph.input], outputs)
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            # Two runs each: the basic rewrites load in half the time, and quantization's error is the same.
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.log_severity_level = 3
            session = onnxruntime.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
            names = {i.name for i in session.get_inputs()}
            return lambda feed: session.run(outputs, {k: v for k, v in feed.items() if k in names})

        return compare_priors(prior_run(model), prior_run(rewritten), self._probe_feeds(), self.alignment is not None, **limits)

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

    def _sessions(self, whole: bytes, threads: int, providers: list[str]):
        """({threads: sessions whose threads sleep between ops}, {threads: sessions whose threads spin}).

        One thread has no pool to spin; "always" and "never" keep one set per
        thread count, "auto" keeps both for every-core steps on the CPU.
        """
        counts = sorted({1, threads})
        # Only onnxruntime's CPU threads spin; on a GPU a second set would only cost its memory.
        on_cpu = providers[:1] == ["CPUExecutionProvider"]
        many = [n for n in counts if n > 1] if self.spin == "auto" and on_cpu else []
        sleeping = {n: StageSessions(self.graphs, whole, n, providers, spin=self.spin == "always" and n > 1) for n in counts}
        spinning = {n: StageSessions(self.graphs, whole, n, providers, spin=True) for n in many}
        return sleeping, spinning

    def sessions_for(self, threads: int, quiet: bool = False) -> StageSessions:
        """The sessions with the most threads not above `threads`; spinning ones on a quiet machine when kept."""
        usable = [n for n in self.sessions if n <= max(1, threads)]
        n = max(usable)
        if quiet and n in self.spinning:
            return self.spinning[n]
        return self.sessions[n]

    def _check_windows(self) -> None:
        """Windowed runs of each stage against one run over the same frames, on a probe.

        The receptive field is read off the graph; this confirms it (and that
        nothing else in a stage mixes time) before a listener hears a seam.
        """
        assert self.graphs is not None
        sessions = self.sessions_for(1)
        frames, schedule = probe_plan(self.graphs)
        rng = np.random.default_rng(0)
        probe = rng.standard_normal((1, _channels(self.graphs), frames)).astype(np.float32)
        flow, decoder = sessions.flow, sessions.decoder
        assert decoder is not None  # split graphs have their sessions
        if self.graphs.flow is not None:
            assert flow is not None
            stage = self.graphs.flow
            mask = np.ones((1, 1, frames), dtype=np.float32)
            run = lambda a, b: flow.run(None, self._feed(stage, (probe[:, :, a:b], mask[:, :, a:b])))[0]
            latent = run(0, frames)
            _compare("the flow", latent, _windowed(run, frames, stage.context, schedule, 1))
        else:
            latent = probe
        stage = self.graphs.decoder
        run = lambda a, b: decoder.run(None, self._feed(stage, (latent[:, :, a:b],)))[0]
        _compare("the decoder", run(0, frames), _windowed(run, frames, stage.context, schedule, self.hop))

    def _feed(self, stage: Stage, values: tuple) -> dict:
        feed = dict(zip(stage.inputs, values))
        if "sid" in stage.inputs:
            feed["sid"] = self.speaker
        return feed


def probe_plan(graphs: VoiceGraphs) -> tuple[int, WindowSchedule]:
    """The probe's length and windows for the load-time check of the split.

    Windows of one size, and a probe long enough that the middle ones take
    their full context from inside it on both sides: a receptive field read too
    short on either side then shows as a seam. (Sized from the product's
    schedule, a 12-frame first window had folded the rest of a 68-frame probe
    into one window whose span was the whole probe: only the first window's
    right side was checked.)
    """
    size = FIRST_WINDOW_FRAMES
    reach = max(graphs.decoder.context, graphs.flow.context if graphs.flow is not None else 0, 1)
    return 2 * (reach + size) + size, WindowSchedule(first=size, largest=size)


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
