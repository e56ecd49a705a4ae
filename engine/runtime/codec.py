"""The one wire format of an engine stream, local or remote.

Every message of engine/proto.py crosses as one frame, on the worker's pipe
(engine/runtime/client.py, engine/runtime/worker.py) and in the pool's streamed responses
(engine/cluster/pool_host.py, read by engine/cluster/remote_stream.py) alike:

    frame  = !II (header bytes, PCM bytes) + JSON header + raw int16 PCM
    header = {"kind": KIND, the message's fields by name}

A chunk's PCM travels beside its header as one raw buffer, never as Python
objects per sample. A chunk says when its step began as `synth_ago_s`, how long
before it was sent: a duration means the same on another process's or machine's
clock. JSON, not pickle: a pool and its gateways trust each other's shapes, never
each other's code; and one format is one thing to read and test.

A reader from the network checks a frame's sizes against the caps below before
it allocates (`frame_sizes`), and takes only a stream's kinds (`parse_header`);
engine/cluster/pool_protocol.py checks each field of a chunk.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import fields
from typing import Any

import numpy as np

from .. import proto
from ..base import WordTiming

FRAME_HEAD = struct.Struct("!II")
# Caps a reader from the network checks before it allocates: a chunk's JSON (its word
# timings) and its audio (a unit of MAX_UNIT_CHARS is at most ~20 s: 48 kHz int16 fits).
MAX_HEADER_BYTES = 256 * 1024
MAX_PCM_BYTES = 4 * 1024 * 1024

# Each message's kind on the wire. A stream's own, as the pool sends them: chunk, end, error.
KINDS: dict[str, type] = {
    "open": proto.OpenStream, "unit": proto.PushUnit, "end_input": proto.EndInput, "credit": proto.Credit,
    "cancel": proto.CancelStream, "ping": proto.Ping, "shutdown": proto.Shutdown,
    "ready": proto.Ready, "fatal": proto.Fatal, "pong": proto.Pong, "load": proto.Load,
    "chunk": proto.Chunk, "end": proto.StreamDone, "error": proto.StreamError,
}
STREAM_KINDS = ("chunk", "error", "end")
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in KINDS.values()}
# Engines may report numpy scalars in their info and counters: as plain numbers.
_dumps = json.JSONEncoder(separators=(",", ":"), default=lambda o: o.item() if hasattr(o, "item") else str(o)).encode
_loads = json.JSONDecoder().decode


class FrameError(ValueError):
    """A frame that breaks the shapes or caps above."""


def header_of(message: proto.ToWorker | proto.FromWorker) -> dict[str, Any]:
    """A message as its frame's header."""
    cls = type(message)
    header: dict[str, Any] = {"kind": _KIND_OF[cls]}
    for name in _FIELDS[cls]:
        header[name] = getattr(message, name)
    if cls is proto.Chunk:
        header["words"] = [(w.text, float(w.start), float(w.end)) for w in header["words"]]
        header["synth_ago_s"] = max(0.0, time.monotonic() - header.pop("synth_started_at"))
    return header


def message_of(header: dict[str, Any]) -> proto.ToWorker | proto.FromWorker:
    """A header from a trusted peer (the worker, the gateway) as its message."""
    kind = header.pop("kind")
    if kind == "chunk":
        header["words"] = [WordTiming(*w) for w in header["words"]]
        header["synth_started_at"] = time.monotonic() - header.pop("synth_ago_s")
    return KINDS[kind](**header)


def pack_frame(header: dict[str, Any], pcm: np.ndarray | None = None) -> bytes:
    head = _dumps(header).encode()
    body = b"" if pcm is None else np.ascontiguousarray(pcm, dtype=np.int16).tobytes()
    return FRAME_HEAD.pack(len(head), len(body)) + head + body


def pack(message: proto.ToWorker | proto.FromWorker, pcm: np.ndarray | None = None) -> bytes:
    """One message (and a chunk's PCM) as one frame."""
    return pack_frame(header_of(message), pcm)


def unpack(record: bytes) -> tuple[proto.ToWorker | proto.FromWorker, np.ndarray | None]:
    """One frame from a trusted peer (one pipe record) as its message and PCM."""
    n_head, n_pcm = FRAME_HEAD.unpack_from(record, 0)
    start = FRAME_HEAD.size
    message = message_of(_loads(record[start : start + n_head].decode()))
    pcm = np.frombuffer(record, dtype=np.int16, offset=start + n_head, count=n_pcm // 2) if n_pcm else None
    return message, pcm


def frame_sizes(prefix: bytes) -> tuple[int, int]:
    """The header and PCM sizes a frame's prefix announces, refused above the caps."""
    n_head, n_pcm = FRAME_HEAD.unpack(prefix)
    if n_head > MAX_HEADER_BYTES or n_pcm > MAX_PCM_BYTES or n_pcm % 2:
        raise FrameError(f"frame of {n_head}+{n_pcm} bytes is over the caps or not int16")
    return n_head, n_pcm


def parse_header(data: bytes) -> dict:
    """A stream frame's header from the network: JSON, and one of a stream's kinds."""
    try:
        header = json.loads(data)
    except ValueError:
        raise FrameError("frame header is not JSON") from None
    if not isinstance(header, dict) or header.get("kind") not in STREAM_KINDS:
        raise FrameError("frame header has no known kind")
    return header
