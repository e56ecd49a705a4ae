"""libspeexdsp's acoustic echo canceller and its residual-echo suppressor, through ctypes.

Debian's `libspeexdsp1` (1.2) holds both: `speex_echo_*`, an adaptive filter
(MDF) that learns the echo path from the played reference and subtracts its
estimate from the microphone, and `speex_preprocess_*`, whose echo suppressor
takes out what the filter leaves, frame by frame, from the canceller's own
estimate of that residue. ctypes releases the GIL while libspeexdsp runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np

_ECHO_SET_SAMPLING_RATE = 24
_PREPROCESS_SET_DENOISE = 0
_PREPROCESS_SET_AGC = 2
_PREPROCESS_SET_DEREVERB = 8
_PREPROCESS_SET_ECHO_SUPPRESS = 20
_PREPROCESS_SET_ECHO_SUPPRESS_ACTIVE = 22
_PREPROCESS_SET_ECHO_STATE = 24


class SpeexUnavailable(RuntimeError):
    """libspeexdsp could not be loaded: `apt-get install libspeexdsp1`."""


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    names = [ctypes.util.find_library("speexdsp"), "libspeexdsp.so.1", "libspeexdsp.so"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.speex_echo_state_init.restype = ctypes.c_void_p
        lib.speex_echo_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.speex_echo_state_destroy.argtypes = [ctypes.c_void_p]
        lib.speex_echo_state_reset.argtypes = [ctypes.c_void_p]
        lib.speex_echo_cancellation.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.speex_echo_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.speex_preprocess_state_init.restype = ctypes.c_void_p
        lib.speex_preprocess_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.speex_preprocess_state_destroy.argtypes = [ctypes.c_void_p]
        lib.speex_preprocess_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.speex_preprocess_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        return lib
    raise SpeexUnavailable("libspeexdsp is not installed (Debian: apt-get install libspeexdsp1)")


def available() -> bool:
    try:
        library()
    except SpeexUnavailable:
        return False
    return True


class EchoCanceller:
    """One microphone's canceller: `frame` samples of int16 at `rate` per call, an echo
    tail of `filter_length` samples after the reference it is given."""

    def __init__(self, frame: int, filter_length: int, rate: int, *, suppress_db: int = -40,
                 suppress_active_db: int = -15) -> None:
        lib = library()
        self.frame = frame
        self._echo = lib.speex_echo_state_init(frame, filter_length)
        self._pre = lib.speex_preprocess_state_init(frame, rate)
        if not self._echo or not self._pre:
            raise SpeexUnavailable("libspeexdsp could not make its states")
        value = ctypes.c_int(rate)
        lib.speex_echo_ctl(self._echo, _ECHO_SET_SAMPLING_RATE, ctypes.byref(value))
        # Only the echo suppressor: no denoising or gain control, which would change the caller's
        # speech under the gateway's VAD (its own VAD is off by default; setting it prints a warning).
        for request, setting in ((_PREPROCESS_SET_DENOISE, 0), (_PREPROCESS_SET_AGC, 0), (_PREPROCESS_SET_DEREVERB, 0),
                                 (_PREPROCESS_SET_ECHO_SUPPRESS, suppress_db),
                                 (_PREPROCESS_SET_ECHO_SUPPRESS_ACTIVE, suppress_active_db)):
            value = ctypes.c_int(setting)
            lib.speex_preprocess_ctl(self._pre, request, ctypes.byref(value))
        lib.speex_preprocess_ctl(self._pre, _PREPROCESS_SET_ECHO_STATE, ctypes.c_void_p(self._echo))
        self._out = np.zeros(frame, dtype=np.int16)
        self._run_echo = lib.speex_echo_cancellation
        self._run_pre = lib.speex_preprocess_run

    def process(self, mic: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """One frame of microphone and the reference whose echo it may hold; the microphone
        without that echo (a new array)."""
        mic = np.ascontiguousarray(mic, dtype=np.int16)
        reference = np.ascontiguousarray(reference, dtype=np.int16)
        if len(mic) != self.frame or len(reference) != self.frame:
            raise ValueError(f"the canceller takes frames of {self.frame} samples")
        out = np.empty(self.frame, dtype=np.int16)
        self._run_echo(self._echo, mic.ctypes.data, reference.ctypes.data, out.ctypes.data)
        self._run_pre(self._pre, out.ctypes.data)
        return out

    def reset(self) -> None:
        library().speex_echo_state_reset(self._echo)

    def close(self) -> None:
        lib = library()
        echo, self._echo = getattr(self, "_echo", None), None
        pre, self._pre = getattr(self, "_pre", None), None
        if pre:
            lib.speex_preprocess_state_destroy(pre)
        if echo:
            lib.speex_echo_state_destroy(echo)

    def __del__(self) -> None:
        self.close()
