"""CosyVoice 2 adapter, for users who have CosyVoice installed and a model directory.

It drives CosyVoice 2's bi-streaming mode: a text generator goes into
`inference_zero_shot(..., stream=True)` (or `inference_sft` for a built-in
speaker), and 24 kHz chunks come out as they are made.

Not exercised against the real model in CI: the tests run it against a
stand-in module implementing the documented `CosyVoice2` API surface.

Configuration (settings, so flags or VOXGATE_* variables; voxgate/config.py):
- --cosyvoice-model (VOXGATE_COSYVOICE_MODEL): the model directory (required)
- --cosyvoice-prompt-wav and --cosyvoice-prompt-text: a zero-shot voice prompt
  (16 kHz speech and its transcript); or
- --cosyvoice-speaker: a built-in speaker id for SFT models.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..base import AudioChunk, Engine, EngineError, SynthesisOptions, WordTiming, words_by_length


class CosyVoice2Engine(Engine):
    name = "cosyvoice2"

    def __init__(
        self,
        voice: str | None = None,
        device: str = "auto",
        model_dir: str | None = None,
        prompt_wav: str | None = None,
        prompt_text: str = "",
        speaker: str | None = None,
        **_: object,
    ) -> None:
        self.model_dir = model_dir
        self.default_voice = voice or speaker
        self.device = device
        self.model = None
        self.prompt_wav = prompt_wav
        self.prompt_speech = None
        self.prompt_text = prompt_text
        self._rate = 24000

    def load(self) -> None:
        if not self.model_dir:
            raise EngineError("the cosyvoice2 engine needs a model directory: give --cosyvoice-model DIR "
                              "(or VOXGATE_COSYVOICE_MODEL)")
        try:
            from cosyvoice.cli.cosyvoice import CosyVoice2
        except ImportError:
            raise EngineError(
                "the cosyvoice2 engine needs CosyVoice installed (the `cosyvoice` package on the Python path); "
                "see docs/engines.md"
            ) from None
        fp16 = self.device in ("auto", "cuda") and _cuda_available()
        self.model = CosyVoice2(self.model_dir, load_jit=False, load_trt=False, fp16=fp16)
        self._rate = int(getattr(self.model, "sample_rate", 24000))
        if self.prompt_wav:
            from cosyvoice.utils.file_utils import load_wav

            self.prompt_speech = load_wav(self.prompt_wav, 16000)

    def voices(self) -> list[str]:
        speakers: list[str] = []
        if self.model is not None and hasattr(self.model, "list_available_spks"):
            speakers = list(self.model.list_available_spks())
        if self.prompt_speech is not None:
            speakers.insert(0, "prompt")
        return speakers or ["prompt"]

    def sample_rate(self, voice: str | None = None) -> int:
        return self._rate

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[AudioChunk]:
        assert self.model is not None
        voice = options.voice or self.default_voice

        def text_pieces() -> Iterator[str]:
            # CosyVoice 2 takes text as a generator; it starts on the first piece.
            yield text

        speed = float(options.rate or 1.0)
        if voice and voice != "prompt":
            outputs = self.model.inference_sft(text, voice, stream=True, speed=speed)
        elif self.prompt_speech is not None:
            outputs = self.model.inference_zero_shot(text_pieces(), self.prompt_text, self.prompt_speech, stream=True, speed=speed)
        else:
            raise EngineError(
                "cosyvoice2 needs a voice: set VOXGATE_COSYVOICE_PROMPT_WAV and _PROMPT_TEXT, or pick a built-in speaker"
            )
        total = 0
        for out in outputs:
            speech = out["tts_speech"]
            audio = speech.detach().cpu().numpy() if hasattr(speech, "detach") else np.asarray(speech)
            pcm = (np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1, 1) * 32767).astype(np.int16)
            total += len(pcm)
            yield AudioChunk(pcm=pcm, sample_rate=self._rate, text="", unit_end=False)
        # CosyVoice gives no alignment: words are spread over the unit once its
        # length is known, on an empty closing chunk, timed back from its end.
        duration = total / self._rate
        words = [WordTiming(w.text, w.start - duration, w.end - duration) for w in words_by_length(text, duration)]
        yield AudioChunk(pcm=np.zeros(0, dtype=np.int16), sample_rate=self._rate, text=text, words=words, unit_end=True)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
