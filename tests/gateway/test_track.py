"""SpeechTrack and SilentOutput (gateway/media/track.py): frames from the playout, on the pacer's ticks, with RTP timing.

The pacer runs on a frame clock whose time moves only when it sleeps (the
pacer's own schedule is tested in test_pacer_vad_ice.py), so a test of many
frames takes no wall time and the RTP arithmetic is exact.
"""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest
from aiortc.mediastreams import MediaStreamError

from voxgate.gateway.media.pacer import FrameClock, Pacer
from voxgate.gateway.media.playout import Playout, UtterancePlay
from voxgate.gateway.media.track import KEEPALIVE_FRAMES, SilentOutput, SpeechTrack

SILENCE = b"\xf8\xff\xfe"


class InstantTime:
    """A clock for the frame clock: each sleep ends at once and moves time on by its length.

    With `hold` set, sleeps end only when the pacer is woken (or `hold` is resolved).
    """

    def __init__(self) -> None:
        self.t = 100.0
        self.hold: asyncio.Future | None = None

    def now(self) -> float:
        return self.t

    async def sleep(self, delay: float, interrupt: asyncio.Future) -> None:
        await asyncio.sleep(0)
        if self.hold is not None:
            await asyncio.wait([self.hold, interrupt], return_when=asyncio.FIRST_COMPLETED)
        if not interrupt.done():
            self.t += max(0.0, delay)


def track_with(frames: list[bytes] | None = None, dtx: bool = False, clock_rate: int = 48000) -> tuple[SpeechTrack, Playout, InstantTime]:
    time_source = InstantTime()
    playout = Playout(SILENCE)
    if frames:
        play = UtterancePlay(id="u")
        playout.add(play)
        playout.push(play, frames)
        playout.finish(play)
    track = SpeechTrack(playout=playout, clock_rate=clock_rate, pacer=Pacer(clock=FrameClock(time_source=time_source)), dtx=dtx)
    return track, playout, time_source


async def test_frames_leave_in_order_then_silence_with_pts_counting_every_frame():
    frames = [bytes([i]) * 10 for i in range(5)]
    track, playout, _ = track_with(frames)
    departures = []
    track.on_departure = departures.append
    packets = [await track.recv() for _ in range(7)]
    assert [bytes(p) for p in packets] == frames + [SILENCE, SILENCE]
    assert [p.pts for p in packets] == [960 * k for k in range(7)]
    assert all(p.time_base == Fraction(1, 48000) for p in packets)
    assert len(departures) == 7 and departures == sorted(departures)
    assert playout.stats.utterances == 1


async def test_g711_clock_counts_160_samples_a_frame():
    track, _, _ = track_with([b"a" * 160] * 3)
    track.set_clock_rate(8000)
    packets = [await track.recv() for _ in range(3)]
    assert [p.pts for p in packets] == [0, 160, 320]
    assert packets[0].time_base == Fraction(1, 8000)


async def test_dtx_sends_a_keepalive_while_idle_and_the_rtp_clock_keeps_counting():
    track, playout, _ = track_with(dtx=True)
    first, second = await track.recv(), await track.recv()
    assert bytes(first) == bytes(second) == SILENCE
    # One packet per KEEPALIVE_FRAMES frames, and the timestamps say how much time passed.
    assert second.pts - first.pts == 960 * KEEPALIVE_FRAMES
    play = UtterancePlay(id="u")
    playout.add(play)
    playout.push(play, [b"speech"])
    third = await track.recv()
    assert bytes(third) == b"speech"


async def test_dtx_keepalives_count_the_frames_they_cover_and_are_not_pacer_jitter():
    """A keep-alive's interval is 20 frames by design: as jitter it would read as a 380 ms stall."""
    track, playout, _ = track_with(dtx=True)
    intervals, covered = [], []
    track.pacer.on_frame = lambda interval, lateness: intervals.append(interval)
    track.pacer.on_keepalive = covered.append
    for _ in range(3):
        await track.recv()
    assert intervals == [] and covered == [KEEPALIVE_FRAMES] * 3
    assert track.pacer.stats.keepalive_frames == 3 * KEEPALIVE_FRAMES and track.pacer.stats.late_frames == 0
    play = UtterancePlay(id="u")
    playout.add(play)
    playout.push(play, [b"a", b"b", b"c"])
    for _ in range(3):
        await track.recv()
    # The first speech frame is woken early (not jitter); the next two are 20 ms apart.
    assert len(intervals) == 2 and all(abs(i - 0.020) < 1e-6 for i in intervals), intervals


async def test_a_wake_inside_a_keepalive_wait_counts_the_frames_it_covered():
    track, playout, time_source = track_with(dtx=True)
    covered = []
    track.pacer.on_keepalive = covered.append
    await track.recv()
    time_source.hold = asyncio.get_running_loop().create_future()
    pending = asyncio.ensure_future(track.recv())
    while track.pacer._sleeper is None:  # until the track waits on its next keep-alive
        await asyncio.sleep(0)
    time_source.t += 10 * 0.020  # ten frames into the next keep-alive's wait
    play = UtterancePlay(id="u")
    playout.add(play)
    playout.push(play, [b"speech"])  # wakes the track
    assert bytes(await asyncio.wait_for(pending, 5)) == b"speech"
    assert covered == [KEEPALIVE_FRAMES, 9]  # the nine between the keep-alive and the speech


async def test_new_speech_wakes_an_idle_track_without_waiting_for_its_tick():
    track, playout, time_source = track_with()
    await track.recv()
    time_source.hold = asyncio.get_running_loop().create_future()  # the next tick never comes by itself
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.01)
    assert not pending.done()
    play = UtterancePlay(id="u")
    playout.add(play)
    playout.push(play, [b"speech"])  # the playout's on_ready is the pacer's wake
    packet = await asyncio.wait_for(pending, 5)
    assert bytes(packet) == b"speech"


async def test_a_stopped_track_raises_media_stream_error():
    track, _, _ = track_with()
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


async def test_silent_output_plays_utterances_in_real_time_without_a_track():
    playout = Playout(b"")
    done = asyncio.get_running_loop().create_future()
    playout.on_done = lambda play: done.set_result(play)
    output = SilentOutput(playout)
    output.start()
    try:
        play = UtterancePlay(id="u")
        playout.add(play)
        playout.push(play, [b""] * 5)
        playout.finish(play)
        finished = await asyncio.wait_for(done, 10)
        assert finished is play and play.sent_frames == 5 and play.played_ms == 100
    finally:
        output.stop()
