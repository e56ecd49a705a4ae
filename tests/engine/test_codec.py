"""engine/runtime/codec.py: every engine message crosses as one frame, the worker's pipe and the pool's responses alike."""

import math
import time

import numpy as np
import pytest

from voxgate.engine.runtime import codec
from voxgate.engine import proto
from voxgate.engine.base import WordTiming
from voxgate.engine.cluster.pool_protocol import check_chunk

MESSAGES = [
    proto.OpenStream(1, {"voice": "joe", "rate": 1.25}, 3, start_in_s=0.5, held_s=0.02, after=7),
    proto.PushUnit(1, 0, "Hello there."),
    proto.PushUnit(1, 1, [["speech", "slowly", 0.5], ["pause", 300]]),
    proto.EndInput(1),
    proto.Credit(1, 2),
    proto.CancelStream(1),
    proto.Ping(9),
    proto.Shutdown(),
    proto.Ready({"engine": "tone", "voices": ["tone"], "sample_rate": 16000, "synthesis_cost": np.float32(0.25)}),
    proto.Fatal("no such voice"),
    proto.Pong(9, {"steps": 3, "streams": 0}),
    proto.Load(cost=None, cores=2.0, others=0.1, capacity=math.inf, speaking=1, waiting=0, underruns=0, cpu_s=1.5),
    proto.StreamDone(1),
    proto.StreamError(1, "the engine refused the text"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    got, pcm = codec.unpack(codec.pack(message))
    assert pcm is None
    if isinstance(message, proto.Ready):
        assert got == proto.Ready({**message.info, "synthesis_cost": 0.25})  # a numpy scalar crosses as a number
    else:
        assert got == message


def test_a_chunk_carries_its_pcm_beside_it_and_its_step_start_as_a_duration():
    started = time.monotonic() - 0.2
    chunk = proto.Chunk(3, 2, 22050, "Hello there.", [WordTiming("Hello", 0.0, 0.3), WordTiming("there.", 0.3, 0.7)],
                        unit_end=False, synth_s=0.05, synth_started_at=started)
    pcm = np.arange(-500, 500, dtype=np.int16)
    frame = codec.pack(chunk, pcm)
    n_head, n_pcm = codec.frame_sizes(frame[: codec.FRAME_HEAD.size])
    assert n_pcm == pcm.nbytes and len(frame) == codec.FRAME_HEAD.size + n_head + n_pcm
    header = codec.parse_header(frame[codec.FRAME_HEAD.size : codec.FRAME_HEAD.size + n_head])
    assert 0.2 <= header["synth_ago_s"] < 5.0 and "synth_started_at" not in header
    got, got_pcm = codec.unpack(frame)
    assert np.array_equal(got_pcm, pcm)
    assert (got.sid, got.unit_index, got.sample_rate, got.text, got.words, got.unit_end, got.synth_s) == (
        3, 2, 22050, "Hello there.", chunk.words, False, 0.05)
    assert abs(got.synth_started_at - started) < 1.0
    # The same frame is what a gateway reads from a pool, every field checked there.
    fields = check_chunk(header, n_pcm)
    assert (fields.unit_index, fields.sample_rate, fields.text, fields.unit_end) == (2, 22050, "Hello there.", False)


def test_a_reader_from_the_network_refuses_frames_over_the_caps_and_unknown_kinds():
    with pytest.raises(codec.FrameError):
        codec.frame_sizes(codec.FRAME_HEAD.pack(codec.MAX_HEADER_BYTES + 1, 0))
    with pytest.raises(codec.FrameError):
        codec.frame_sizes(codec.FRAME_HEAD.pack(10, 3))  # not int16
    with pytest.raises(codec.FrameError):
        codec.parse_header(codec.pack(proto.Shutdown())[codec.FRAME_HEAD.size:])  # not a stream's kind
