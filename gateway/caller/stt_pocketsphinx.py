"""`--stt pocketsphinx`: CMU pocketsphinx, embedded and offline (gateway/caller/stt.py's recognizer).

Its US English acoustic model, dictionary and language model ship inside the
pocketsphinx wheel (`pip install ".[stt]"` in the clone), so nothing is downloaded.
It is good enough for demos and tests, not for production accuracy: for that,
point --stt-url at a Whisper server.

The decoder holds the GIL while it works (about half a second per second of
speech here), so run in the gateway's process it would stall the event loop,
and with it every session's frames, for as long. It runs in worker processes
instead, one per --stt-max-concurrent slot, each with its decoder loaded at
start; the service's thread for a turn only waits on one.

Each turn is padded with PAD_S of silence at both ends (the model misreads a
last word with little silence after it, and the VAD's cut leaves its hangover
only), and gets a microphone's noise floor added (NOISE_FLOOR, about -61 dBFS,
the same seeded noise every time, so the same audio gives the same text):
stretches of digital silence (a client's DTX gaps, a caller sending zeros)
otherwise throw the model's energy normalisation off. On the espeak-ng turns
of tests/transcripts.py it halves the word error rate (docs/benchmarks.md).
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ...config import ConfigError

NOISE_FLOOR = 30.0  # RMS of the added noise, in int16 steps
PAD_S = 0.5

_local = threading.local()  # a decoder is not thread-safe: one per thread that decodes


def _decoder():
    decoder = getattr(_local, "decoder", None)
    if decoder is None:
        from pocketsphinx import Decoder

        decoder = _local.decoder = Decoder(samprate=16000, loglevel="FATAL")
    return decoder


def decode(pcm: np.ndarray) -> str:
    """The text of 16 kHz mono int16 speech, decoded in this process (and thread).

    What the service's workers run; tests and benchmarks call it directly to
    recognize audio offline, the same way."""
    decoder = _decoder()
    decoder.start_utt()
    pad = np.zeros(int(16000 * PAD_S))
    audio = np.concatenate([pad, np.asarray(pcm, dtype=np.float64), pad])
    audio += np.random.default_rng(0).normal(0.0, NOISE_FLOOR, len(audio))
    audio = np.clip(audio, -32768, 32767).astype("<i2")
    decoder.process_raw(audio.tobytes(), full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp else ""


def _loaded() -> bool:
    return _decoder() is not None


class Pocketsphinx:
    name = "pocketsphinx"
    threaded = True  # recognize() blocks a thread of the service's, which waits on a worker process

    def __init__(self, workers: int = 1) -> None:
        try:
            import pocketsphinx  # noqa: F401
        except ImportError:
            raise ConfigError("--stt pocketsphinx needs the pocketsphinx package: pip install \".[stt]\" in the clone") from None
        self.workers = workers
        self._lock = threading.Lock()
        self._procs = self._start()

    def _start(self) -> ProcessPoolExecutor:
        # spawn, not fork: the gateway has threads (aiortc, encoding) that a fork would copy mid-step.
        procs = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_decoder)
        # Every worker up with its decoder loaded now: a broken install fails at start, not on the first turn,
        # and no turn waits for a process to start (one is spawned per job submitted while none is idle).
        try:
            for loading in [procs.submit(_loaded) for _ in range(self.workers)]:
                loading.result()
        except BaseException:
            procs.shutdown(wait=False, cancel_futures=True)
            raise
        return procs

    def recognize(self, pcm: np.ndarray) -> str:
        """The text of 16 kHz mono int16 speech; runs in one of the service's threads."""
        procs = self._procs
        try:
            return procs.submit(decode, np.asarray(pcm, dtype=np.int16)).result()
        except BrokenProcessPool:
            # A worker died (killed, out of memory): this turn fails, the next gets fresh workers.
            with self._lock:
                if self._procs is procs:
                    self._procs = self._start()
            procs.shutdown(wait=False, cancel_futures=True)
            raise

    async def recognize_async(self, pcm: np.ndarray) -> str:  # pragma: no cover - threaded
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stops the workers (a turn still decoding ends with them)."""
        self._procs.shutdown(wait=False, cancel_futures=True)

    async def close(self) -> None:
        self.shutdown()
