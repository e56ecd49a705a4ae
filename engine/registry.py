"""Engines by name. Imports are lazy so the default install never needs torch or CosyVoice."""

from __future__ import annotations

from ..config import ENGINES
from .base import Engine, EngineError


def create_engine(name: str, **options: object) -> Engine:
    if name == "piper":
        from .piper.piper_engine import PiperEngine

        return PiperEngine(**options)  # type: ignore[arg-type]
    if name == "tone":
        from .tone import ToneEngine

        return ToneEngine(**options)  # type: ignore[arg-type]
    if name == "torch":
        from .torch_voices.torch_engine import TorchEngine

        return TorchEngine(**options)  # type: ignore[arg-type]
    if name == "cosyvoice2":
        from .torch_voices.cosyvoice2 import CosyVoice2Engine

        return CosyVoice2Engine(**options)  # type: ignore[arg-type]
    raise EngineError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
