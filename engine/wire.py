"""Messages between the gateway and the engine worker.

Each message is one pipe record: a 4-byte header length, a pickled header
tuple, then (for audio) the raw int16 samples. Samples cross as one buffer
copy, never as Python objects per sample.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np

_LEN = struct.Struct("!I")


def pack(header: tuple, pcm: np.ndarray | None = None) -> bytes:
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    body = b"" if pcm is None else np.ascontiguousarray(pcm, dtype=np.int16).tobytes()
    return _LEN.pack(len(head)) + head + body


def unpack(record: bytes) -> tuple[tuple, np.ndarray | None]:
    (n,) = _LEN.unpack_from(record, 0)
    header = pickle.loads(record[_LEN.size : _LEN.size + n])
    rest = memoryview(record)[_LEN.size + n :]
    pcm = np.frombuffer(rest, dtype=np.int16) if len(rest) else None
    return header, pcm
