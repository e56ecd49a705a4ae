"""A Piper voice loaded for the torch engine (engine/torch_voices/torch_engine.py): the torch device
for `--device`, and the voice's model (engine/torch_voices/torch_vits.py, weights read by
torch_vits_load.py) beside Piper's phonemizer for its config."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ..base import EngineError
from .torch_vits import Vits


def choose_device(device: str) -> "torch.device":
    """A torch device for a device name: auto, cpu or cuda."""
    if device == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if device.startswith("cuda"):
        if not cuda:
            build = torch.version.cuda or "none (CPU-only build)"
            raise EngineError(
                f"--device {device} was asked for, but torch {torch.__version__} sees no CUDA device "
                f"(CUDA build: {build}). Install a CUDA build of torch on a machine with an NVIDIA GPU, "
                "or use --device cpu."
            )
        return torch.device(device)
    if device != "auto":
        raise EngineError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device("cuda" if cuda else "cpu")


class _TorchVoice:
    """A Piper voice: the torch model plus Piper's phonemizer for its config."""

    def __init__(self, path: Path, device: "torch.device", half: bool) -> None:
        import json

        from piper import PiperVoice
        from piper.config import PiperConfig

        config_path = Path(str(path) + ".json")
        if not path.exists() or not config_path.exists():
            raise EngineError(
                f"Piper voice {path} needs both the .onnx file and its .onnx.json config beside it."
            )
        config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        try:
            model = Vits.from_onnx(path)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise EngineError(f"cannot load {path} into the torch VITS model: {exc}") from exc
        model.to(device)
        if half:
            model.half_decoder()
        self.model = model
        # No onnxruntime session: only phonemize() and phonemes_to_ids() are used.
        # The attribute names match piper_voice.LoadedVoice so its word_timings() applies.
        self.voice = PiperVoice(session=None, config=config)
        self.sample_rate = config.sample_rate
        self.hop = model.hop
        self.flow_context = model.flow_context()
        self.dec_context = model.dec.context_frames()
        # espeak-ng keeps global state; one phonemizer call at a time.
        self.phonemize_lock = threading.Lock()
