"""The caller's audio in 20 ms frames on the session's clock, and the messages backends receive."""

import numpy as np

from voxgate.gateway.caller.caller_audio import FRAME_HEADER, FRAME_SAMPLES, CallerAudio, pack_frame, unpack_frame


def collect():
    frames, messages = [], []
    audio = CallerAudio(lambda pcm, ms, level: frames.append((None if pcm is None else pcm.copy(), ms, level)))
    audio.taps["b"] = messages.append
    return audio, frames, messages


def test_chunks_are_cut_into_frames_each_with_its_capture_time():
    audio, frames, messages = collect()
    pcm = np.arange(3 * FRAME_SAMPLES, dtype=np.int16)
    audio.audio(pcm, 1000.0)
    assert [ms for _, ms, _ in frames] == [1000.0, 1020.0, 1040.0]
    assert np.array_equal(np.concatenate([p for p, _, _ in frames]), pcm)
    assert [unpack_frame(m)[:2] for m in messages] == [(0, 1000), (1, 1020), (2, 1040)]
    assert all(len(m) == FRAME_HEADER.size + 2 * FRAME_SAMPLES for m in messages)
    assert np.array_equal(unpack_frame(messages[1])[2], pcm[FRAME_SAMPLES : 2 * FRAME_SAMPLES])


def test_a_remainder_joins_the_next_chunk_only_when_it_continues_it():
    audio, frames, _ = collect()
    audio.audio(np.ones(FRAME_SAMPLES + 100, np.int16), 0.0)  # 100 samples left over
    audio.audio(np.full(FRAME_SAMPLES - 100, 2, np.int16), 26.25)  # continues them: 20 + 100/16 ms
    assert [ms for _, ms, _ in frames] == [0.0, 20.0]
    assert list(frames[1][0][:100]) == [1] * 100 and frames[1][0][100] == 2
    audio.audio(np.ones(100, np.int16), 40.0)
    audio.audio(np.ones(FRAME_SAMPLES, np.int16), 500.0)  # far from where the remainder ended: it is dropped
    assert [ms for _, ms, _ in frames][-1] == 500.0 and len(frames) == 3


def test_frames_not_decoded_go_to_backends_as_silence_and_keep_the_count():
    audio, frames, messages = collect()
    audio.audio(np.full(FRAME_SAMPLES, 7, np.int16), 100.0)
    audio.gap(2, -60.0)
    audio.audio(np.full(FRAME_SAMPLES, 7, np.int16), 160.0)
    assert [(p is None, ms, level) for p, ms, level in frames] == [
        (False, 100.0, None), (True, 120.0, -60.0), (True, 140.0, -60.0), (False, 160.0, None)]
    seqs = [unpack_frame(m)[0] for m in messages]
    assert seqs == [0, 1, 2, 3] and not unpack_frame(messages[1])[2].any()


def test_the_header_is_little_endian_and_capture_times_are_whole_ms():
    message = pack_frame(0x01020304, 1234.9, np.array([1, -2], np.int16))
    assert message[:8] == bytes([4, 3, 2, 1]) + (1234).to_bytes(4, "little")
    assert message[8:] == b"\x01\x00\xfe\xff"
    # Audio captured before the session was made (a call's first frame, 20 ms before it arrived).
    assert unpack_frame(pack_frame(7, -16.2, np.zeros(1, np.int16)))[:2] == (7, -17)


def test_a_better_placement_is_reached_by_slewing_not_by_a_jump():
    audio, frames, _ = collect()
    audio.audio(np.zeros(FRAME_SAMPLES, np.int16), 100.0)  # placed by a packet that came late
    for i in range(1, 30):  # then faster packets place the stream 16 ms earlier
        audio.audio(np.zeros(FRAME_SAMPLES, np.int16), 84.0 + 20 * i)
    steps = np.diff([ms for _, ms, _ in frames])
    assert np.all((steps >= 19.0) & (steps <= 20.0)) and frames[-1][1] == 84.0 + 20 * 29
    audio.audio(np.zeros(FRAME_SAMPLES, np.int16), 5000.0)  # far away: a jump
    assert frames[-1][1] == 5000.0
