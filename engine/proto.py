"""The messages between the gateway and the engine worker, one small class each.

Every message is a typed record (in the manner of LiveKit Agents' ipc/proto.py),
so both sides name fields instead of taking tuples apart by position. `codec.py`
frames them; a chunk's PCM crosses next to its `Chunk` message as one raw
int16 buffer, never inside it.

Gateway to worker, per stream: `OpenStream`, `PushUnit`, `EndInput`, `Credit`,
`CancelStream`; and for the process: `Ping`, `Shutdown`.
Worker to gateway: `Ready` or `Fatal` once at start; per stream `Chunk`,
`StreamDone` or `StreamError`; `Pong` for a `Ping`; `Load` about once a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import WordTiming

# The most audio a consumer may say it holds back (OpenStream.held_s): the
# gateway's is tens of milliseconds; more would only rank its streams first.
MAX_HELD_S = 0.2
# OpenStream.after may name a stream that has ended, among the last this many
# (the worker and the pool client keep them): an LLM's next sentence arrives
# once the last one is synthesized, long before it has played.
MAX_ENDED = 1024

# A unit as it travels: plain text, or speech-tag pieces (engine/text/tags.py, to_wire).
UnitPayload = str | list


# Gateway -> worker
@dataclass(slots=True)
class OpenStream:
    sid: int
    options: dict  # SynthesisOptions.to_dict()
    credit: int  # chunks the worker may make before it waits for Credit
    # Seconds until the listener needs the first audio: a duration, not a time,
    # so that it means the same on another process's (or machine's) clock.
    start_in_s: float = 0.0
    # Audio the consumer keeps back from its listener while the stream lasts (a
    # resampler's delay, a part of a frame): the listener runs dry this much
    # sooner than the audio sent says, and the worker's deadlines say so.
    held_s: float = 0.0
    # The stream whose audio the same listener hears first (an utterance queued
    # behind another; still open, or among the last MAX_ENDED that ended): this
    # one is needed once that one's audio runs out.
    after: int | None = None


@dataclass(slots=True)
class PushUnit:
    sid: int
    index: int  # the unit's place in its stream, from 0
    payload: UnitPayload


@dataclass(slots=True)
class EndInput:
    sid: int


@dataclass(slots=True)
class Credit:
    sid: int
    chunks: int = 1


@dataclass(slots=True)
class CancelStream:
    sid: int


@dataclass(slots=True)
class Ping:
    token: int


@dataclass(slots=True)
class Shutdown:
    pass


# Worker -> gateway
@dataclass(slots=True)
class Ready:
    info: dict  # Engine.info(), plus load_s and pid


@dataclass(slots=True)
class Fatal:
    message: str  # the engine could not be created or loaded


@dataclass(slots=True)
class Pong:
    token: int
    stats: dict  # the scheduler's counters


@dataclass(slots=True)
class Load:
    """What the worker's synthesis costs and carries (engine/runtime/capacity.py), about once a second."""

    cost: float | None  # core-seconds of synthesis per second of audio, measured; None before any
    cores: float  # cores synthesis may use here (its step slots, within the usable cores)
    others: float  # cores that other processes keep busy, smoothed
    capacity: float  # listeners the scheduler plans to keep speaking at 1x real time (inf: unmeasured)
    speaking: int  # listeners it keeps speaking now (streams that have started, and those queued behind them)
    waiting: int  # streams whose listener waits for first audio and that may not start yet
    underruns: int  # chunks of started streams sent after their listener ran out of audio, so far
    cpu_s: float  # the worker process's CPU seconds so far


@dataclass(slots=True)
class Chunk:
    """One chunk's description; its PCM travels beside it as a raw buffer."""

    sid: int
    unit_index: int
    sample_rate: int
    text: str
    words: list[WordTiming] = field(default_factory=list)
    unit_end: bool = True
    synth_s: float = 0.0  # how long the step took
    # When the step began (time.monotonic: the same clock in both processes).
    synth_started_at: float = 0.0


@dataclass(slots=True)
class StreamDone:
    sid: int


@dataclass(slots=True)
class StreamError:
    sid: int
    message: str  # the engine's own words: for the server log, not for clients


ToWorker = OpenStream | PushUnit | EndInput | Credit | CancelStream | Ping | Shutdown
FromWorker = Ready | Fatal | Pong | Load | Chunk | StreamDone | StreamError
