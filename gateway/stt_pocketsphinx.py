"""`--stt pocketsphinx`: CMU pocketsphinx, embedded and offline (gateway/stt.py's recognizer).

Its US English acoustic model, dictionary and language model ship inside the
pocketsphinx wheel (`pip install 'voxgate[stt]'`), so nothing is downloaded.
It is good enough for demos and tests, not for production accuracy: for that,
point --stt-url at a Whisper server. A decoder is not thread-safe and takes a
fraction of a second to load, so each of the service's threads keeps its own.

Each turn is padded with PAD_S of silence at both ends (the model misreads a
last word with little silence after it, and the VAD's cut leaves its hangover
only), and gets a microphone's noise floor added (NOISE_FLOOR, about -61 dBFS,
the same seeded noise every time, so the same audio gives the same text):
stretches of digital silence (a client's DTX gaps, a caller sending zeros)
otherwise throw the model's energy normalisation off. On the espeak-ng turns
of tests/transcripts.py it halves the word error rate (docs/benchmarks.md).
"""

from __future__ import annotations

import threading

import numpy as np

from ..config import ConfigError

NOISE_FLOOR = 30.0  # RMS of the added noise, in int16 steps
PAD_S = 0.5


class Pocketsphinx:
    name = "pocketsphinx"
    threaded = True

    def __init__(self) -> None:
        try:
            import pocketsphinx  # noqa: F401
        except ImportError:
            raise ConfigError("--stt pocketsphinx needs the pocketsphinx package: pip install 'voxgate[stt]'") from None
        self._local = threading.local()
        self._decoder()  # load once now: a broken install fails at start, not on the first turn

    def _decoder(self):
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            from pocketsphinx import Decoder

            decoder = self._local.decoder = Decoder(samprate=16000, loglevel="FATAL")
        return decoder

    def recognize(self, pcm: np.ndarray) -> str:
        """The text of 16 kHz mono int16 speech; runs in one of the service's threads."""
        decoder = self._decoder()
        decoder.start_utt()
        pad = np.zeros(int(16000 * PAD_S))
        audio = np.concatenate([pad, np.asarray(pcm, dtype=np.float64), pad])
        audio += np.random.default_rng(0).normal(0.0, NOISE_FLOOR, len(audio))
        audio = np.clip(audio, -32768, 32767).astype("<i2")
        decoder.process_raw(audio.tobytes(), full_utt=True)
        decoder.end_utt()
        hyp = decoder.hyp()
        return hyp.hypstr if hyp else ""

    async def recognize_async(self, pcm: np.ndarray) -> str:  # pragma: no cover - threaded
        raise NotImplementedError

    async def close(self) -> None:
        pass
