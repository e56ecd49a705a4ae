"""Stand-in for CosyVoice 2's API surface (see tests/stand_ins/README.md)."""

import numpy as np

from voxgate.engine import tone

CALLS = []


class CosyVoice2:
    def __init__(self, model_dir, load_jit=False, load_trt=False, fp16=False, **_):
        self.model_dir = model_dir
        self.sample_rate = 24000
        CALLS.append(("init", model_dir, fp16))

    def list_available_spks(self):
        return ["中文女", "英文男"]

    def _speak(self, text, speed):
        audio = tone.encode(text, self.sample_rate).astype(np.float32) / 32767.0
        # Three streamed pieces, as stream=True yields chunk by chunk.
        for piece in np.array_split(audio, 3):
            yield {"tts_speech": piece.reshape(1, -1)}

    def inference_sft(self, tts_text, spk_id, stream=False, speed=1.0, text_frontend=True):
        CALLS.append(("sft", tts_text, spk_id, stream))
        yield from self._speak(tts_text, speed)

    def inference_zero_shot(self, tts_text, prompt_text, prompt_speech_16k, zero_shot_spk_id="", stream=False, speed=1.0, text_frontend=True):
        text = tts_text if isinstance(tts_text, str) else "".join(tts_text)  # bi-streaming: a generator of text
        CALLS.append(("zero_shot", text, prompt_text, stream))
        yield from self._speak(text, speed)
