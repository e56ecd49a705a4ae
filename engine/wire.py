"""How one message (engine/proto.py) crosses the pipe between gateway and worker.

Each message is one pipe record: a 4-byte header length, the pickled message,
then (for audio) the raw int16 samples. Samples cross as one buffer copy,
never as Python objects per sample.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np

from .proto import FromWorker, ToWorker

_LEN = struct.Struct("!I")


def pack(message: ToWorker | FromWorker, pcm: np.ndarray | None = None) -> bytes:
    head = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    body = b"" if pcm is None else np.ascontiguousarray(pcm, dtype=np.int16).tobytes()
    return _LEN.pack(len(head)) + head + body


def unpack(record: bytes) -> tuple[ToWorker | FromWorker, np.ndarray | None]:
    (n,) = _LEN.unpack_from(record, 0)
    message = pickle.loads(record[_LEN.size : _LEN.size + n])
    rest = memoryview(record)[_LEN.size + n :]
    pcm = np.frombuffer(rest, dtype=np.int16) if len(rest) else None
    return message, pcm
